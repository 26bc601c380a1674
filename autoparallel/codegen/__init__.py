"""The emitted module."""

from .module import ParallelModule

__all__ = ["ParallelModule"]
