"""The per-device cross-entropy with a one-pass backward."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from ..graph import op_args
from ..runtime_kernels.cross_entropy import cross_entropy_loss
from .base import Rewrite, Size

aten = torch.ops.aten


class OnePassCrossEntropy(Rewrite):
    """:func:`~autoparallel.runtime_kernels.cross_entropy.cross_entropy_loss` for
    ``aten.cross_entropy_loss`` over whole classes.

    Matches: an ``aten.cross_entropy_loss`` of the per-device graph (the plan keeps the class
    dim of the logits whole: data parallel, a 1-device mesh, any split of the rows) whose
    captured logits are ``(N, C)`` and class indices int64 ``(N,)``, with no class weight and no
    label smoothing (a vocab-parallel loss is a different op,
    :func:`~autoparallel.runtime_kernels.cross_entropy.vocab_parallel_cross_entropy`). Autograd
    derives that op's backward through ``nll_loss`` and ``log_softmax``: a zero buffer of the
    logits' size, the target's gradient scattered into it, ``log_softmax_backward`` over it.

    Exact: the kernel runs the same forward ops, so the loss is torch's; its backward,
    ``exp(log_softmax) · g`` with ``g`` subtracted at each target, equals autograd's up to
    rounding (the kernel's docstring). The plan and its collectives are unchanged.

    Memory: the kernel's backward holds one logits-sized buffer (the logits' gradient) instead
    of two: autograd's gradient of the saved log-softmax is not made (:meth:`gradient_size`).
    """

    name = "cross_entropy"

    def applies(self, node: fx.Node) -> bool:
        """``node`` is a cross-entropy on 2-D logits and int64 targets, no weight, no smoothing."""
        if node.target is not aten.cross_entropy_loss.default:
            return False
        a = op_args(node)
        x, t = a["self"].meta.get("val"), a["target"].meta.get("val")
        return (a["weight"] is None and a["label_smoothing"] == 0.0 and isinstance(x, torch.Tensor) and x.dim() == 2
                and isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype == torch.int64)

    def saved_size(self, saver: fx.Node, operand: fx.Node | None, shape: tuple[int, ...], size: Size) -> Size:
        """Unchanged: the kernel saves the log-softmax as autograd does."""
        return size

    def gradient_size(self, saver: fx.Node, size: Size) -> Size:
        """Nothing where this kernel runs (the strategy keeps the classes whole) or where the
        classes are split: then the vocab-parallel loss runs
        (:func:`~autoparallel.strategies.losses.local_cross_entropy`), which saves the logits
        (the size of the log-softmax counted for it) and whose backward, like this kernel's,
        writes the logits' gradient directly, with no buffer for the log-softmax's (GPT-2,
        vocabulary split over 2 devices, sequence 1024: modelled +19.7 % of the measured peak
        with that buffer counted, an item the size of the logits' shard)."""
        if saver.target is not aten.cross_entropy_loss.default:
            return size
        kernel = self.applies(saver)

        def gradient(s):
            split = any(isinstance(p, Shard) and p.dim == 1 for p in s.inputs[0])
            return 0 if split or kernel else size(s)

        return gradient

    def apply(self, graph: fx.Graph, source_graph: fx.Graph, plan) -> int:
        traced_nodes = {n.name: n for n in source_graph.nodes}
        count = 0
        for node in graph.nodes:
            source = traced_nodes.get(node.meta.get("source"))
            if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default or source is None \
                    or not self.applies(source):
                continue
            a = op_args(node)
            node.target = cross_entropy_loss
            node.args, node.kwargs = (a["self"], a["target"], a["reduction"], a["ignore_index"]), {}
            count += 1
        return count
