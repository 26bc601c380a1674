"""Records of loss ops whose reduced form runs on a split batch as a local sum: their
rules, their per-device rewrites and cross-entropy's own all-reduce (see
:mod:`~autoparallel.strategies.records`)."""

from __future__ import annotations

import math

import torch

from ..graph import op_args
from ..placement import partial_axes
from .engine import DimMap
from .records import LocalCall, record

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2  # torch's Reduction enum, as ATen loss ops take it


def local_cross_entropy(call: LocalCall):
    """``cross_entropy_loss`` with a split batch (a ``Partial`` output): the local sum (weight,
    ignore_index and label_smoothing as given), divided for 'mean' by the global denominator
    torch uses: the count of kept (not ignored) targets, or with a weight the sum of their
    classes' weights, all-reduced over the output's partial mesh axes."""
    axes = partial_axes(call.output_specs[0])
    if not axes:
        return call.emit()
    a = call.bound()
    x, t, w, ignore = a["self"], a["target"], a["weight"], a["ignore_index"]
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
        den = call.all_reduce(den, ax)
    return call.call(aten.div.Tensor, (loss, den))


def cross_entropy_cost(node, strategy, cost_model) -> float:
    """'mean' with a split batch all-reduces its denominator over every partial mesh axis."""
    if op_args(node)["reduction"] != _MEAN:
        return 0.0
    return sum(cost_model.collective_time("all_reduce", a, 8) for a in partial_axes(strategy.outputs[0]))


@record(aten.cross_entropy_loss.default, local=local_cross_entropy, cost=cross_entropy_cost)
def cross_entropy_rule(node, in_shapes, out_shapes):
    """Input ``(N, C, d1, ...)``, target ``(N, d1, ...)``: the batch and spatial dims may be
    split, the classes stay whole (a ``weight`` is replicated).

    ``reduction='none'``: the loss of every element is its own, so the output is split like
    the target. ``'sum'`` and ``'mean'``: the output is ``Partial`` (:func:`local_cross_entropy`).
    An unbatched input ``(C,)`` has nothing to split: replicated."""
    x, t = in_shapes[0], in_shapes[1]
    if len(x) < 2:
        return DimMap([(None,) * len(s) for s in in_shapes], [(None,) * len(s) for s in out_shapes],
                      list(in_shapes), list(out_shapes))
    lx = ("n", None) + tuple(f"s{i}" for i in range(len(x) - 2))
    lt = ("n",) + tuple(f"s{i}" for i in range(len(t) - 1))
    lw = [(None,) * len(s) for s in in_shapes[2:]]  # the weight, when given
    if op_args(node)["reduction"] == _NONE:
        return DimMap([lx, lt] + lw, [lt], list(in_shapes), list(out_shapes))
    return DimMap([lx, lt] + lw, [()], list(in_shapes), list(out_shapes), reduce=frozenset(lx) - {None},
                  factors=frozenset(range(2, len(in_shapes))))


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
