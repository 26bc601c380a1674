"""Gradient reduction overlapped with the backward, in buckets, as DDP does it.

The emitted forward reads the parameters replicated along some mesh axes through
:func:`reduce_grads_in_bucket`, one call per bucket (the buckets are chosen at emit time by
:func:`autoparallel.passes.grad_buckets.grad_buckets`). In the backward, autograd calls
the bucket's backward as soon as the last gradient of its parameters exists; it flattens
the bucket's gradients into one buffer and launches an asynchronous all-reduce (sum) over
the first mesh axis' process group, then returns without waiting, so the backward of the
earlier layers runs while the bucket is in flight. One callback per bucket, queued on the
autograd engine, runs when the whole backward has finished: it waits for the all-reduce,
all-reduces over any further mesh axes, and adds each parameter's piece into its ``.grad``
(a DTensor with the parameter's placements). This is the reducer of Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, §3.2-3.3
(buckets in reverse order of the forward, launched when ready, waited at the end of the
backward by a callback of the autograd engine).

The gradient convention of DESIGN §2 holds: the gradient each device computes for a
replicated parameter is its partial sum, and the all-reduce makes it the full gradient.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .autograd import per_rank

_c10d = torch.ops._c10d_functional


def _add_grad(p: torch.Tensor, local_grad: torch.Tensor) -> None:
    """``p.grad += local_grad`` for parameter ``p`` (a DTensor or a plain tensor), creating
    the gradient with ``p``'s placements when there is none."""
    if not isinstance(p, DTensor):
        p.grad = local_grad if p.grad is None else p.grad + local_grad
        return
    if p.grad is None:
        p.grad = DTensor.from_local(local_grad, p.device_mesh, p.placements, run_check=False,
                                    shape=p.shape, stride=p.stride())
    else:
        p.grad._local_tensor.add_(local_grad)


class _BucketReduction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, groups, reduce_dtype, *params):
        ctx.groups, ctx.reduce_dtype = groups, reduce_dtype
        ctx.params = params
        return tuple(p.to_local() if isinstance(p, DTensor) else p.detach() for p in params)

    @staticmethod
    def backward(ctx, *grads):
        flat = per_rank(torch.cat([g.reshape(-1) for g in grads]))
        grad_dtype = flat.dtype
        if ctx.reduce_dtype is not None:
            flat = flat.to(ctx.reduce_dtype)
        pending = _c10d.all_reduce(flat, "sum", ctx.groups[0])  # launched; waited by finish()
        params, rest = ctx.params, ctx.groups[1:]
        shapes = [g.shape for g in grads]

        def finish():
            out = _c10d.wait_tensor(pending)
            for group in rest:
                out = _c10d.wait_tensor(_c10d.all_reduce(out, "sum", group))
            out = out.to(grad_dtype)
            for p, piece, shape in zip(params, torch.split(out, [s.numel() for s in shapes]), shapes):
                _add_grad(p, piece.view(shape))

        torch.autograd.Variable._execution_engine.queue_callback(finish)
        return (None,) * (2 + len(params))


def reduce_grads_in_bucket(groups: tuple[str, ...], *params: torch.Tensor,
                           reduce_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, ...]:
    """The local tensors of ``params`` (DTensor parameters replicated along the mesh axes
    whose process groups are ``groups``, all of one dtype); in the backward, their
    gradients are all-reduced (sum) over ``groups`` as one flat buffer launched as soon as
    the last of them exists and waited when the backward ends, then added into each
    parameter's ``.grad`` (module docstring).

    Args:
        groups: c10d process-group names, one per mesh axis the parameters are replicated
            along (at least one).
        params: the parameters (``nn.Parameter`` holding DTensors), in bucket order.
        reduce_dtype: the dtype the flat buffer is all-reduced in (a mixed-precision policy's
            reduce dtype, :func:`autoparallel.precision.reduce_dtype`); the sum is cast back
            to the gradients' dtype before it is added into ``.grad``. ``None``: their own.

    Returns:
        one local tensor per parameter, an autograd leaf of this bucket.
    """
    return _BucketReduction.apply(tuple(groups), reduce_dtype, *params)
