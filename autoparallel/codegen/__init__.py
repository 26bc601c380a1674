"""The emitted module and the runtime functions its code calls."""

from .module import ParallelModule

__all__ = ["ParallelModule"]
