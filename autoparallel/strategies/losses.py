"""Records of loss ops whose reduced form runs on a split batch as a local sum, and of the
vocab-parallel forms (Shoeybi et al. 2019, Megatron-LM §3) of ``cross_entropy_loss``,
``nll_loss`` (classes split) and ``softmax``/``log_softmax`` (normalized dim split): their
rules, their per-device rewrites and the all-reduces they perform themselves (see
:mod:`~autoparallel.strategies.records`; design notes: docs/design.md, "Vocab-parallel
embedding and cross-entropy")."""

from __future__ import annotations

import math
import operator

import torch

from ..graph import op_args, tensor_inputs
from ..placement import local_shape, partial_axes, shard_axes
from ..runtime_kernels.cross_entropy import local_logsumexp, vocab_parallel_cross_entropy
from ..tracer.annotate import node_info
from .engine import DimMap
from .records import LocalCall, record

aten = torch.ops.aten

_NONE, _MEAN, _SUM = 0, 1, 2  # torch's Reduction enum, as ATen loss ops take it


def _mean(call: LocalCall, loss, kept, cls, weight, axes):
    """``loss`` (this device's sum of per-element losses) divided by the global denominator
    torch's 'mean' uses: the count of kept targets (``kept``, bool, like the target), or with
    ``weight`` the sum of their classes' weights (``cls``: each target's class, any valid
    index where not kept), summed over mesh ``axes``."""
    if weight is None:
        den = call.call(aten._to_copy.default, (call.call(aten.sum.default, (kept,)),), {"dtype": torch.float32})
    else:
        cls = call.call(aten.reshape.default, (call.call(aten.where.ScalarOther, (kept, cls, 0)), [-1]))
        wt = call.call(aten.index_select.default, (weight, 0, cls))
        flat = call.call(aten.reshape.default, (kept, [-1]))
        den = call.call(aten.sum.default, (call.call(aten.mul.Tensor, (wt, flat)),))
    for ax in axes:
        den = call.all_reduce(den, ax)
    return call.call(aten.div.Tensor, (loss, den))


def _batch_mean(call: LocalCall, loss, classes: tuple[int, ...] = ()):
    """:func:`_mean` over the kept targets of the whole (local) target, summed over the
    output's partial mesh axes that split the batch (not ``classes``, the axes splitting the
    classes, along which the target is whole)."""
    a = call.bound()
    kept = call.call(aten.ne.Scalar, (a["target"], a["ignore_index"]))
    axes = [ax for ax in partial_axes(call.output_specs[0]) if ax not in classes]
    return _mean(call, loss, kept, a["target"], a["weight"], axes)


def _class_rule(node, in_shapes, out_shapes, split_weight: bool):
    """Rule of ``cross_entropy_loss`` and ``nll_loss``: input ``(N, C, d1, ...)``, target
    ``(N, d1, ...)``: the batch and spatial dims may be split, and the classes ``C`` (the
    target then whole along those mesh axes, a ``weight`` split with the classes when
    ``split_weight``, else whole; the output ``Partial``).
    ``reduction='none'``: the output is split like the target; 'sum' and 'mean': a 0-d
    ``Partial``. The classes may be split unevenly (``torch.chunk`` pieces; not the batch,
    whose uneven local loss cannot run under simulated ranks: docs/design.md, "Losses on
    uneven classes"). An unbatched input ``(C,)`` has nothing to split: replicated."""
    x, t = in_shapes[0], in_shapes[1]
    if len(x) < 2:
        return DimMap([(None,) * len(s) for s in in_shapes], [(None,) * len(s) for s in out_shapes],
                      list(in_shapes), list(out_shapes))
    lx = ("n", "c") + tuple(f"s{i}" for i in range(len(x) - 2))
    lt = ("n",) + tuple(f"s{i}" for i in range(len(t) - 1))
    lw = [("c" if split_weight else None,) for _ in in_shapes[2:]]  # the weight, when given
    factors = frozenset(range(1, len(in_shapes)))  # target, weight: whole along axes splitting labels they lack
    if op_args(node)["reduction"] == _NONE:
        return DimMap([lx, lt] + lw, [lt], list(in_shapes), list(out_shapes), reduce=frozenset({"c"}),
                      factors=factors, uneven=1, uneven_labels=frozenset({"c"}))
    return DimMap([lx, lt] + lw, [()], list(in_shapes), list(out_shapes), reduce=frozenset(lx), factors=factors,
                  uneven=1, uneven_labels=frozenset({"c"}))


def _local_rows(shape, spec, mesh_shape, dim: int) -> int:
    """Local elements of a tensor of global ``shape`` under ``spec`` per element of ``dim``."""
    local = local_shape(shape, spec, mesh_shape)
    return math.prod(local) // local[dim]


def _mean_cost(node, strategy, cost_model, classes) -> float:
    """'mean' over a split batch all-reduces its denominator (8 bytes) over each axis splitting it."""
    if op_args(node)["reduction"] != _MEAN:
        return 0.0
    return sum(cost_model.collective_time("all_reduce", a, 8) for a in partial_axes(strategy.outputs[0])
               if a not in classes)


# ---------------------------------------------------------------- cross-entropy
def local_cross_entropy(call: LocalCall):
    """``cross_entropy_loss`` on one device.

    Classes split (input dim 1 ``Shard`` along some mesh axes): Megatron-LM's vocab-parallel
    loss (Shoeybi et al. 2019, §3; :mod:`autoparallel.runtime_kernels.cross_entropy`): the
    local row maximum and sum of exponentials, all-reduced (max, then sum) over the class
    axes into each row's log-sum-exp, then this device's share of each element's loss
    (a ``Partial`` output), summed for 'sum' and 'mean'.

    Batch (or spatial dims) split: the local sum (weight, ignore_index and label_smoothing
    as given). 'mean' divides either sum by the global denominator (:func:`_mean`)."""
    if not partial_axes(call.output_specs[0]):
        return call.emit()
    a = call.bound()
    classes = shard_axes(call.input_specs[0], 1)
    if classes:
        loss = _vocab_parallel_loss(call, classes)
        if a["reduction"] == _NONE:
            return loss
        loss = call.call(aten.sum.default, (loss,))
    else:
        loss = call.call(aten.cross_entropy_loss.default, (a["self"], a["target"], a["weight"], _SUM,
                                                           a["ignore_index"], a["label_smoothing"]))
    return loss if a["reduction"] == _SUM else _batch_mean(call, loss, classes)


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
    row (the backward needs none); with 'mean' over a split batch, the all-reduce of the
    denominator (:func:`_mean_cost`)."""
    shape = tuple(tensor_inputs(node)[0][1].meta["val"].shape)
    x_spec = strategy.inputs[0]
    classes = shard_axes(x_spec, 1) if len(shape) > 1 else ()
    cost = _mean_cost(node, strategy, cost_model, classes)
    if classes:
        rows = _local_rows(shape, x_spec, cost_model.mesh.shape, 1)
        cost += sum(2 * cost_model.collective_time("all_reduce", ax, 4 * rows) for ax in classes)
    return cost


@record(aten.cross_entropy_loss.default, local=local_cross_entropy, cost=cross_entropy_cost)
def cross_entropy_rule(node, in_shapes, out_shapes):
    """Cross-entropy (:func:`_class_rule`, the weight whole: the local backward reads the
    target's class weight and their sum; with the classes split, :func:`local_cross_entropy`)."""
    return _class_rule(node, in_shapes, out_shapes, split_weight=False)


# ---------------------------------------------------------------- log_softmax + nll_loss
def local_nll_loss(call: LocalCall):
    """``nll_loss`` with the classes split: each device picks the log-probabilities of the
    targets it owns (``nll_loss`` on its classes and its slice of the weight, every other
    target ignored), so the devices' losses sum to the dense one (a ``Partial`` output);
    'mean' divides the local sum by the global denominator, the owned targets' count or
    weights summed over every partial mesh axis (:func:`_mean`). Gradients are those of the
    local pick: exact. With the batch split only: the local sum over the global denominator
    (:func:`_batch_mean`)."""
    if not partial_axes(call.output_specs[0]):
        return call.emit()
    a = call.bound()
    x, t, w, ignore = a["self"], a["target"], a["weight"], a["ignore_index"]
    reduction = _NONE if a["reduction"] == _NONE else _SUM
    classes = shard_axes(call.input_specs[0], 1)
    if not classes:
        loss = call.emit(None, (x, t, w, reduction, ignore), {})
        return loss if a["reduction"] != _MEAN else _batch_mean(call, loss)
    n_local = local_shape(call.in_shapes[0], call.input_specs[0], call.mesh_shape)[1]
    local = call.call(aten.sub.Tensor, (t, call.first_row(0, 1)))
    inside = call.call(aten.logical_and.default, (call.call(aten.ge.Scalar, (local, 0)),
                                                  call.call(aten.lt.Scalar, (local, n_local))))
    own = call.call(aten.logical_and.default, (inside, call.call(aten.ne.Scalar, (t, ignore))))
    mine = call.call(aten.where.ScalarOther, (own, local, -1))  # -1: not this device's, ignored
    loss = call.emit(None, (x, mine, w, reduction, -1), {})
    if a["reduction"] != _MEAN:
        return loss
    return _mean(call, loss, own, mine, w, partial_axes(call.output_specs[0]))


@record(aten.nll_loss_nd.default, aten.nll_loss.default, local=local_nll_loss,
        cost=lambda node, s, cm: _mean_cost(node, s, cm, ()))
def nll_loss_rule(node, in_shapes, out_shapes):
    """``nll_loss`` (:func:`_class_rule`, the weight split with the classes; with the
    classes split, :func:`local_nll_loss`)."""
    return _class_rule(node, in_shapes, out_shapes, split_weight=True)


def local_softmax(call: LocalCall):
    """``softmax`` / ``log_softmax`` along a split dim (the vocab-parallel form of the
    ``log_softmax`` + ``nll_loss`` pattern, Megatron-LM §3): the local maximum, all-reduced
    (max, no gradient: the result does not depend on it), then the local sum of
    exponentials, all-reduced (sum; its autograd conjugate, another all-reduce, carries the
    gradient of the normalizer to every device), giving ``x - max - log Σ`` or
    ``exp(x - max) / Σ``. The dtype argument and ``half_to_float`` cast first."""
    a = call.bound()
    x, nd = call.args[0], len(call.in_shapes[0])
    dim = a["dim"] % nd
    axes = shard_axes(call.input_specs[0], dim)
    if not axes:
        return call.emit()
    if a.get("dtype") is not None or a.get("half_to_float"):
        x = call.call(aten._to_copy.default, (x,), {"dtype": a.get("dtype") or torch.float32})
    top = call.call(aten.amax.default, (call.call(aten.detach.default, (x,)), [dim], True))
    for ax in axes:
        top = call.all_reduce_max(top, ax)
    shifted = call.call(aten.sub.Tensor, (x, top))
    e = call.call(aten.exp.default, (shifted,))
    s = call.call(aten.sum.dim_IntList, (e, [dim], True))
    for ax in axes:
        s = call.all_reduce(s, ax)
    if call.node.target in (aten.softmax.int, aten._softmax.default):
        return call.call(aten.div.Tensor, (e, s))
    return call.call(aten.sub.Tensor, (shifted, call.call(aten.log.default, (s,))))


def softmax_cost(node, strategy, cost_model) -> float:
    """Along a split dim, per mesh axis splitting it: the all-reduces (max, sum) of the
    forward and the all-reduce (sum) of the normalizer's gradient, one value per row."""
    x = tensor_inputs(node)[0][1].meta["val"]
    dim = op_args(node)["dim"] % x.dim()
    axes = shard_axes(strategy.inputs[0], dim)
    if not axes:
        return 0.0
    nbytes = _local_rows(tuple(x.shape), strategy.inputs[0], cost_model.mesh.shape, dim) * x.element_size()
    passes = 3 if node_info(node).requires_grad else 2
    return sum(passes * cost_model.collective_time("all_reduce", ax, nbytes) for ax in axes)


@record(aten.softmax.int, aten._softmax.default, aten.log_softmax.int, aten._log_softmax.default,
        local=local_softmax, cost=softmax_cost)
def softmax_rule(node, in_shapes, out_shapes):
    """Every dim may be split, the normalized one too (:func:`local_softmax`)."""
    labs = tuple(f"d{i}" for i in range(len(in_shapes[0])))
    return DimMap([labs], [labs], list(in_shapes), list(out_shapes), uneven=1)


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
