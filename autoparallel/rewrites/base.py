"""What every emit-time rewrite says: where it applies, what it changes in memory, the graph change."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch.fx as fx

from ..strategies.engine import Strategy

Size = Callable[[Strategy], int]
"""Bytes per device of one tensor under a strategy of the node that owns it."""


class Rewrite(ABC):
    """One exact rewrite of the per-device graph, run after planning on local tensors, so that
    the plan (placements, collectives, their order and cost) stays what it was.

    Planning reads the captured graph, the module runs the rewritten one: the memory model
    asks :meth:`saved_size` how much of each tensor an op keeps for its backward in the graph
    that runs, and the lowering runs :meth:`apply`. Both read the one registry,
    :data:`autoparallel.rewrites.REWRITES`.
    """

    name: str
    """A short name for logs and counts."""

    @abstractmethod
    def applies(self, node: fx.Node) -> bool:
        """Whether ``node``, of the captured graph, has the form this rewrite changes. The plan
        may still rule it out (:meth:`apply` and :meth:`saved_size` check the placements)."""

    @abstractmethod
    def saved_size(self, saver: fx.Node, operand: fx.Node | None, shape: tuple[int, ...], size: Size) -> Size:
        """The per-device bytes of a tensor of global ``shape`` that captured node ``saver``
        keeps for its backward, in the graph this rewrite emits: its input ``operand``, or, with
        ``operand`` ``None``, a tensor of its own (SDPA's logsumexp, a mask's float copy).
        ``size`` is what the memory model counts without this rewrite; return it where the
        rewrite does not change it."""

    def gradient_size(self, saver: fx.Node, size: Size) -> Size:
        """The per-device bytes of the buffer captured node ``saver``'s backward holds for the
        gradient of a floating tensor it saved of its own (``size``: the memory model's count
        for autograd's backward; return it where the rewrite does not change that)."""
        return size

    @abstractmethod
    def apply(self, graph: fx.Graph, source_graph: fx.Graph, plan) -> int:
        """Rewrite ``graph`` in place: a per-device graph whose nodes name their captured node in
        ``meta["source"]``; ``source_graph`` is the captured graph and ``plan`` the plan
        ``graph`` was lowered from. Returns how many sites were rewritten; the caller recompiles."""
