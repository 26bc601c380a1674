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


def onto_device(shard: torch.Tensor, device: str) -> torch.Tensor:
    """A host-offloaded parameter's local ``shard`` copied to ``device`` (the device type the
    module runs on; its current device). The copy's backward moves the gradient back to the
    host, where the optimizer steps the parameter (:mod:`autoparallel.strategies.offload`).
    On a CPU the shard is already where it is used and is returned as is."""
    return shard.to(device, non_blocking=True)


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


class _LocalPiece(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, pieces, coord):
        ctx.shape, ctx.dim, ctx.pieces = x.shape, dim, pieces
        ctx.save_for_backward(coord)
        return x.unflatten(dim, (pieces, -1)).index_select(dim, coord).squeeze(dim)

    @staticmethod
    def backward(ctx, grad):
        (coord,) = ctx.saved_tensors
        whole = grad.new_zeros(ctx.shape)
        whole.unflatten(ctx.dim, (ctx.pieces, -1)).index_copy_(ctx.dim, coord, grad.unsqueeze(ctx.dim))
        return whole, None, None, None


def local_piece(x: torch.Tensor, dim: int, pieces: int, coord: torch.Tensor) -> torch.Tensor:
    """This device's piece of ``x`` cut in ``pieces`` equal pieces along ``dim``: piece
    ``coord`` (a 1-element int64 tensor, the device's coordinate on the mesh axis that cuts),
    a copy, as ``index_select`` makes it; no host synchronization reads the coordinate.

    Its backward writes the gradient into one zero tensor of ``x``'s shape, in place, always.
    Autograd's own backward of ``index_select`` does that only for plain tensors with no
    Python dispatch mode active; under ``MemTracker`` (a ``TorchDispatchMode``) or simulated
    ranks (``LocalTensor``) it takes the out-of-place ``index_add``, a second buffer of
    ``x``'s size live at once, which the memory model does not count because a real run
    never allocates it (docs/design.md, "The memory model at real sequence lengths")."""
    return _LocalPiece.apply(x, dim, pieces, coord)


class _ParamAllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard, steps, dtype, reduce_dtype):
        ctx.steps, ctx.reduce_dtype, ctx.shard_dtype = steps, reduce_dtype, shard.dtype
        x = per_rank(shard.to(dtype) if dtype is not None else shard)
        ctx.lengths = []
        for group, n, d, rows, total in steps:
            ctx.lengths.append(x.size(d))
            if total != n * rows:  # uneven: every piece padded to ``rows`` rows, the pads dropped after
                x = torch.constant_pad_nd(x, [0, 0] * (x.dim() - 1 - d) + [0, rows - x.size(d)])
            x = _gather(x.contiguous(), n, d, group)
            if total != n * rows:
                x = x.narrow(d, 0, total).clone(memory_format=torch.contiguous_format)
        return x

    @staticmethod
    def backward(ctx, grad):
        g = per_rank(grad.to(ctx.reduce_dtype))
        for (group, n, d, rows, total), length in zip(reversed(ctx.steps), reversed(ctx.lengths)):
            if total != n * rows:
                g = torch.constant_pad_nd(g, [0, 0] * (g.dim() - 1 - d) + [0, n * rows - total])
            g = _reduce_scatter(g, n, d, group)
            if total != n * rows:
                g = g.narrow(d, 0, length).clone(memory_format=torch.contiguous_format)
        return g.to(ctx.shard_dtype), None, None, None


def _gather(x: torch.Tensor, n: int, d: int, group: str) -> torch.Tensor:
    """``x`` (contiguous) all-gathered along dim ``d`` over the ``n`` devices of ``group``."""
    y = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, n, group))
    if d == 0:
        return y
    return y.unflatten(0, (n, x.size(0))).movedim(0, d).flatten(d, d + 1)


def _reduce_scatter(g: torch.Tensor, n: int, d: int, group: str) -> torch.Tensor:
    """The conjugate of :func:`_gather`: ``g``'s ``n`` pieces along dim ``d`` summed over
    ``group``, this device's piece kept."""
    if d:
        g = g.unflatten(d, (n, g.size(d) // n)).movedim(d, 0).flatten(0, 1)
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(g.contiguous(), "sum", n, group))


def param_all_gather(shard: torch.Tensor, steps: list[tuple[str, int, int, int, int]], *,
                     dtype: torch.dtype | None, reduce_dtype: torch.dtype) -> torch.Tensor:
    """A parameter's local shard cast to ``dtype`` and all-gathered, whose gradient is
    reduce-scattered in ``reduce_dtype``: FSDP2's mixed-precision gather (a parameter kept
    sharded in fp32, gathered in ``param_dtype``, its gradient reduce-scattered in the
    policy's ``reduce_dtype``; Zhao et al., "PyTorch FSDP", VLDB 2023, §4.2 and torch's
    ``MixedPrecisionPolicy``). Autograd's own conjugate of a bf16 all-gather would
    reduce-scatter in bf16.

    Forward: ``shard.to(dtype)``, then one all-gather per step, in order. Backward: the
    gathered gradient cast to ``reduce_dtype``, one reduce-scatter per step in reverse order
    (sums in ``reduce_dtype``), cast to ``shard``'s dtype. Given the fp32 shard itself (the
    emitter's choice), the reduced fp32 sum is the shard's gradient as it is; given a
    half-precision view of the cast shard, autograd would round that sum to its dtype.

    Args:
        shard: this device's shard, of any layout; under ``LocalTensorMode`` a ``LocalTensor``
            (one shard per simulated rank; their sizes differ along an uneven dim).
        steps: one ``(group, n, dim, rows, total)`` per all-gather: the c10d process-group
            name of the mesh axis, its ``n`` devices, the tensor dim gathered, the rows of
            that dim in each device's piece and in the result. ``total < n · rows``: an
            uneven split (:mod:`autoparallel.placement`, "Uneven splits"), each piece padded
            with zeros to ``rows`` rows before the gather and the result narrowed to
            ``total``; the gradient is padded back, reduce-scattered and narrowed to this
            device's rows, so the pads carry no gradient.
        dtype: the dtype the shard is cast to before the gathers (the policy's
            ``param_dtype``); ``None``: gathered in its own.
        reduce_dtype: the dtype the gradient's reduce-scatters run in.

    Returns:
        the gathered tensor in ``dtype``, contiguous, with ``total`` rows along each gathered dim.

    Raises:
        RuntimeError: from c10d, when a group name is unknown or the shards' sizes do not
            match ``steps`` (a collective of unequal pieces).
    """
    return _ParamAllGather.apply(shard, tuple(steps), dtype, reduce_dtype)


class _InputFullGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        world = dist.distributed_c10d._get_default_group().group_name
        return _c10d.wait_tensor(_c10d.all_reduce(per_rank(grad).contiguous(), "sum", world))


def input_with_full_grad(x: torch.Tensor) -> torch.Tensor:
    """Identity on an input the caller passes whole on every device; in the backward, its
    gradient is all-reduced (sum) over the world, so the caller receives the single-device
    gradient: the graph reads the input replicated, and by the gradient convention (DESIGN §2)
    each device holds a partial sum of a replicated value's gradient (a device that read its
    rows only holds theirs)."""
    return _InputFullGrad.apply(x)


class _GatheredBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        import torch.distributed as dist

        group = dist.distributed_c10d._get_default_group()
        ctx.group = group.group_name
        ctx.world = group.size()
        gathered = _c10d.all_gather_into_tensor(per_rank(x).contiguous(), ctx.world, ctx.group)
        return _c10d.wait_tensor(gathered)

    @staticmethod
    def backward(ctx, grad):
        # every rank computed the same function of the global batch, so every rank holds the
        # same gradient: the reduce-scatter's sum over ranks, divided by their number, is this
        # rank's rows of it (a slice that is per rank under simulated ranks too)
        rows = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(per_rank(grad).contiguous(), "sum", ctx.world, ctx.group))
        return rows / ctx.world


def gathered_batch(x: torch.Tensor) -> torch.Tensor:
    """This rank's batch ``x`` (``[b, ...]``) → the global batch ``[world · b, ...]``: every
    rank's concatenated along dim 0 in rank order (``inputs="local"``), on every rank. For a
    forward every rank then runs whole (the eager path): its gradient, the same on every rank,
    comes back as this rank's rows."""
    if x.dim() == 0:
        return x
    return _GatheredBatch.apply(x)
