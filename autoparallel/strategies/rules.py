"""Sharding rules and per-device rewrites of pointwise, shape, reduction, matmul and NN ops,
registered as op records (:mod:`~autoparallel.strategies.records`).

A rule is called as ``rule(node, in_shapes, out_shapes)`` where the shapes are those of
the node's data tensor inputs (:func:`~autoparallel.graph.tensor_inputs`) and tensor
outputs, and returns a :class:`~autoparallel.strategies.engine.DimMap` (enumerated by the
engine) or a list of :class:`~autoparallel.strategies.engine.Strategy` for the few ops the
engine cannot describe, or ``None`` when it does not cover the node (the node then goes to
DTensor's registry and else runs replicated, reported as a fallback: see
:mod:`~autoparallel.strategies.generator`). Rules read the op's other arguments by name
(:func:`~autoparallel.graph.op_args`). Ops in :data:`autoparallel.graph.NO_DATA_INPUT` read
only dtype/device from their tensor argument.
"""

from __future__ import annotations

import math

import torch

from ..graph import op_args
from ..placement import uneven_dims
from .engine import DimMap
from .records import RECORDS, LocalCall, OpRecord, record

aten = torch.ops.aten


def _norm(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _labels(ndim: int, prefix: str = "d") -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(ndim))


# ---------------------------------------------------------------- pointwise
LINEAR_ALL = "all"  # linear jointly in all tensor inputs (add, sub)
LINEAR_EACH = "each"  # linear in each tensor input separately (mul)
LINEAR_FIRST = "first"  # linear in the first input only (div by a tensor)

POINTWISE: dict[object, str | None] = {}
for _op, _lin in [
    (aten.add.Tensor, LINEAR_ALL), (aten.sub.Tensor, LINEAR_ALL), (aten.mul.Tensor, LINEAR_EACH),
    (aten.div.Tensor, LINEAR_FIRST), (aten.neg.default, LINEAR_FIRST),
    (aten.to.dtype, LINEAR_FIRST), (aten.to.dtype_layout, LINEAR_FIRST), (aten.to.device, LINEAR_FIRST),
    (aten._to_copy.default, LINEAR_FIRST), (aten.clone.default, LINEAR_FIRST),
    (aten.contiguous.default, LINEAR_FIRST), (aten.alias.default, LINEAR_FIRST),
    (aten.detach.default, LINEAR_FIRST), (aten.detach_.default, LINEAR_FIRST),
    (aten.lift_fresh_copy.default, LINEAR_FIRST),
]:
    POINTWISE[_op] = _lin
for _op in [
    aten.add.Scalar, aten.sub.Scalar, aten.mul.Scalar, aten.div.Scalar, aten.rsub.Scalar, aten.rsub.Tensor,
    aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor, aten.pow.Scalar, aten.rsqrt.default, aten.sqrt.default,
    aten.exp.default, aten.log.default, aten.tanh.default, aten.sigmoid.default, aten.silu.default,
    aten.gelu.default, aten.relu.default, aten.erf.default, aten.cos.default, aten.sin.default,
    aten.abs.default, aten.reciprocal.default, aten.sign.default, aten.floor.default, aten.ceil.default,
    aten.round.default, aten.log1p.default, aten.expm1.default, aten.softplus.default,
    aten.leaky_relu.default, aten.hardtanh.default, aten.elu.default, aten.mish.default,
    aten.hardswish.default, aten.hardswish_.default, aten.hardsigmoid.default, aten.relu6.default,
    aten.dropout.default, aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar,
    aten.lt.Tensor, aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar,
    aten.ge.Tensor, aten.ge.Scalar, aten.__and__.Tensor, aten.__or__.Tensor, aten.bitwise_and.Tensor,
    aten.bitwise_or.Tensor, aten.bitwise_not.default, aten.logical_and.default, aten.logical_or.default,
    aten.logical_not.default, aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.clamp.default, aten.clamp.Tensor,
    aten.clamp_min.default, aten.clamp_max.default, aten.minimum.default, aten.maximum.default,
    aten.floor_divide.default, aten.remainder.Scalar, aten.remainder.Tensor, aten.zeros_like.default,
    aten.ones_like.default, aten.full_like.default, aten.empty_like.default, aten.fill.Scalar,
    aten.isnan.default, aten.isinf.default, aten.nan_to_num.default, aten.square.default,
    aten.bitwise_xor.Tensor, aten.lerp.Scalar, aten.addcmul.default, aten.addcdiv.default,
]:
    POINTWISE[_op] = None


def pointwise_dimmap(node, in_shapes, out_shapes, linear=None) -> DimMap | None:
    """Elementwise op whose tensor inputs broadcast into its output: every output dim is a
    parallel dim, shared by the inputs that have it at full size (a broadcast size-1 dim is
    not split). ``None`` when an input does not broadcast into the output (more dims, or a
    dim that is neither 1 nor the output's): such an op is not elementwise on these shapes."""
    out = out_shapes[0]
    labs = _labels(len(out))
    ins = []
    for s in in_shapes:
        off = len(out) - len(s)
        if off < 0 or any(s[j] not in (1, out[off + j]) for j in range(len(s))):
            return None
        ins.append(tuple(labs[off + j] if s[j] == out[off + j] else None for j in range(len(s))))
    n = len(in_shapes)
    partial = []
    if linear == LINEAR_ALL and n == 2:
        partial = [frozenset(range(n))]  # x + y; not x + c, which would add c once per device
    elif linear == LINEAR_EACH:
        partial = [frozenset([i]) for i in range(n)]
    elif linear == LINEAR_FIRST and n >= 1:
        partial = [frozenset([0])]
    # uneven splits: elementwise on any pieces, but random ops draw per shard of equal size
    random = torch.Tag.nondeterministic_seeded in getattr(getattr(node, "target", None), "tags", ())
    return DimMap(ins, [labs] * len(out_shapes), list(in_shapes), list(out_shapes), partial=partial,
                  uneven=0 if random else len(out))


def local_contiguous(call: LocalCall):
    """``contiguous`` on a piece with a dim split unevenly: a contiguous ``clone`` (under
    ``LocalTensorMode``, ``contiguous()`` left the shorter ranks' pieces strided, and the
    ``view`` after it, HF's shifted labels flattened, failed)."""
    if not uneven_dims(call.out_shapes[0], call.output_specs[0], call.mesh_shape):
        return call.emit()
    layout = call.bound().get("memory_format") or torch.contiguous_format
    return call.emit(aten.clone.default, (call.args[0],), {"memory_format": layout})


for _op, _lin in POINTWISE.items():
    RECORDS[_op] = OpRecord((lambda lin: lambda node, i, o: pointwise_dimmap(node, i, o, lin))(_lin),
                            local_contiguous if _op == aten.contiguous.default else None)

POINTWISE_RECORD = OpRecord(pointwise_dimmap)
"""The record of an op torch tags pointwise that has none of its own (no Partial: its
linearity is not known)."""


# ---------------------------------------------------------------- shape ops
def view_dims(in_shape, out_shape) -> tuple[tuple, tuple, dict]:
    """Labels for a view from ``in_shape`` to ``out_shape``: each group of dims whose
    products match shares one label on its first non-unit dim on both sides; and the
    ``DimMap.units`` of the groups whose first dims differ in size: a block of ``L``
    elements, ``L`` the least common multiple of the rows of the two first dims (the product
    of the group's later dims on each side), is ``L / rows`` rows of each (``[200] → [25,
    8]``: 8 and 1, the label counting heads on both sides; ``[B, S] → [B·S]``: 1 and ``S``)."""
    lin = [None] * len(in_shape)
    lout = [None] * len(out_shape)
    units = {}
    ii = [d for d, s in enumerate(in_shape) if s != 1]
    oo = [d for d, s in enumerate(out_shape) if s != 1]
    i = j = 0
    g = 0
    while i < len(ii) and j < len(oo):
        gi, gj = [ii[i]], [oo[j]]
        pi, pj = in_shape[ii[i]], out_shape[oo[j]]
        while pi != pj:
            if pi < pj:
                i += 1
                gi.append(ii[i])
                pi *= in_shape[ii[i]]
            else:
                j += 1
                gj.append(oo[j])
                pj *= out_shape[oo[j]]
        lin[gi[0]] = lout[gj[0]] = f"g{g}"
        row_in = math.prod(in_shape[d] for d in gi[1:])
        row_out = math.prod(out_shape[d] for d in gj[1:])
        if row_in != row_out:
            block = math.lcm(row_in, row_out)
            units[f"g{g}"] = {in_shape[gi[0]]: block // row_in, out_shape[gj[0]]: block // row_out}
        g += 1
        i += 1
        j += 1
    return tuple(lin), tuple(lout), units


def unit_candidates(gm) -> dict[int, tuple[int, ...]]:
    """Size → the rows per unit that the graph's views cut dims of that size in (from each
    view's :func:`view_dims` units > 1): what a label of that size may also be cut in
    (``enumerate_strategies``' ``unit_candidates``), so that a projection's 200 output
    columns are cut in the heads of 8 that the ``view`` to ``[..., 25, 8]`` after it needs."""
    found: dict[int, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _VIEW_OPS and isinstance(node.args[0], torch.fx.Node):
            _, _, units = view_dims(tuple(node.args[0].meta["val"].shape), tuple(node.meta["val"].shape))
            for by_size in units.values():
                for size, unit in by_size.items():
                    if unit > 1:
                        found.setdefault(size, set()).add(unit)
    return {size: tuple(sorted(u)) for size, u in sorted(found.items())}


def local_size(call: LocalCall):
    """``view``/``reshape``/``expand`` on one device: the size argument holds local sizes
    (``expand``'s ``-1``, "keep this dim", stays); the one dim split unevenly, whose size
    differs between devices, is ``-1`` (inferred by ``view``, kept by ``expand``). A
    ``reshape`` with such a dim is a contiguous copy and a ``view``: the copy a reshape of
    a transposed input makes anyway, explicit (the captured strides do not tell: SDPA's
    output is laid out so that its transpose is contiguous on one device, not on pieces)."""
    name = "shape" if call.node.target == aten.reshape.default else "size"
    keep = call.node.target == aten.expand.default
    size = [-1 if keep and s == -1 else n for s, n in zip(call.bound()[name], _local_sizes(call))]
    if call.node.target == aten.reshape.default and -1 in size:
        # the copy a reshape of a transposed input makes (attention's heads merged back),
        # explicit: LocalTensorMode does not implement that reshape on per-rank sizes ("NYI")
        copy = call.call(aten.clone.default, (call.args[0],), {"memory_format": torch.contiguous_format})
        return call.emit(aten.view.default, (copy, size), {})
    return call.emit(None, *call.with_arg(name, size))


def local_squeeze(call: LocalCall):
    """A squeeze on one device is a reshape to the local shape: a split dim may be 1 locally
    without being squeezable."""
    return call.emit(aten.reshape.default, (call.args[0], _local_sizes(call)), {})


def _local_sizes(call: LocalCall) -> list[int]:
    """The local output shape, with ``-1`` for a dim split unevenly (one at most: the rule's
    ``DimMap.uneven``)."""
    uneven = uneven_dims(call.out_shapes[0], call.output_specs[0], call.mesh_shape)
    return [-1 if d in uneven else n for d, n in enumerate(call.local_out_shape())]


@record(aten.unsqueeze.default, aten.flatten.using_ints)
@record(aten.view.default, aten.reshape.default, aten._unsafe_view.default, local=local_size)
@record(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, local=local_squeeze)
def view_rule(node, in_shapes, out_shapes):
    """Views and reshapes (capture rewrites ``view_as``, ``reshape_as`` and ``unflatten``
    into ``view``/``reshape`` to the output's shape: :mod:`autoparallel.tracer.decompose`)."""
    lin, lout, units = view_dims(in_shapes[0], out_shapes[0])
    return DimMap([lin], [lout], list(in_shapes), list(out_shapes), partial=[frozenset([0])], uneven=1,
                  units=units)


_VIEW_OPS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints)


@record(aten.expand.default, local=local_size)
def expand_rule(node, in_shapes, out_shapes):
    """``expand`` (capture rewrites ``expand_as`` into it): broadcast dims stay whole on the input side."""
    out = out_shapes[0]
    labs = _labels(len(out))
    s = in_shapes[0]
    off = len(out) - len(s)
    lin = tuple(labs[off + j] if s[j] == out[off + j] else None for j in range(len(s)))
    return DimMap([lin], [labs], list(in_shapes), list(out_shapes), partial=[frozenset([0])], uneven=1)


@record(aten.transpose.int, aten.t.default, aten.permute.default, aten.movedim.int, aten.numpy_T.default)
def permute_rule(node, in_shapes, out_shapes):
    """Dim permutations; ``numpy_T`` (``x.T``) reverses the dims."""
    nd = len(in_shapes[0])
    labs = _labels(nd)
    a = op_args(node)
    if node.target == aten.numpy_T.default:
        perm = list(reversed(range(nd)))
    elif node.target == aten.permute.default:
        perm = [_norm(d, nd) for d in a["dims"]]
    elif node.target == aten.movedim.int:
        src, dst = _norm(a["source"], nd), _norm(a["destination"], nd)
        perm = [d for d in range(nd) if d != src]
        perm.insert(dst, src)
    else:
        d0, d1 = (0, 1) if node.target == aten.t.default else (_norm(a["dim0"], nd), _norm(a["dim1"], nd))
        perm = list(range(nd))
        if nd > 1:
            perm[d0], perm[d1] = perm[d1], perm[d0]
    return DimMap([labs], [tuple(labs[p] for p in perm)], list(in_shapes), list(out_shapes),
                  partial=[frozenset([0])], uneven=nd)


def _forbid(labs, dims):
    return tuple(None if d in dims else lab for d, lab in enumerate(labs))


@record(aten.slice.Tensor)
def slice_rule(node, in_shapes, out_shapes):
    nd = len(in_shapes[0])
    dim = _norm(op_args(node)["dim"], nd)
    labs = _labels(nd)
    if in_shapes[0][dim] != out_shapes[0][dim]:
        labs = _forbid(labs, {dim})
    return DimMap([labs], [labs], list(in_shapes), list(out_shapes), partial=[frozenset([0])], uneven=nd)


@record(aten.select.int)
def select_rule(node, in_shapes, out_shapes):
    nd = len(in_shapes[0])
    dim = _norm(op_args(node)["dim"], nd)
    labs = _labels(nd)
    return DimMap([_forbid(labs, {dim})], [labs[:dim] + labs[dim + 1:]], list(in_shapes), list(out_shapes),
                  partial=[frozenset([0])], uneven=nd)


@record(aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default, aten.unbind.int)
def split_rule(node, in_shapes, out_shapes):
    nd = len(in_shapes[0])
    dim = _norm(op_args(node)["dim"], nd)
    labs = _forbid(_labels(nd), {dim})
    outs = [labs if len(s) == nd else labs[:dim] + labs[dim + 1:] for s in out_shapes]
    return DimMap([labs], outs, list(in_shapes), list(out_shapes), partial=[frozenset([0])], uneven=nd)


@record(aten.cat.default, aten.stack.default)
def cat_rule(node, in_shapes, out_shapes):
    out = out_shapes[0]
    dim = _norm(op_args(node)["dim"], len(out))
    labs = _forbid(_labels(len(out)), {dim})
    if node.target == aten.stack.default:
        ins = [labs[:dim] + labs[dim + 1:] for _ in in_shapes]
    else:
        ins = [labs if len(s) == len(out) else (None,) * len(s) for s in in_shapes]
    return DimMap(ins, [labs], list(in_shapes), list(out_shapes), partial=[frozenset(range(len(in_shapes)))],
                  uneven=len(out))


@record(aten.repeat_interleave.self_int)
def repeat_interleave_rule(node, in_shapes, out_shapes):
    """``x.repeat_interleave(r, dim)`` (GPT-J's rotary sin/cos): every dim keeps its split,
    the repeated one too (a contiguous block of ``n/k`` elements repeats into the matching
    block of ``n*r/k``), unless ``output_size`` gives the global length. Without ``dim`` the
    flattened input repeats: only its first dim of size > 1 may be split (its blocks are
    contiguous in the flattened order), into the 1-D output, unless ``output_size`` is given."""
    shape = in_shapes[0]
    nd = len(shape)
    a = op_args(node)
    dim = a["dim"]
    if dim is None:
        first = next((d for d, n in enumerate(shape) if n != 1), None)
        split = first is not None and a["output_size"] is None
        lin = tuple("g" if split and d == first else None for d in range(nd))
        return DimMap([lin], [("g" if split else None,)], list(in_shapes), list(out_shapes),
                      partial=[frozenset([0])])
    labs = _labels(nd)
    if a["output_size"] is not None:
        labs = _forbid(labs, {_norm(dim, nd)})
    return DimMap([labs], [labs], list(in_shapes), list(out_shapes), partial=[frozenset([0])])


@record(aten.pad.default, aten.constant_pad_nd.default)
def pad_rule(node, in_shapes, out_shapes):
    nd = len(in_shapes[0])
    npad = len(op_args(node)["pad"]) // 2
    labs = _forbid(_labels(nd), set(range(nd - npad, nd)))
    return DimMap([labs], [labs], list(in_shapes), list(out_shapes))


@record(aten.cumsum.default, aten.cumprod.default, aten.flip.default, aten.roll.default,
        aten.sort.default, aten.sort.stable, aten.argsort.default, aten.argsort.stable,
        aten.topk.default)  # softmax, log_softmax: losses.py (their dim may be split)
def along_dim_rule(node, in_shapes, out_shapes):
    """Ops that mix values along the dims named by their ``dim`` (or ``dims``) argument:
    those dims stay whole, every other dim may be split with every output. ``roll`` without
    ``dims`` rolls the flattened tensor: every dim stays whole. ``sort``, ``argsort`` and
    ``topk`` (a mixture-of-experts router's expert choice) order each slice along ``dim`` on
    its own, so a device holding whole slices finds the values and indices (positions
    within the slice) one device finds; a stable sort orders ties as one device does."""
    nd = len(in_shapes[0])
    a = op_args(node)
    dims = a["dims"] if "dims" in a else a["dim"]
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    if node.target == aten.roll.default and not dims:
        dims = list(range(nd))
    labs = _forbid(_labels(nd), {_norm(d, nd) for d in dims})
    return DimMap([labs], [labs] * len(out_shapes), list(in_shapes), list(out_shapes))


@record(aten.diff.default)
def diff_rule(node, in_shapes, out_shapes):
    nd = len(in_shapes[0])
    dim = _norm(op_args(node)["dim"], nd)
    labs = _forbid(_labels(nd), {dim})
    return DimMap([labs if len(s) == nd else (None,) * len(s) for s in in_shapes], [labs],
                  list(in_shapes), list(out_shapes))


# ---------------------------------------------------------------- reductions
def _reduce_dims(node, nd) -> set[int]:
    """The dims a reduction reduces: its ``dim`` argument; all dims when it has none, or
    it is ``None`` or empty (``sum(x, [])`` and ``amax(x, [])`` reduce everything)."""
    dims = op_args(node).get("dim")
    if dims is None or dims == []:
        return set(range(nd))
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return {_norm(d, nd) for d in dims}


def local_mean(call: LocalCall):
    """A mean over split dims on one device: the local mean divided by the number of
    pieces, so that the pending sum of the devices' results is the global mean."""
    pieces = math.prod(call.pieces(0, d) for d in _reduce_dims(call.node, len(call.in_shapes[0])))
    out = call.emit()
    return call.call(aten.div.Tensor, (out, pieces)) if pieces > 1 else out


@record(aten.sum.dim_IntList, aten.sum.default)
@record(aten.mean.dim, aten.mean.default, local=local_mean)
def sum_rule(node, in_shapes, out_shapes):
    """Sum or mean: a split reduced dim leaves partial results (:func:`local_mean`)."""
    nd = len(in_shapes[0])
    red = _reduce_dims(node, nd)
    labs = _labels(nd)
    keep = len(out_shapes[0]) == nd
    out = tuple(None if d in red else labs[d] for d in range(nd)) if keep else \
        tuple(labs[d] for d in range(nd) if d not in red)
    return DimMap([labs], [out], list(in_shapes), list(out_shapes),
                  reduce=frozenset(labs[d] for d in red), partial=[frozenset([0])])


@record(aten.amax.default, aten.amin.default, aten.max.dim,
      aten.min.dim, aten.argmax.default, aten.argmin.default, aten.var.correction, aten.std.correction,
      aten.var.dim, aten.std.dim,
      aten.any.dim, aten.all.dim, aten.prod.dim_int, aten.norm.ScalarOpt_dim, aten.logsumexp.default,
      aten.var_mean.correction)
def reduce_whole_rule(node, in_shapes, out_shapes):
    """Reductions that are not plain sums: the reduced dims stay whole."""
    nd = len(in_shapes[0])
    red = _reduce_dims(node, nd)
    labs = _labels(nd)
    outs = []
    for s in out_shapes:
        if len(s) == nd:
            outs.append(tuple(None if d in red else labs[d] for d in range(nd)))
        else:
            outs.append(tuple(labs[d] for d in range(nd) if d not in red))
    return DimMap([_forbid(labs, red)], outs, list(in_shapes), list(out_shapes))


# ---------------------------------------------------------------- matmuls
@record(aten.mm.default, aten.bmm.default, aten.matmul.default)
def matmul_rule(node, in_shapes, out_shapes):
    """``mm``, ``bmm``, ``matmul`` (broadcast batch dims; a 1-D operand is a vector whose
    ``m`` or ``n`` dim the output lacks): ``k`` contracted, batch dims, ``m`` and ``n`` parallel."""
    a, b = in_shapes
    out = out_shapes[0]
    core_a = ("m", "k") if len(a) >= 2 else ("k",)
    core_b = ("k", "n") if len(b) >= 2 else ("k",)
    nb = len(out) - (len(core_a) - 1) - (len(core_b) - 1)
    batch = _labels(nb, "b")

    def labels(s, core):
        n = len(s) - len(core)  # batch dims of this operand, aligned right with the output's
        return tuple(batch[nb - n + i] if s[i] == out[nb - n + i] else None for i in range(n)) + core

    lout = batch + core_a[:-1] + core_b[1:]
    return DimMap([labels(a, core_a), labels(b, core_b)], [lout], list(in_shapes), list(out_shapes),
                  reduce=frozenset({"k"}), uneven=len(lout) + 1)


@record(aten.addmm.default, aten.baddbmm.default)
def addmm_rule(node, in_shapes, out_shapes):
    bias, a, b = in_shapes
    out = out_shapes[0]
    batch = _labels(len(out) - 2, "b")
    lout = batch + ("m", "n")
    off = len(out) - len(bias)
    lbias = tuple(lout[off + j] if bias[j] == out[off + j] else None for j in range(len(bias)))
    return DimMap([lbias, batch + ("m", "k"), batch + ("k", "n")], [lout], list(in_shapes), list(out_shapes),
                  reduce=frozenset({"k"}), uneven=len(lout))


@record(aten.linear.default)
def linear_rule(node, in_shapes, out_shapes):
    batch = _labels(len(in_shapes[0]) - 1, "b")
    ins = [batch + ("k",), ("n", "k")]
    if len(in_shapes) == 3:
        ins.append(("n",) if len(in_shapes[2]) == 1 else (None,) * len(in_shapes[2]))
    return DimMap(ins, [batch + ("n",)], list(in_shapes), list(out_shapes), reduce=frozenset({"k"}),
                  uneven=len(batch) + 1)


# ---------------------------------------------------------------- NN ops
@record(aten.layer_norm.default, aten.rms_norm.default)
def norm_rule(node, in_shapes, out_shapes):
    nd = len(in_shapes[0])
    k = len(op_args(node)["normalized_shape"])
    labs = _forbid(_labels(nd), set(range(nd - k, nd)))
    ins = [labs] + [(None,) * len(s) for s in in_shapes[1:]]
    # uneven leading dims: layer_norm only (rms_norm fails on per-rank sizes under LocalTensorMode,
    # so its uneven splits could not be verified)
    return DimMap(ins, [labs], list(in_shapes), list(out_shapes),
                  uneven=nd if node.target == aten.layer_norm.default else 0)


def local_group_norm(call: LocalCall):
    """``group_norm`` with its channels split: the local number of groups."""
    pieces = call.pieces(0, 1)
    if pieces == 1:
        return call.emit()
    return call.emit(None, *call.with_arg("num_groups", call.bound()["num_groups"] // pieces))


@record(aten.group_norm.default, local=local_group_norm)
def group_norm_rule(node, in_shapes, out_shapes):
    """Input ``(N, C, *)`` normalized per sample over each group of ``C / num_groups``
    channels and the spatial dims: the batch may be split, and the channels by whole groups
    (with ``weight`` and ``bias``, ``(C,)``); the spatial dims stay whole."""
    x = in_shapes[0]
    lx = ("n", "c") + (None,) * (len(x) - 2)
    return DimMap([lx] + [("c",)] * (len(in_shapes) - 1), [lx], list(in_shapes), list(out_shapes),
                  blocks={"c": op_args(node)["num_groups"]})


@record(aten._weight_norm.default)
def weight_norm_rule(node, in_shapes, out_shapes):
    """``_weight_norm(v, g, dim)`` = ``g · v / ‖v‖``, the norm over every dim but ``dim``
    (``g`` has ``v``'s size there and 1 elsewhere): only ``dim`` may be split; with
    ``dim=-1`` (the norm of the whole tensor) nothing."""
    v, g = in_shapes
    dim = op_args(node)["dim"]
    lv = tuple("d" if d == dim else None for d in range(len(v)))
    lg = tuple("d" if d == dim and g[d] == v[d] else None for d in range(len(g)))
    return DimMap([lv, lg], [lv], list(in_shapes), list(out_shapes))


def local_embedding(call: LocalCall):
    """``embedding`` with the vocabulary (weight dim 0) split, Megatron-LM's vocab-parallel
    embedding (Shoeybi et al. 2019, §3): each device looks up the ids in its own row range
    ``[lo, lo + rows)`` and writes zeros for the others, so the devices' outputs sum to the
    dense lookup (a ``Partial`` output). The lookup's backward scatters each gradient row
    into the owning device's weight rows only (the masked rows get zeros), which is the
    dense gradient restricted to the shard. A ``padding_idx`` (a global row) keeps its
    value and gets no gradient, as in the dense op."""
    if call.pieces(0, 0) == 1:
        return call.emit()
    a = call.bound()
    w, ids, pad = a["weight"], a["indices"], a["padding_idx"]
    rows = -(-call.in_shapes[0][0] // call.pieces(0, 0))
    local = call.call(aten.sub.Tensor, (ids, call.first_row(0, 0)))
    mine = call.call(aten.logical_and.default, (call.call(aten.ge.Scalar, (local, 0)),
                                                call.call(aten.lt.Scalar, (local, rows))))
    looked = call.call(aten.embedding.default, (w, call.call(aten.where.ScalarOther, (mine, local, 0))))
    out = call.call(aten.where.ScalarOther, (call.call(aten.unsqueeze.default, (mine, -1)), looked, 0.0))
    if pad is None or pad < 0:
        return out
    is_pad = call.call(aten.unsqueeze.default, (call.call(aten.eq.Scalar, (ids, pad)), -1))
    return call.call(aten.where.self, (is_pad, call.call(aten.detach.default, (out,)), out))


@record(aten.embedding.default, local=local_embedding)
def embedding_rule(node, in_shapes, out_shapes):
    """``embedding(weight (V, E), indices)``: the ids may be split any way with the output,
    the embedding dim ``E`` with the weight, and the vocabulary ``V`` (weight rows) too,
    which leaves a ``Partial`` output (:func:`local_embedding`; the ids replicated along
    that mesh axis). Not the vocabulary with ``scale_grad_by_freq`` (counts over the
    masked local ids would differ) or ``sparse`` gradients."""
    w, idx = in_shapes
    li = _labels(len(idx), "i")
    a = op_args(node)
    vocab = "v" if not (a["scale_grad_by_freq"] or a["sparse"]) else None
    return DimMap([(vocab, "e"), li], [li + ("e",)], list(in_shapes), list(out_shapes),
                  reduce=frozenset({"v"}), factors=frozenset({1}))


@record(aten.scaled_dot_product_attention.default)
def sdpa_rule(node, in_shapes, out_shapes):
    """``scaled_dot_product_attention(q, k, v, mask)`` on ``[B, H, S, D]``: batch and heads
    split with every operand (a causal query's sequence stays whole, else it may be split
    with the mask); the heads also unevenly (each head's attention is independent: 25 heads
    on 2 devices are 13 and 12, as cut in units of the head dim by the projections around),
    unless the op draws dropout (random ops split evenly)."""
    q, k, v = in_shapes[:3]
    is_causal = op_args(node)["is_causal"]
    lq = ("b", "h", None if is_causal else "sq", None)
    lkv = ("b", "h", None, None)
    ins = [lq, lkv, lkv]
    if len(in_shapes) > 3:
        m = in_shapes[3]
        full = (q[0], q[1], q[2], k[2])
        names = ("b", "h", lq[2], None)
        off = 4 - len(m)
        ins.append(tuple(names[off + j] if m[j] == full[off + j] and m[j] != 1 else None for j in range(len(m))))
    random = bool(op_args(node)["dropout_p"])  # random ops split evenly, as in pointwise_dimmap
    return DimMap(ins, [("b", "h", lq[2], None)], list(in_shapes), list(out_shapes), uneven=0 if random else 1,
                  uneven_labels=frozenset({"h"}))


def local_conv(call: LocalCall):
    """A depthwise convolution with its channels split: as many local groups as local channels."""
    groups, pieces = call.bound()["groups"], call.pieces(0, 1)
    if groups > 1 and pieces > 1:
        return call.emit(None, *call.with_arg("groups", groups // pieces))
    return call.emit()


@record(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default, aten.convolution.default,
        local=local_conv)
def conv_rule(node, in_shapes, out_shapes):
    """Batch split; for ``groups == 1`` also output channels (column-parallel) and input
    channels (a contraction: partial sums, the bias added once); for depthwise
    (``groups == channels``) the channels. Spatial dims stay whole (no halo exchange)."""
    x, w = in_shapes[0], in_shapes[1]
    nsp = len(x) - 2
    a = op_args(node)
    groups, transposed = a["groups"], a.get("transposed", False)
    sp = (None,) * nsp
    if transposed or (groups != 1 and not (groups == x[1] == w[0])):
        lx, lw, lb, lo, red = ("n", None) + sp, (None,) * len(w), (None,), ("n", None) + sp, frozenset()
    elif groups == 1:
        lx, lw, lb, lo, red = ("n", "c") + sp, ("o", "c") + sp, ("o",), ("n", "o") + sp, frozenset({"c"})
    else:  # depthwise
        lx, lw, lb, lo, red = ("n", "c") + sp, ("c", None) + sp, ("c",), ("n", "c") + sp, frozenset()
    ins = [lx, lw] + ([lb] if len(in_shapes) > 2 else [])
    return DimMap(ins, [lo], list(in_shapes), list(out_shapes), reduce=red)


@record(aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default, aten.avg_pool1d.default,
      aten.avg_pool2d.default, aten.avg_pool3d.default, aten.adaptive_avg_pool1d.default,
      aten.adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default, aten.adaptive_max_pool1d.default,
      aten.adaptive_max_pool2d.default, aten.max_pool2d_with_indices.default, aten._adaptive_avg_pool2d.default)
def pool_rule(node, in_shapes, out_shapes):
    """Pooling: batch and channels split, the pooled (trailing) dims stay whole."""
    name = node.target._opname if hasattr(node.target, "_opname") else str(node.target)
    nsp = 3 if "3d" in name else 2 if "2d" in name else 1
    nd = len(in_shapes[0])
    labs = tuple(f"d{i}" for i in range(nd - nsp)) + (None,) * nsp
    return DimMap([labs], [labs] * len(out_shapes), list(in_shapes), list(out_shapes))


@record(aten.gather.default)
def gather_rule(node, in_shapes, out_shapes):
    x, idx = in_shapes
    dim = _norm(op_args(node)["dim"], len(x))
    li = _forbid(_labels(len(idx)), {dim})
    lx = tuple(li[d] if d != dim and x[d] == idx[d] else None for d in range(len(x)))
    return DimMap([lx, li], [li], list(in_shapes), list(out_shapes))


@record(aten.index_select.default)
def index_select_rule(node, in_shapes, out_shapes):
    nd = len(in_shapes[0])
    dim = _norm(op_args(node)["dim"], nd)
    labs = _forbid(_labels(nd), {dim})
    return DimMap([labs, (None,)], [labs], list(in_shapes), list(out_shapes))


def _fixed_length_bags(node) -> bool:
    """The bags of an ``embedding_bag`` node are ``B`` runs of ``L`` consecutive indices:
    its offsets are ``arange(0, B·L, L)`` (what ``nn.EmbeddingBag`` builds from a 2-D input)."""
    a = op_args(node)
    offsets, n = a["offsets"], a["indices"].meta["val"].shape[0]
    if a["include_last_offset"] or offsets.target != aten.arange.start_step:
        return False
    o = op_args(offsets)
    return o["start"] == 0 and o["end"] == n and o["step"] * offsets.meta["val"].shape[0] == n


def local_embedding_bag(call: LocalCall):
    """A batch-split ``embedding_bag``: each device's offsets count from its first index."""
    offsets = call.bound()["offsets"]
    if call.pieces(2, 0) == 1:
        return call.emit()
    local = call.call(aten.sub.Tensor, (offsets, call.call(aten.select.int, (offsets, 0, 0))))
    return call.emit(None, *call.with_arg("offsets", local))


@record(aten.embedding_bag.default, aten.embedding_bag.padding_idx, local=local_embedding_bag)
def embedding_bag_rule(node, in_shapes, out_shapes):
    """``embedding_bag(weight, indices, offsets, ..., per_sample_weights)`` with bags of one
    length (:func:`_fixed_length_bags`): the bags may be split (indices, offsets, per-sample
    weights and the ``(B, E)`` output alike, :func:`local_embedding_bag`). ``None`` (not
    covered) for bags of varying length, or when the op's other outputs (offset2bag,
    bag sizes, max indices: local values on a split) are read."""
    if not _fixed_length_bags(node) or any(u.args[1] != 0 and u.users for u in node.users):
        return None
    ins = [(None, None)] + [("b",)] * (len(in_shapes) - 1)
    outs = [("b",) + (None,) * (len(s) - 1) for s in out_shapes]
    return DimMap(ins, outs, list(in_shapes), list(out_shapes))


@record(aten.fill_.Tensor)
def fill_rule(node, in_shapes, out_shapes):
    """``x.fill_(value)`` with a 0-d ``value``: ``x`` split any way, ``value`` replicated."""
    labs = _labels(len(in_shapes[0]))
    return DimMap([labs, ()], [labs], list(in_shapes), list(out_shapes))


@record(aten.index_put_.default)
def index_put_rule(node, in_shapes, out_shapes):
    """``x[indices] = values`` in place: the dims of ``x`` after the indexed ones may be
    split, with the matching trailing dims of ``values`` (which broadcast against them);
    the indexed dims and the index tensors stay whole (a boolean index covers as many dims
    as it has)."""
    x = in_shapes[0]
    covered = sum(1 if i is None or i.meta["val"].dtype != torch.bool else i.meta["val"].ndim
                  for i in op_args(node)["indices"])
    labs = (None,) * covered + _labels(len(x))[covered:]
    v = in_shapes[-1]
    lv = tuple(labs[len(x) - len(v) + j] if len(v) - j <= len(x) - covered and v[j] == x[len(x) - len(v) + j]
               else None for j in range(len(v)))
    return DimMap([labs] + [(None,) * len(s) for s in in_shapes[1:-1]] + [lv], [labs], list(in_shapes),
                  list(out_shapes))


def local_filled(call: LocalCall):
    """A filled creation op on one device: its ``size`` the local shape."""
    return call.emit(None, *call.with_arg("size", list(call.local_out_shape(0))))


@record(aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.full.default, local=local_filled)
def filled_rule(node, in_shapes, out_shapes):
    """``empty``, ``zeros``, ``ones``, ``full(size, value)``: every element the same (or
    unset), so every dim may be split evenly, each device creating its piece
    (:func:`local_filled`). Captured ``new_*`` calls become these
    (:mod:`autoparallel.tracer.decompose`)."""
    labs = _labels(len(out_shapes[0]))
    return DimMap([], [labs], [], list(out_shapes))


# creation ops whose values depend on the position, and index: replicated by rule (the consumer
# slices locally for free)
REPLICATE_ONLY = {
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.scalar_tensor.default, aten.index.Tensor,
    aten.tril.default, aten.triu.default, aten.linspace.default, aten.eye.default,
}
