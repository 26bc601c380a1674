"""Grouped-query attention handed to SDPA as it is, instead of key and value copied per query head."""

from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import op_args
from .base import Rewrite, Size

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_RESHAPES = (aten.reshape.default, aten._unsafe_view.default, aten.view.default)


class GroupedQueryAttention(Rewrite):
    """SDPA on the unrepeated key and value with ``enable_gqa=True``.

    Matches: a ``scaled_dot_product_attention`` whose key and value are both repeated ``n`` times
    (the same ``n``) per query head. Models with fewer key/value heads than query heads (Llama's
    GQA: Ainslie et al., EMNLP 2023) repeat each key/value head for its group of query heads
    before attention; Hugging Face's ``repeat_kv`` does it as ``unsqueeze(x, 2) → expand([B, KV,
    n, S, D]) → reshape([B, KV·n, S, D])``, a copy of the key and of the value in every layer's
    forward, and a sum over the copies in the backward. In eager PyTorch transformers skips it
    and calls SDPA with ``enable_gqa=True``; under ``torch.export`` it takes the copying path, so
    the captured graph has it.

    Exact: with ``enable_gqa``, SDPA gives query head ``j`` the key/value head ``j // n``
    (``repeat_interleave`` over the heads dim), which is the head the copy put at ``j``. It runs
    on local tensors only, after the plan's collectives are in place, so every placement the
    plan chose stays as it is; where the plan redistributes the unsqueezed key between the
    ``unsqueeze`` and the ``expand``, SDPA reads the redistributed tensor with its dim 2 (of
    size 1) squeezed.

    Memory: the SDPA keeps its key and value for the backward unrepeated, ``1/n`` of what the
    captured graph's SDPA keeps (the repeat's output).
    """

    name = "gqa"

    def applies(self, node: fx.Node) -> bool:
        """``node`` is an SDPA whose key and value are repeated per query head."""
        return bool(_repeated_kv(node))

    def saved_size(self, saver: fx.Node, operand: fx.Node | None, shape: tuple[int, ...], size: Size) -> Size:
        """A repeated key or value ``saver`` keeps: ``1/n`` of it."""
        n = _repeated_kv(saver).get(operand, 1)
        return size if n == 1 else lambda s: size(s) // n

    def apply(self, graph: fx.Graph, source_graph: fx.Graph, plan) -> int:
        traced_nodes = {n.name: n for n in source_graph.nodes}
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


def _repeated_kv(sdpa: fx.Node) -> dict[fx.Node, int]:
    """On the captured graph: ``{key: n, value: n}`` when SDPA node ``sdpa`` reads its key and
    value repeated ``n`` times per query head; else empty."""
    if sdpa.target is not _SDPA or len(sdpa.args) < 3:
        return {}
    kv = sdpa.args[1:3]
    if any(_repeated_kv_source(x) is None for x in kv):
        return {}
    n = {x.args[0].args[1][2] for x in kv}
    return dict.fromkeys(kv, n.pop()) if len(n) == 1 else {}


def _repeated_kv_source(node) -> fx.Node | None:
    """On the captured graph: the ``[B, KV, S, D]`` node that key or value ``node`` repeats per
    query head (``reshape(expand(unsqueeze(x, 2), [B, KV, n, S, D]), [B, KV·n, S, D])``); else
    ``None``."""
    chain = _repeat_chain(node)
    if chain is None:
        return None
    unsqueeze = chain[1].args[0]
    if not (isinstance(unsqueeze, fx.Node) and unsqueeze.target is aten.unsqueeze.default and unsqueeze.args[1] == 2):
        return None
    return unsqueeze.args[0]


def _repeat_chain(node):
    """``(reshape, expand)`` when ``node`` is ``reshape(expand(·, [B, KV, n, S, D]), [B, KV·n, S, D])``
    with static sizes, each read only by the next; else ``None``."""
    reshape = node
    if not (isinstance(reshape, fx.Node) and reshape.op == "call_function" and reshape.target in _RESHAPES
            and len(reshape.users) == 1):
        return None
    expand = reshape.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_function" and expand.target is aten.expand.default
            and len(expand.users) == 1):
        return None
    sizes, shape = list(expand.args[1]), list(reshape.args[1])
    if len(sizes) != 5 or len(shape) != 4 or not all(type(s) is int and s > 0 for s in sizes + shape):
        return None
    b, kv, n, s, d = sizes
    return (reshape, expand) if shape == [b, kv * n, s, d] else None


def _repeated(node, traced_nodes: dict[str, fx.Node]):
    """``(x, n, expand, reshape)`` when per-device ``node`` is such a repeat of ``x`` (:func:`_repeat_chain`)
    and the captured expand reads an ``unsqueeze(·, 2)`` (so ``x`` is it, or it redistributed: its
    dim 2 has size 1); else ``None``."""
    chain = _repeat_chain(node)
    if chain is None:
        return None
    reshape, expand = chain
    captured = traced_nodes.get(expand.meta.get("source"))
    if captured is None or captured.target is not aten.expand.default or \
            _repeated_kv_source(next(iter(captured.users))) is None:
        return None
    return expand.args[0], expand.args[1][2], expand, reshape


def _unrepeated(graph: fx.Graph, expand: fx.Node) -> fx.Node:
    """The ``[B, KV, S, D]`` tensor ``expand`` repeats: the input of the ``unsqueeze`` it reads
    when it reads one directly, else its input with dim 2 squeezed."""
    x = expand.args[0]
    if x.op == "call_function" and x.target is aten.unsqueeze.default and x.args[1] == 2:
        return x.args[0]
    return graph.call_function(aten.squeeze.dim, (x, 2))
