"""The per-device cross-entropy with a one-pass backward.

Where a device computes a softmax cross-entropy over whole classes (the plan keeps the class
dim of the logits whole: data parallel, a 1-device mesh, any split of the rows), the per-device
graph calls ``aten.cross_entropy_loss``, whose backward autograd derives through ``nll_loss``
and ``log_softmax``. :func:`fuse_cross_entropy` gives each such call
:func:`~autoparallel.runtime_kernels.cross_entropy.cross_entropy_loss` instead: the same
forward ops, and a backward of one pass over the logits instead of three and one buffer of
their size instead of two (its docstring). The plan, its collectives and the loss values are
unchanged; the gradient equals autograd's up to rounding.

Only the case it computes is rewritten: logits ``(N, C)``, int64 class indices ``(N,)``, no
class weight, no label smoothing (a vocab-parallel loss is a different op,
:func:`~autoparallel.runtime_kernels.cross_entropy.vocab_parallel_cross_entropy`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import op_args
from ..runtime_kernels.cross_entropy import cross_entropy_loss

aten = torch.ops.aten


def fuse_cross_entropy(graph: fx.Graph, traced: fx.Graph) -> int:
    """Point every ``aten.cross_entropy_loss`` of ``graph`` (a per-device graph whose nodes
    name their traced node in ``meta["source"]``) that has 2-D logits, int64 targets, no weight
    and no label smoothing at the one-pass kernel (module docstring); ``traced`` is the
    captured graph, whose values give the ranks and dtypes. Returns how many; the caller
    recompiles."""
    traced_nodes = {n.name: n for n in traced.nodes}
    count = 0
    for node in graph.nodes:
        source = traced_nodes.get(node.meta.get("source"))
        if node.op != "call_function" or node.target is not aten.cross_entropy_loss.default or source is None:
            continue
        a, captured = op_args(node), op_args(source)
        x, t = captured["self"].meta.get("val"), captured["target"].meta.get("val")
        if (a["weight"] is None and a["label_smoothing"] == 0.0 and isinstance(x, torch.Tensor) and x.dim() == 2
                and isinstance(t, torch.Tensor) and t.dim() == 1 and t.dtype == torch.int64):
            node.target = cross_entropy_loss
            node.args, node.kwargs = (a["self"], a["target"], a["reduction"], a["ignore_index"]), {}
            count += 1
    return count
