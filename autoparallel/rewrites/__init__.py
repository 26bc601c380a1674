"""The emit-time rewrites: exact changes to the per-device graph after planning, one object each.

Each :class:`Rewrite` says where it applies (:meth:`~Rewrite.applies`), what the graph that runs
keeps for the backward that the captured one does not (:meth:`~Rewrite.saved_size`) and how it
rewrites the per-device graph (:meth:`~Rewrite.apply`). The memory model
(:mod:`autoparallel.solver.memory`) and the lowering read the same registry, :data:`REWRITES`,
through :func:`saved_size` and :func:`apply_rewrites`. A new rewrite is one module here and one
entry there.
"""

from __future__ import annotations

import torch.fx as fx

from .base import Rewrite, Size
from .causal_mask import CausalMaskAsFlag
from .cross_entropy import OnePassCrossEntropy
from .fused_parts import FusedProjectionParts
from .gqa import GroupedQueryAttention

__all__ = ["REWRITES", "Rewrite", "Size", "apply_rewrites", "saved_size"]

REWRITES: tuple[Rewrite, ...] = (FusedProjectionParts(), GroupedQueryAttention(), CausalMaskAsFlag(),
                                 OnePassCrossEntropy())
"""Every rewrite, in the order the lowering runs them."""


def apply_rewrites(graph: fx.Graph, source_graph: fx.Graph, plan) -> dict[str, int]:
    """Run every rewrite of :data:`REWRITES`, in order, on the per-device ``graph`` (in place; its
    nodes name their captured node in ``meta["source"]``) lowered from ``source_graph`` under
    ``plan``. Returns how many sites each rewrote, by name; the caller recompiles."""
    return {r.name: r.apply(graph, source_graph, plan) for r in REWRITES}


def saved_size(saver: fx.Node, operand: fx.Node | None, shape: tuple[int, ...], size: Size) -> Size:
    """The per-device bytes of a tensor that captured node ``saver`` keeps for its backward, as
    the rewritten graph keeps it: ``size`` passed through every rewrite's
    :meth:`Rewrite.saved_size` (arguments as there)."""
    for r in REWRITES:
        size = r.saved_size(saver, operand, shape, size)
    return size


def gradient_size(saver: fx.Node, size: Size) -> Size:
    """The per-device bytes the backward of captured node ``saver`` holds for the gradient of
    a tensor it saved of its own, in the rewritten graph: ``size`` passed through every
    rewrite's :meth:`Rewrite.gradient_size`."""
    for r in REWRITES:
        size = r.gradient_size(saver, size)
    return size
