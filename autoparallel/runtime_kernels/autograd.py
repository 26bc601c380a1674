"""Functions the generated code calls besides ATen ops and ``_c10d_functional`` collectives.

:func:`returned` carries the gradient convention of DESIGN §2 to the module's outputs: a
replicated tensor's gradient is held as per-device partial sums (a parameter replicated
along mesh axes gets its gradient all-reduced over them, :mod:`.grad_reduction`), so a
value returned to the user, whose gradient every device seeds in full (DTensor's
convention for a replicated value), has it divided by the number of devices holding it
whole: all of them for a replicated output, those along its replicated mesh axes for one
returned sharded (a shard's gradient is exact).
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


class _ReducedOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, copies):
        import torch.distributed as dist

        ctx.factor = dist.distributed_c10d._resolve_process_group(group).size() / copies
        return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group))

    @staticmethod
    def backward(ctx, grad):
        return per_rank(grad * ctx.factor), None, None


def reduced_output(x: torch.Tensor, group: str, copies: int) -> torch.Tensor:
    """``returned(wait_tensor(all_reduce(x, "sum", group)), copies)`` in one step, for a pending
    sum returned whole over the ``n`` devices of ``group``: the same value, and the same
    gradient without the all-reduce that autograd runs for the conjugate of the forward one.

    The seed of a returned replicated value's gradient is the same on every device (DTensor's
    convention, which :func:`returned` relies on), so that all-reduce of ``grad / copies``
    over ``group`` is ``grad · n / copies`` on every device; computed locally, it saves a
    collective (and a synchronization of the ranks) at the start of every backward.

    Args:
        x: the local summand (contiguous), a ``Partial`` value along ``group``'s mesh axis.
        group: the c10d process-group name of that axis.
        copies: as for :func:`returned`, the devices holding the returned value whole.
    """
    if x.requires_grad:
        return _ReducedOutput.apply(x, group, copies)
    return _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group))


def returned(x: torch.Tensor, copies: int) -> torch.Tensor:
    """Identity; the gradient that reaches it is divided by ``copies``: the product of the
    mesh sizes along the axes where the value is returned replicated (the number of devices
    for a whole tensor; 1 for one sharded along every axis, whose local gradient is exact)."""
    if x.requires_grad and copies > 1:
        return _ScaleGrad.apply(x, 1.0 / copies)
    return x
