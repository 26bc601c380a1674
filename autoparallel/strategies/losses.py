"""Records of loss ops whose reduced form runs on a split batch as a local sum, and of
cross-entropy with its classes split (vocab-parallel): their rules, their per-device
rewrites and cross-entropy's own all-reduces (see :mod:`~autoparallel.strategies.records`)."""

from __future__ import annotations

import math
import operator

import torch

from ..graph import op_args, tensor_inputs
from ..placement import local_shape, partial_axes, shard_axes
from ..runtime_kernels.cross_entropy import local_logsumexp, vocab_parallel_cross_entropy
from .engine import DimMap
from .records import LocalCall, record

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2  # torch's Reduction enum, as ATen loss ops take it


def local_cross_entropy(call: LocalCall):
    """``cross_entropy_loss`` on one device.

    Classes split (input dim 1 ``Shard`` along some mesh axes): Megatron-LM's vocab-parallel
    loss (Shoeybi et al. 2019, §3; :mod:`autoparallel.runtime_kernels.cross_entropy`): the
    local row maximum and sum of exponentials, all-reduced (max, then sum) over the class
    axes into each row's log-sum-exp, then this device's share of each element's loss
    (a ``Partial`` output), reduced as asked below.

    Batch (or spatial dims) split: the local sum (weight, ignore_index and label_smoothing
    as given). For 'mean', the sum is divided by the global denominator torch uses: the
    count of kept (not ignored) targets, or with a weight the sum of their classes'
    weights, all-reduced over the output's partial mesh axes that split the batch (the
    target is whole along the class axes)."""
    axes = partial_axes(call.output_specs[0])
    if not axes:
        return call.emit()
    a = call.bound()
    x, t, w, ignore = a["self"], a["target"], a["weight"], a["ignore_index"]
    classes = shard_axes(call.input_specs[0], 1)
    if classes:
        loss = _vocab_parallel_loss(call, classes)
        if a["reduction"] == _NONE:
            return loss
        loss = call.call(aten.sum.default, (loss,))
    else:
        loss = call.call(aten.cross_entropy_loss.default, (x, t, w, _SUM, ignore, a["label_smoothing"]))
    if a["reduction"] == _SUM:
        return loss
    kept = call.call(aten.ne.Scalar, (t, ignore))
    if w is None:
        den = call.call(aten._to_copy.default, (call.call(aten.sum.default, (kept,)),), {"dtype": torch.float32})
    else:  # the weight of each kept target's class, 0 for ignored ones
        cls = call.call(aten.reshape.default, (call.call(aten.where.ScalarOther, (kept, t, 0)), [-1]))
        wt = call.call(aten.index_select.default, (w, 0, cls))
        flat = call.call(aten.reshape.default, (kept, [-1]))
        den = call.call(aten.sum.default, (call.call(aten.mul.Tensor, (wt, flat)),))
    for ax in axes:
        if ax not in classes:
            den = call.all_reduce(den, ax)
    return call.call(aten.div.Tensor, (loss, den))


def _vocab_parallel_loss(call: LocalCall, classes: tuple[int, ...]):
    """The nodes of the vocab-parallel loss (:func:`local_cross_entropy`): this device's
    share of each element's loss, shaped like the target."""
    a = call.bound()
    stats = call.call(local_logsumexp, (a["self"],))
    m, s = (call.call(operator.getitem, (stats, i)) for i in range(2))
    top = m
    for ax in classes:
        top = call.all_reduce_max(top, ax)
    s = call.call(aten.mul.Tensor, (s, call.call(aten.exp.default, (call.call(aten.sub.Tensor, (m, top)),))))
    for ax in classes:
        s = call.all_reduce(s, ax)
    lse = call.call(aten.add.Tensor, (top, call.call(aten.log.default, (s,))))
    return call.call(vocab_parallel_cross_entropy, (
        a["self"], a["target"], a["weight"], lse, call.first_row(0, 1), call.in_shapes[0][1], a["ignore_index"],
        a["label_smoothing"]))


def cross_entropy_cost(node, strategy, cost_model) -> float:
    """Seconds of the loss's own collectives under ``strategy``: with the classes split, per
    mesh axis splitting them, an all-reduce (max) and an all-reduce (sum) of one float32 per
    row (``M`` = the input's local elements over its local classes); with 'mean' over a
    split batch, the all-reduce of the denominator (8 bytes) over each axis splitting it."""
    x_spec = strategy.inputs[0]
    shape = tuple(tensor_inputs(node)[0][1].meta["val"].shape)
    classes = shard_axes(x_spec, 1) if len(shape) > 1 else ()
    cost = 0.0
    if classes:
        local = local_shape(shape, x_spec, cost_model.mesh.shape)
        rows = math.prod(local) // local[1]
        cost += sum(2 * cost_model.collective_time("all_reduce", ax, 4 * rows) for ax in classes)
    if op_args(node)["reduction"] == _MEAN:
        cost += sum(cost_model.collective_time("all_reduce", ax, 8) for ax in partial_axes(strategy.outputs[0])
                    if ax not in classes)
    return cost


@record(aten.cross_entropy_loss.default, local=local_cross_entropy, cost=cross_entropy_cost)
def cross_entropy_rule(node, in_shapes, out_shapes):
    """Input ``(N, C, d1, ...)``, target ``(N, d1, ...)``: the batch and spatial dims may be
    split, and the classes ``C`` (vocab-parallel, :func:`local_cross_entropy`; the target and
    a ``weight`` are then whole along those mesh axes, the output ``Partial``).

    ``reduction='none'``: the loss of every element is its own, so the output is split like
    the target. ``'sum'`` and ``'mean'``: the output is ``Partial`` (:func:`local_cross_entropy`).
    An unbatched input ``(C,)`` has nothing to split: replicated."""
    x, t = in_shapes[0], in_shapes[1]
    if len(x) < 2:
        return DimMap([(None,) * len(s) for s in in_shapes], [(None,) * len(s) for s in out_shapes],
                      list(in_shapes), list(out_shapes))
    lx = ("n", "c") + tuple(f"s{i}" for i in range(len(x) - 2))
    lt = ("n",) + tuple(f"s{i}" for i in range(len(t) - 1))
    lw = [(None,) * len(s) for s in in_shapes[2:]]  # the weight, when given
    factors = frozenset(range(1, len(in_shapes)))  # target and weight: whole along the class axes
    if op_args(node)["reduction"] == _NONE:
        return DimMap([lx, lt] + lw, [lt], list(in_shapes), list(out_shapes), reduce=frozenset({"c"}),
                      factors=factors)
    return DimMap([lx, lt] + lw, [()], list(in_shapes), list(out_shapes), reduce=frozenset(lx), factors=factors)


def local_bce_with_logits(call: LocalCall):
    """``binary_cross_entropy_with_logits`` 'mean' over a split input: the local sum divided
    by the global element count."""
    if call.bound()["reduction"] != _MEAN or not partial_axes(call.output_specs[0]):
        return call.emit()
    loss = call.emit(None, *call.with_arg("reduction", _SUM))
    return call.call(aten.div.Tensor, (loss, math.prod(call.in_shapes[0])))


@record(aten.binary_cross_entropy_with_logits.default, local=local_bce_with_logits)
def bce_with_logits_rule(node, in_shapes, out_shapes):
    """Input and target of one shape, ``weight`` and ``pos_weight`` broadcast to it: every
    dim may be split. A weight is split with the input along the dims it has at full size
    and replicated along those it broadcasts. 'none': the output is split like the input.
    'sum' and 'mean': the output is ``Partial`` (:func:`local_bce_with_logits`)."""
    x = in_shapes[0]
    labs = tuple(f"d{i}" for i in range(len(x)))
    ws = []
    for s in in_shapes[2:]:
        off = len(x) - len(s)
        ws.append(tuple(labs[off + j] if s[j] == x[off + j] else None for j in range(len(s))))
    if op_args(node)["reduction"] == _NONE:
        return DimMap([labs, labs] + ws, [labs], list(in_shapes), list(out_shapes))
    return DimMap([labs, labs] + ws, [()], list(in_shapes), list(out_shapes), reduce=frozenset(labs),
                  factors=frozenset(range(2, len(in_shapes))))
