"""Graph transformations that apply a Plan."""

from .apply_plan import apply_plan

__all__ = ["apply_plan"]
