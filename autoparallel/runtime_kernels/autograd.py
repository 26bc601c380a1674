"""Functions the generated code calls besides ATen ops and ``_c10d_functional`` collectives.

Both are autograd identities in the forward; their backward carries the gradient
convention of DESIGN §2: a replicated tensor's gradient is held as per-device partial
sums, so a parameter replicated along mesh axes gets its gradient all-reduced over them
(:func:`grad_bucket`), and a value returned to the user, whose gradient every device
seeds in full, has it divided by the number of devices (:func:`returned`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

_c10d = torch.ops._c10d_functional


def per_rank(t: torch.Tensor) -> torch.Tensor:
    """Under simulated ranks (LocalTensorMode), make ``t`` a LocalTensor so that collectives
    see one value per rank; a plain tensor there would be taken as one shared value and the
    fake process group would leave it unreduced. A no-op in real runs."""
    from torch.distributed._local_tensor import LocalTensor, local_tensor_mode

    mode = local_tensor_mode()
    if mode is None or isinstance(t, LocalTensor):
        return t
    with mode.disable():
        return LocalTensor({r: t.clone() for r in mode.ranks})


class _GradBucketAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, groups, *xs):
        ctx.groups = groups
        ctx.meta = [(x.shape, x.dtype, x.device) for x in xs]
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        grads = [g if g is not None else torch.zeros(shape, dtype=dt, device=dev)
                 for g, (shape, dt, dev) in zip(grads, ctx.meta)]
        flat = per_rank(torch.cat([g.reshape(-1) for g in grads]))
        for group in ctx.groups:
            flat = _c10d.wait_tensor(_c10d.all_reduce(flat, "sum", group))
        out = torch.split(flat, [g.numel() for g in grads])
        return (None,) + tuple(o.view(g.shape) for o, g in zip(out, grads))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return per_rank(grad * ctx.factor), None


def param_local(p: torch.Tensor) -> torch.Tensor:
    """The local shard of parameter or buffer ``p`` (a DTensor)."""
    return p.to_local() if isinstance(p, DTensor) else p


def grad_bucket(grad_groups: tuple[str, ...], *locals_: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Identity on the local shards of parameters replicated along the same mesh axes; in
    backward, their gradients are flattened into one buffer and all-reduced (sum) once per
    process group in ``grad_groups``, as DDP buckets gradients (Li et al., VLDB 2020, §3.2)."""
    return _GradBucketAllReduce.apply(tuple(grad_groups), *locals_)


def returned(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Identity; the gradient that reaches it is divided by ``world_size``."""
    if x.requires_grad and world_size > 1:
        return _ScaleGrad.apply(x, 1.0 / world_size)
    return x
