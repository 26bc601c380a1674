"""Batch norm as primitive ops, so that a batch split over devices normalizes by the
statistics of the global batch.

Capture keeps ``aten.batch_norm`` whole, and no sharding rule can split its batch: the op
computes its statistics from whatever rows it is given, so on a batch shard it would
normalize by that shard's mean and variance. :func:`decompose_batch_norm` rewrites each
``aten.batch_norm`` node into ops our rules already shard exactly. In training mode
(statistics of the batch), with ``R`` the reduced dims (all but the channel dim 1) and
``n`` the number of elements per channel::

    mean   = mean(x, R)                       # a split batch: partial sums, one all-reduce
    xc     = x - mean
    var    = mean(xc * xc, R)                 # biased, two passes like torch; one all-reduce
    y      = xc * (rsqrt(var + eps) * weight) + bias
    running_mean.copy_(running_mean * (1 - m) + m * mean)
    running_var.copy_(running_var * (1 - m) + m * n / (n - 1) * var)

(``mean`` and ``var`` detached for the running statistics, as torch updates them without
autograd). With the batch split, each ``mean`` reduces a split dim, so its result is a
pending sum (``Partial``) that must be all-reduced: two all-reduces of ``C`` values per
layer and step (and their conjugates in backward), after which every device holds the
global statistics. The graph carries each statistic negated, ``rsub(s, 0) = -s`` (exact,
and ``x + (-mean)``, ``eps - (-var)`` round as ``x - mean``, ``var + eps``): rsub cannot
take a pending sum, so the all-reduce lands on its input edge, once, and both the
normalization and the running update read the result. With two consumers of the pending
sum, the ILP would price one all-reduce per consumer and could emit two. Autograd saves
``xc`` once (for the square and the normalization), what the fused op saves of its input.
The ``copy_`` nodes make BatchNorm's hidden in-place update of its running statistics
explicit, for :func:`~autoparallel.tracer.mutations.functionalize_state` to turn into
outputs.

In eval mode (running statistics), ``y = x * scale + shift`` with ``scale = rsqrt(running_var
+ eps) * weight`` and ``shift = bias - running_mean * scale``, the formula of torch's CPU
kernel: pointwise, any split. Half-precision inputs are normalized in float32 and cast
back, as torch's kernels accumulate in float32.
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from .mutations import call_like

aten = torch.ops.aten

_ARGS = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps", "cudnn_enabled")
_LOW = (torch.float16, torch.bfloat16)


def decompose_batch_norm(graph: fx.Graph) -> int:
    """Replace every ``aten.batch_norm`` node of ``graph`` by primitive ops (module
    docstring); returns how many were replaced."""
    count = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.batch_norm.default:
            with graph.inserting_before(node):
                y = _decompose(graph, node)
            node.replace_all_uses_with(y)
            graph.erase_node(node)
            count += 1
    return count


def _decompose(graph: fx.Graph, node: fx.Node) -> fx.Node:
    a = dict(zip(_ARGS, node.args))
    a.update(node.kwargs)
    x, w, b, rm, rv = a["input"], a["weight"], a["bias"], a["running_mean"], a["running_var"]
    training, momentum, eps = a["training"], a["momentum"], a["eps"]
    xv = x.meta["val"]
    nd, c = xv.dim(), int(xv.shape[1])
    dims = [0] + list(range(2, nd))
    bshape = [1, c] + [1] * (nd - 2)
    dtype = torch.float32 if xv.dtype in _LOW else xv.dtype

    def op(target, *args, **kwargs):
        return call_like(graph, node, target, *args, **kwargs)

    def bcast(t):  # (C,) -> broadcastable against x
        return t if nd == 2 else op(aten.view.default, t, bshape)

    def cast(t):
        return t if t.meta["val"].dtype == dtype else op(aten._to_copy.default, t, dtype=dtype)

    xf = cast(x)
    if training:
        # each statistic is negated by rsub(s, 0) = -s (exact), a pointwise op that no rule lets
        # take a pending sum: a batch-split statistic is all-reduced there, once, for both the
        # normalization and the running update (two consumers of a pending sum would each be
        # priced, and might each be given, an all-reduce of their own)
        neg_mean = op(aten.rsub.Scalar, op(aten.mean.dim, xf, dims), 0)
        xc = op(aten.add.Tensor, xf, bcast(neg_mean))  # x + (-mean) == x - mean
        neg_var = op(aten.rsub.Scalar, op(aten.mean.dim, op(aten.mul.Tensor, xc, xc), dims), 0)
        scale = op(aten.rsqrt.default, op(aten.rsub.Scalar, neg_var, eps))  # eps - (-var) == var + eps
        if w is not None:
            scale = op(aten.mul.Tensor, scale, cast(w))
        y = op(aten.mul.Tensor, xc, bcast(scale))
        if b is not None:
            y = op(aten.add.Tensor, y, bcast(cast(b)))
        if rm is not None and rv is not None:
            n = math.prod(int(xv.shape[d]) for d in dims)
            unbias = n / (n - 1) if n > 1 else 1.0
            m = float(momentum)
            for buf, neg_stat, factor in ((rm, neg_mean, m), (rv, neg_var, m * unbias)):
                stat = op(aten.detach.default, neg_stat)
                new = op(aten.add.Tensor, op(aten.mul.Tensor, buf, 1.0 - m), op(aten.mul.Tensor, stat, -factor))
                op(aten.copy_.default, buf, new)
    else:
        scale = op(aten.rsqrt.default, op(aten.add.Tensor, cast(rv), eps))
        if w is not None:
            scale = op(aten.mul.Tensor, scale, cast(w))
        shifted = op(aten.mul.Tensor, cast(rm), scale)
        shift = op(aten.sub.Tensor, cast(b), shifted) if b is not None else op(aten.neg.default, shifted)
        y = op(aten.add.Tensor, op(aten.mul.Tensor, xf, bcast(scale)), bcast(shift))
    if dtype != xv.dtype:
        y = op(aten._to_copy.default, y, dtype=xv.dtype)
    return y
