"""Capture a model as an annotated ATen-level fx graph (see :class:`ColoTracer`)."""

from .capture import ColoTracer, TracedModel, capture
from .annotate import NodeInfo, node_info

__all__ = ["ColoTracer", "TracedModel", "capture", "NodeInfo", "node_info"]
