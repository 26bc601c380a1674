"""The parts of a fused projection that a device computes from one whole weight, rejoined."""

from __future__ import annotations

import operator
from collections import defaultdict

import torch
import torch.fx as fx

from ..graph import op_args
from ..tracer.fused import SLICED_OPERANDS
from .base import Rewrite, Size

aten = torch.ops.aten


class FusedProjectionParts(Rewrite):
    """One product and a ``split_with_sizes`` for the parts of a fused projection, where a device
    computes them all from one whole weight.

    Matches: products (``addmm``, ``mm``, ``bmm``, ``linear``, ``matmul``) that run the same op on
    the same operands except for slices ``[s, e)`` of the same weight (and bias) along their
    out-features dim, where the local slices are the captured ones and tile that dim of the local
    tensor. Capture splits a fused projection (GPT-2's ``c_attn``, a ``qkv_proj``, a
    ``gate_up_proj``) into one product per part on a slice of the weight
    (:mod:`autoparallel.tracer.fused`), so that the planner can split each part by heads. Where
    the plan does not (data parallel, FSDP, a 1-device mesh), the per-device graph would still
    run one product per part: on GPT-2 per layer two more GEMMs in the forward, and in the
    backward four more GEMMs and, per slice, a zero-filled buffer of the whole weight's size
    that autograd then adds (``slice_backward``). A heads-split plan reads each slice through
    its own redistribution and is left alone.

    Exact: ``addmm(b[s:e], x, W[:, s:e]) == addmm(b, x, W)[..., s:e]`` column for column (each
    output element is the same dot product; the GEMM may block it in another order, as the
    fused op the user wrote did). The parts become ``getitem``s of one ``split_with_sizes`` of
    the fused product's last dim: the graph eager PyTorch runs for the model, whose backward
    concatenates the parts' gradients once. Everything the plan decided (placements,
    collectives, their order) stays as it was; the rewrite only sees local ops.

    Memory: none the model counts. The rejoined product keeps the same input and the weight
    (whose slices are views of it) for its backward; the ``slice_backward`` buffers it removes
    are backward temporaries the model does not count.
    """

    name = "fused_parts"

    def applies(self, node: fx.Node) -> bool:
        """``node`` is a product on a slice of a weight along its out-features dim (a part)."""
        return node.target in SLICED_OPERANDS and any(
            isinstance(w := op_args(node).get(name), fx.Node) and w.target is aten.slice.Tensor
            for name, _ in SLICED_OPERANDS[node.target])

    def saved_size(self, saver: fx.Node, operand: fx.Node | None, shape: tuple[int, ...], size: Size) -> Size:
        """Unchanged (class docstring)."""
        return size

    def apply(self, graph: fx.Graph, source_graph: fx.Graph, plan) -> int:
        traced_nodes = {n.name: n for n in source_graph.nodes}
        groups: dict[tuple, list[tuple[int, int, fx.Node]]] = defaultdict(list)
        for node in graph.nodes:
            if node.op == "call_function" and node.target in SLICED_OPERANDS:
                part = _as_part(node, traced_nodes)
                if part is not None:
                    key, start, end = part
                    groups[key].append((start, end, node))
        order = {n: i for i, n in enumerate(graph.nodes)}
        rejoined = 0
        for key, parts in groups.items():
            parts.sort(key=lambda p: p[0])
            if len(parts) > 1 and _tiles(parts, key[-1]):
                _rejoin(graph, key, parts, min((p[2] for p in parts), key=order.__getitem__))
                rejoined += 1
        return rejoined


def _as_part(node: fx.Node, traced_nodes: dict[str, fx.Node]):
    """``(key, start, end)`` when ``node``'s out-features operands are slices ``[start, end)``
    (the same bounds for each) of whole local tensors along their out-features dim; the key
    holds the op, its arguments with each slice replaced by what it slices, and the dim's size.
    ``None`` otherwise."""
    positional = [a.name for a in node.target._schema.arguments if not a.kwarg_only]
    args, kwargs = list(node.args), dict(node.kwargs)
    bounds, size = set(), set()
    for name, dim in SLICED_OPERANDS[node.target]:
        if name in kwargs:
            where, i = kwargs, name
        elif positional.index(name) < len(args):
            where, i = args, positional.index(name)
        else:
            continue
        sliced = _slice_of(where[i], dim, traced_nodes)
        if sliced is None:
            continue  # a bias that broadcasts along the dim, or no tensor: the same in every part
        where[i], start, end, n = sliced
        bounds.add((start, end))
        size.add(n)
    if len(bounds) != 1 or len(size) != 1:
        return None
    (start, end), = bounds
    key = (node.target, tuple(args), tuple(sorted(kwargs.items())), size.pop())
    try:
        hash(key)
    except TypeError:  # an argument that is a list: not a part this pass knows
        return None
    return key, start, end


def _slice_of(value, dim: int | None, traced_nodes: dict[str, fx.Node]):
    """``(base, start, end, size)`` when ``value`` is ``aten.slice(base, dim, start, end)``
    (step 1, static bounds; ``dim`` ``None``: the last) and its traced node is the same slice
    of a dim of that size; else ``None``."""
    if not (isinstance(value, fx.Node) and value.op == "call_function" and value.target is aten.slice.Tensor):
        return None
    traced = traced_nodes.get(value.meta.get("source"))
    if traced is None or traced.target is not aten.slice.Tensor or tuple(traced.args[1:]) != tuple(value.args[1:]):
        return None  # the local slice is not the captured one (its bounds were rewritten for a shard)
    base_val = traced.args[0].meta["val"]
    _, d, start, end, *step = value.args
    want = base_val.dim() - 1 if dim is None else dim
    if d % base_val.dim() != want or step not in ([], [1]) or not all(type(b) is int for b in (start, end)):
        return None
    n = base_val.shape[want]
    start, end, _ = slice(start, end).indices(n)
    return value.args[0], start, end, n


def _tiles(parts: list[tuple[int, int, fx.Node]], n: int) -> bool:
    """The parts' ``[start, end)``, sorted, cover ``[0, n)`` without gap or overlap."""
    ends = [0] + [e for _, e, _ in parts]
    return all(s == ends[i] and s < e for i, (s, e, _) in enumerate(parts)) and ends[-1] == n


def _rejoin(graph: fx.Graph, key: tuple, parts: list[tuple[int, int, fx.Node]], first: fx.Node) -> None:
    target, args, kwargs, _ = key
    slices = {a for _, _, p in parts for a in p.all_input_nodes if a.target is aten.slice.Tensor}
    with graph.inserting_before(first):
        fused = graph.call_function(target, args, dict(kwargs))
        split = graph.call_function(aten.split_with_sizes.default, (fused, [e - s for s, e, _ in parts], -1))
        for i, (_, _, part) in enumerate(parts):
            piece = graph.call_function(operator.getitem, (split, i))
            piece.meta = dict(part.meta)
            part.replace_all_uses_with(piece)
    fused.meta = split.meta = dict(first.meta)
    for _, _, part in parts:
        graph.erase_node(part)
    for s in slices:
        if not s.users:
            graph.erase_node(s)
