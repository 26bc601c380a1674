"""Functions the generated code calls besides ATen ops and ``_c10d_functional`` collectives.

Both are autograd identities in the forward; their backward carries the gradient
convention of DESIGN §2: a replicated tensor's gradient is held as per-device partial
sums, so a parameter replicated along mesh axes gets its gradient all-reduced over them
(:func:`param_local`), and a value returned to the user, whose gradient every device
seeds in full, has it divided by the number of devices (:func:`returned`).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

_c10d = torch.ops._c10d_functional


class _GradAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        for g in ctx.groups:
            grad = _c10d.wait_tensor(_c10d.all_reduce(grad.contiguous(), "sum", g))
        return grad, None


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


def param_local(p: torch.Tensor, grad_groups: tuple[str, ...]) -> torch.Tensor:
    """The local shard of parameter ``p`` (a DTensor); in backward, all-reduce (sum) the
    gradient over the process groups of the mesh axes along which ``p`` is replicated."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if grad_groups and local.requires_grad:
        return _GradAllReduce.apply(local, tuple(grad_groups))
    return local


def returned(x: torch.Tensor, world_size: int) -> torch.Tensor:
    """Identity; the gradient that reaches it is divided by ``world_size``."""
    if x.requires_grad and world_size > 1:
        return _ScaleGrad.apply(x, 1.0 / world_size)
    return x
