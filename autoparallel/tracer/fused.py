"""Fused projections split into one projection per part, so that each can be split by heads.

GPT-2 computes q, k and v with one ``Conv1D`` (``c_attn``, weight ``[H, 3H]``) and splits
its output: ``view → addmm → view → split(H, dim=2)``; Phi-3 and other GQA models slice a
fused ``qkv_proj`` output into unequal parts (``[..., :q]``, ``[..., q:q+kv]``, ...), and
gated MLPs chunk a fused ``gate_up_proj`` output in two. The out-features dim of such a
projection is ``parts × heads × head_dim``: an even split of it over a mesh axis gives a
device a contiguous block that mixes the parts (the first device of two gets all of q and
half of k), so the planner could not split the attention by heads as Megatron-LM does
(Shoeybi et al. 2019, §3: q, k, v split column-wise by heads, the output projection
row-wise).

:func:`split_fused_projections` rewrites, on the captured graph, every matmul-like node
(``addmm``, ``mm``, ``linear``, ``matmul``, ``bmm``) whose output (possibly through views
that keep its last dim, the out-features dim) is used only by a split of that dim into
parts (``split``, ``split_with_sizes``, ``chunk``, or ``slice`` nodes that tile it) into one
node per used part on a slice of the weight (and of the bias):

    y = addmm(b, x, W); q, k, v = split(view(y, [B, S, 3H]), H, 2)
    →  q = view(addmm(b[0:H], x, W[:, 0:H]), [B, S, H]), k = ..., v = ...

Each part is then an ordinary projection whose out-features dim the planner splits with a
plain ``Shard`` placement, head-aligned when the mesh axis divides its heads. The fused
parameter keeps its name and shape; it is stored replicated or split on a dim the slices
keep (FSDP-style), and sliced locally (a slice of a replicated tensor costs nothing). Its
gradient is the sum autograd accumulates through the slices, which fills each part's
block. Values equal the fused op's up to the summation order of the GEMM (each output
element is the same dot product; the kernel may block it differently).

The rewrite fires only where it is exact: the matmul's output and every view between it
and the split have that one user, all shapes are static, the views keep the last dim
(a row-major view whose last dim has the same size before and after keeps every element's
index in it), and the split covers the dim exactly (slices: disjoint, step 1, together
``[0, n)``). A split piece nobody reads gets no projection.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import op_args
from .mutations import call_like

aten = torch.ops.aten
_MATMULS = {aten.addmm.default, aten.mm.default, aten.linear.default, aten.matmul.default, aten.bmm.default}
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_SPLITS = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}


def split_fused_projections(graph: fx.Graph) -> int:
    """Rewrite every fused projection of ``graph`` into one projection per part, in place
    (module docstring). Returns how many fused projections were rewritten."""
    count = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _MATMULS:
            count += _rewrite(graph, node)
    return count


def _static_shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
        return None
    return tuple(val.shape)


def _view_chain(mm: fx.Node, n: int) -> list[fx.Node] | None:
    """The views from ``mm`` to the node the split reads, each the only user of the one
    before, with a static output and size argument (plain ints, positional) and a last dim of
    size ``n``; ``None`` when a view in the chain has another last dim or a dynamic size."""
    chain, cur = [], mm
    while len(cur.users) == 1:
        user = next(iter(cur.users))
        if user.op != "call_function" or user.target not in _VIEWS:
            break
        shape = _static_shape(user)
        size = user.args[1] if len(user.args) == 2 else None
        if shape is None or not shape or shape[-1] != n or not all(type(s) is int for s in size or [None]):
            return None
        chain.append(user)
        cur = user
    return chain


def _parts(src: fx.Node, n: int) -> list[tuple[fx.Node, int, int]] | None:
    """``(node reading the part, start, end)`` for each used part of ``src``'s last dim (size
    ``n``) when ``src``'s users split that dim exactly, else ``None``."""
    users = list(src.users)
    ndim = len(_static_shape(src))
    last = ndim - 1
    if len(users) == 1 and users[0].op == "call_function" and users[0].target in _SPLITS:
        split = users[0]
        if op_args(split)["dim"] % ndim != last:
            return None
        sizes = [t.shape[last] for t in split.meta["val"]]
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        getitems = list(split.users)
        if not all(g.op == "call_function" and g.target is operator.getitem for g in getitems):
            return None  # the list of pieces itself is used
        return [(g, starts[g.args[1]], starts[g.args[1]] + sizes[g.args[1]]) for g in getitems]
    if len(users) < 2 or not all(u.op == "call_function" and u.target is aten.slice.Tensor for u in users):
        return None
    parts = []
    for u in users:
        a = op_args(u)
        if a["dim"] % ndim != last or a.get("step", 1) != 1:
            return None
        start, end, _ = slice(a.get("start"), a.get("end")).indices(n)
        parts.append((u, start, end))
    bounds = sorted((start, end) for _, start, end in parts)
    if any(s >= e for s, e in bounds) or bounds[0][0] != 0 or bounds[-1][1] != n \
            or any(bounds[i][1] != bounds[i + 1][0] for i in range(len(bounds) - 1)):
        return None  # the slices do not tile the dim
    return parts


def _rewrite(graph: fx.Graph, mm: fx.Node) -> bool:
    shape = _static_shape(mm)
    if shape is None or not shape:
        return False
    n = shape[-1]
    chain = _view_chain(mm, n)
    if chain is None:
        return False
    src = chain[-1] if chain else mm
    parts = _parts(src, n)
    if parts is None or not _weight_sliceable(mm):
        return False
    with graph.inserting_before(mm):
        outs = [_part(graph, mm, chain, start, end) for _, start, end in parts]
    for (reader, _, _), out in zip(parts, outs):
        reader.replace_all_uses_with(out)
        graph.erase_node(reader)
    for node in reversed([mm, *chain, *src.users]):
        if not node.users:
            graph.erase_node(node)
    return True


# per op: (argument, dim of the out-features, or None for the last) of each operand that carries them
SLICED_OPERANDS = {aten.linear.default: (("weight", 0), ("bias", None)),
           aten.addmm.default: (("self", None), ("mat2", None)),
           aten.mm.default: (("mat2", None),), aten.bmm.default: (("mat2", None),),
           aten.matmul.default: (("other", None),)}


def _weight_sliceable(mm: fx.Node) -> bool:
    """The weight operand has the out-features dim (``linear``: its first dim of two; the
    others: the last of two or more)."""
    name, dim = SLICED_OPERANDS[mm.target][0 if mm.target is aten.linear.default else -1]
    w = op_args(mm)[name]
    if not isinstance(w, fx.Node):
        return False
    return w.meta["val"].dim() == 2 if dim == 0 else w.meta["val"].dim() >= 2


def _slice(graph: fx.Graph, like: fx.Node, t, dim: int | None, start: int, end: int, n: int):
    """``t`` narrowed to ``[start, end)`` along ``dim`` (``None``: the last), or ``t`` itself when
    it broadcasts along it (a bias of size 1 there, or not a tensor)."""
    if not isinstance(t, fx.Node):
        return t
    val = t.meta["val"]
    dim = val.dim() - 1 if dim is None else dim
    if val.dim() == 0 or val.shape[dim] != n:
        return t
    return call_like(graph, like, aten.slice.Tensor, t, dim, start, end)


def _part(graph: fx.Graph, mm: fx.Node, chain: list[fx.Node], start: int, end: int) -> fx.Node:
    """The projection onto columns ``[start, end)`` of ``mm``'s output, through copies of
    the views in ``chain`` with the last dim resized."""
    n = _static_shape(mm)[-1]
    args, kwargs = list(mm.args), dict(mm.kwargs)
    positional = [a.name for a in mm.target._schema.arguments if not a.kwarg_only]
    for name, dim in SLICED_OPERANDS[mm.target]:
        if name in kwargs:
            kwargs[name] = _slice(graph, mm, kwargs[name], dim, start, end, n)
        elif positional.index(name) < len(args):
            i = positional.index(name)
            args[i] = _slice(graph, mm, args[i], dim, start, end, n)
    out = call_like(graph, mm, mm.target, *args, **kwargs)
    for view in chain:
        size = list(view.args[1])  # view(self, size), reshape(self, shape), _unsafe_view(self, size)
        if size[-1] != -1:
            size[-1] = end - start
        out = call_like(graph, view, view.target, out, size)
    return out
