"""Grouped-query attention handed to SDPA as it is, instead of key and value copied per query head.

Models with fewer key/value heads than query heads (Llama's GQA: Ainslie et al., EMNLP 2023)
repeat each key/value head for its group of query heads before attention. Hugging Face's
``repeat_kv`` does it as ``unsqueeze(x, 2) → expand([B, KV, n, S, D]) → reshape([B, KV·n, S, D])``,
a copy of the key and of the value in every layer's forward, and a sum over the copies in the
backward. In eager PyTorch transformers skips it and calls SDPA with ``enable_gqa=True``; under
``torch.export`` it takes the copying path, so the captured graph has it.

:func:`fold_repeated_kv` rewrites, on the per-device graph, every
``scaled_dot_product_attention`` whose key and value are both such repeats (``n`` the same) into
one on the unrepeated key and value with ``enable_gqa=True``. It is exact: with ``enable_gqa``,
SDPA gives query head ``j`` the key/value head ``j // n`` (``repeat_interleave`` over the heads
dim), which is the head the copy put at ``j``. It runs on local tensors only, after the plan's
collectives are in place, so every placement the plan chose stays as it is; where the plan
redistributes the unsqueezed key between the ``unsqueeze`` and the ``expand``, SDPA reads the
redistributed tensor with its dim 2 (of size 1) squeezed.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..attention import SDPA as _SDPA
from ..attention import repeated_kv_source, repeat_chain
from ..graph import op_args

aten = torch.ops.aten


def fold_repeated_kv(graph: fx.Graph, traced: fx.Graph) -> int:
    """Rewrite, in place, every SDPA of ``graph`` (a per-device graph whose nodes name their
    traced node in ``meta["source"]``) whose key and value are repeated per query head (module
    docstring); ``traced`` is the captured graph. Returns how many were rewritten; the caller
    recompiles."""
    traced_nodes = {n.name: n for n in traced.nodes}
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not _SDPA or op_args(node).get("enable_gqa"):
            continue
        repeats = [_repeated(node.args[i], traced_nodes) for i in (1, 2)]
        if None in repeats or repeats[0][1] != repeats[1][1]:
            continue
        args = list(node.args)
        with graph.inserting_before(node):
            args[1], args[2] = (_unrepeated(graph, r[2]) for r in repeats)
        node.args = tuple(args)
        node.kwargs = {**node.kwargs, "enable_gqa": True}
        for x, _, expand, reshape in repeats:
            graph.erase_node(reshape)
            graph.erase_node(expand)
            if not x.users and x.target is aten.unsqueeze.default:
                graph.erase_node(x)
        count += 1
    return count


def _repeated(node, traced_nodes: dict[str, fx.Node]):
    """``(x, n, expand, reshape)`` when per-device ``node`` is such a repeat of ``x`` (``attention.repeat_chain``)
    and the captured expand reads an ``unsqueeze(·, 2)`` (so ``x`` is it, or it redistributed: its
    dim 2 has size 1); else ``None``."""
    chain = repeat_chain(node)
    if chain is None:
        return None
    reshape, expand = chain
    captured = traced_nodes.get(expand.meta.get("source"))
    if captured is None or captured.target is not aten.expand.default or \
            repeated_kv_source(next(iter(captured.users))) is None:
        return None
    return expand.args[0], expand.args[1][2], expand, reshape


def _unrepeated(graph: fx.Graph, expand: fx.Node) -> fx.Node:
    """The ``[B, KV, S, D]`` tensor ``expand`` repeats: the input of the ``unsqueeze`` it reads
    when it reads one directly, else its input with dim 2 squeezed."""
    x = expand.args[0]
    if x.op == "call_function" and x.target is aten.unsqueeze.default and x.args[1] == 2:
        return x.args[0]
    return graph.call_function(aten.squeeze.dim, (x, 2))
