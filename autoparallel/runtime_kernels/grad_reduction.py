"""Gradient reduction overlapped with the backward, in buckets, as DDP does it.

The emitted forward reads the parameters replicated along some mesh axes through
:func:`reduce_grads_in_bucket`, one call per bucket (the buckets are chosen at emit time by
:func:`autoparallel.passes.grad_buckets.grad_buckets`). In the backward, autograd calls
the bucket's backward as soon as the last gradient of its parameters exists; it flattens
the bucket's gradients into one buffer and launches an asynchronous all-reduce (sum) over
the first mesh axis' process group (over the world's, when the bucket's axes together span
it: a data-parallel bucket on a 2-D mesh), then returns without waiting, so the backward of
the earlier layers runs while the bucket is in flight. One callback per bucket, queued on the
autograd engine, runs when the whole backward has finished: it waits for the all-reduce,
all-reduces over any further mesh axes, and adds each parameter's piece into its ``.grad``
(a DTensor with the parameter's placements). This is the reducer of Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, §3.2-3.3
(buckets in reverse order of the forward, launched when ready, waited at the end of the
backward by a callback of the autograd engine).

The gradient convention of DESIGN §2 holds: the gradient each device computes for a
replicated parameter is its partial sum, and the all-reduce makes it the full gradient.

Each bucket keeps its flat buffer from one backward to the next, as DDP's reducer keeps its
buckets, and the all-reduce runs in place in it: a fresh buffer of the size of every
gradient costs its page faults on every step (on CPU a 15 MiB flat buffer took 8 ms to fill
when freshly allocated, 1.6 ms when reused: GPT-2 4 x 256), and the out-of-place functional
all-reduce a second copy. The parameters' ``.grad`` are views into the buffer (DDP's
``gradient_as_bucket_view``); the buffer is reused only when nothing else holds its storage
(no ``.grad`` of the last step left, no view of it kept by the caller), else that backward
reduces in a fresh buffer, so a gradient the caller keeps is never overwritten.

A backward run within ``gradient_sync(AFTER_STEP)`` (a zero-bubble pipeline schedule's, which
computes the parameters' gradients apart from the inputs' with ``torch.autograd.grad`` on the
parameters: torch's ``stage_backward_weight``) hands the unreduced gradients to autograd, which
accumulates them into ``.grad``, and :func:`reduce_after_step` all-reduces them once the
schedule's step is over: exact, the reduction being linear, but not overlapped with the
backward.

A sum returned whole (a loss: each device's summand all-reduced) is waited as late: see
:func:`deferred_reduced_output`.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed._local_tensor import local_tensor_mode
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from .autograd import local_piece, per_rank, reduced_output

_c10d = torch.ops._c10d_functional


def _add_grad(p: torch.Tensor, local_grad: torch.Tensor) -> None:
    """``p.grad += local_grad`` for parameter ``p`` (a DTensor or a plain tensor), creating
    the gradient with ``p``'s placements when there is none."""
    if not isinstance(p, DTensor):
        p.grad = local_grad if p.grad is None else p.grad + local_grad
        return
    if p.grad is None and local_grad.dtype == p.dtype:  # the parameter's spec: no autograd, 6 us instead of 45
        p.grad = DTensor(local_grad, p._spec, requires_grad=False)
    elif p.grad is None:
        p.grad = _as_grad_of(p, local_grad)
    else:
        p.grad._local_tensor.add_(local_grad)


_SHARD_OF = WeakIdKeyDictionary()  # whole copy of a ZeRO parameter -> (its shard, dim, pieces, coordinate)


def shard_gradient(whole: torch.Tensor, shard: torch.Tensor, dim: int, pieces: int, coord: torch.Tensor) -> None:
    """Hand the reduced gradient of ``whole`` (a parameter's whole copy, read by the graphs
    through the buckets) to ``shard`` (the parameter the optimizer steps, ZeRO stage 1:
    :mod:`autoparallel.codegen.zero`): this device's piece of it, piece ``coord`` (a 1-element
    int64 tensor) of ``pieces`` along ``dim``, is added into ``shard.grad``."""
    _SHARD_OF[whole] = (shard, dim, pieces, coord)


def _add_reduced(p: torch.Tensor, grad: torch.Tensor) -> None:
    """``_add_grad`` of a reduced gradient: for a ZeRO parameter's whole copy, its shard's
    piece into the shard (:func:`shard_gradient`)."""
    target = _SHARD_OF.get(p)
    if target is None:
        _add_grad(p, grad)
        return
    shard, dim, pieces, coord = target
    _add_grad(shard, local_piece(grad, dim, pieces, coord))


AFTER_STEP = "after_step"
""":func:`gradient_sync`'s mode that leaves the reduction to :func:`reduce_after_step`."""

_SYNC: list[bool | str | None] = [True]  # whether the forward (or backward) now running reduces its gradients
_UNSYNCED = WeakIdKeyDictionary()  # parameter -> True while its .grad holds an unreduced partial sum
_AFTER_STEP: dict[int, tuple] = {}  # id of a bucket's first parameter -> (groups, reduce dtype, parameters)


@contextlib.contextmanager
def gradient_sync(enabled: bool | str | None):
    """Within: the buckets of the forward that runs reduce their gradients (``enabled``) or
    accumulate them unreduced into ``.grad`` (DDP's ``no_sync``); a later reducing backward
    adds the accumulated partial sums into its all-reduce. ``None``: the backward decides,
    by the ``gradient_sync`` it runs within (reducing outside any): a pipeline schedule knows
    which backward of a stage is its last, not which forward's backward runs last.
    :data:`AFTER_STEP` (in a backward): the unreduced gradients go to autograd as the
    parameters' gradients, reduced by :func:`reduce_after_step`."""
    _SYNC.append(enabled)
    try:
        yield
    finally:
        _SYNC.pop()


def _accumulated(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` plus the unreduced partial sum ``p.grad`` holds from backwards run under
    ``no_sync`` (then cleared: the reduced sum replaces it)."""
    if _UNSYNCED.pop(p, None) is None or p.grad is None:
        return grad
    local = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
    p.grad = None
    return grad + local


class _BucketReduction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, groups, reduce_dtype, scatter, *params):
        ctx.groups, ctx.reduce_dtype, ctx.scatter, ctx.sync = groups, reduce_dtype, scatter, _SYNC[-1]
        ctx.params = params
        return tuple(p.to_local() if isinstance(p, DTensor) else p.detach() for p in params)

    @staticmethod
    def backward(ctx, *grads):
        params, none = ctx.params, (None, None, None)
        sync = ctx.sync if ctx.sync is not None else _SYNC[-1]  # None in the forward: the backward's choice
        if sync == AFTER_STEP:
            _AFTER_STEP[id(params[0])] = (ctx.groups, ctx.reduce_dtype, params)
            return (*none, *(_as_grad_of(p, g) for p, g in zip(params, grads)))
        if sync is False:  # no_sync: this device's partial sums, reduced by a later backward
            for p, g in zip(params, grads):
                _add_grad(p, g)
                _UNSYNCED[p] = True
            return (*none, *(None,) * len(params))
        if _UNSYNCED:
            grads = tuple(_accumulated(p, g) for p, g in zip(params, grads))
        world = _world_group(ctx.groups)
        first, rest = (world, ()) if world is not None else (ctx.groups[0], ctx.groups[1:])
        if ctx.scatter:
            _reduce_scatter_onto_shards(params, grads, first, ctx.reduce_dtype)
            return (*none, *(None,) * len(params))
        grad_dtype = grads[0].dtype
        same_dtype = ctx.reduce_dtype in (None, grad_dtype)
        flat = torch.cat([g.reshape(-1) for g in grads], out=_reusable_buffer(params, grads) if same_dtype else None)
        flat = per_rank(flat if same_dtype else flat.to(ctx.reduce_dtype))  # ours alone: reduced in place
        pending = _c10d.all_reduce_(flat, "sum", first)  # launched; waited by finish()
        shapes = [g.shape for g in grads]

        def finish():
            out = _c10d.wait_tensor(pending)
            for group in rest:
                out = _c10d.wait_tensor(_c10d.all_reduce(out, "sum", group))
            out = out.to(grad_dtype)
            for p, piece, shape in zip(params, torch.split(out, [s.numel() for s in shapes]), shapes):
                _add_reduced(p, piece.view(shape))

        torch.autograd.Variable._execution_engine.queue_callback(finish)
        return (*none, *(None,) * len(params))


def _reduce_scatter_onto_shards(params, grads, group: str, reduce_dtype) -> None:
    """ZeRO stage 2: the gradients of whole copies ``params`` reduce-scattered over ``group`` (the
    process group their shards are cut over, :func:`shard_gradient`) as one flat buffer laid out
    device by device (every parameter's piece for device 0, then for device 1, ...), launched now
    and waited when the backward ends, each device's piece added into its shard's ``.grad``."""
    shards = [_SHARD_OF[p] for p in params]
    pieces = shards[0][2]
    grad_dtype = grads[0].dtype
    flat = torch.cat([g.unflatten(dim, (pieces, -1)).select(dim, r).reshape(-1)
                      for r in range(pieces) for g, (_, dim, _, _) in zip(grads, shards)])
    flat = per_rank(flat if reduce_dtype in (None, grad_dtype) else flat.to(reduce_dtype))
    pending = _c10d.reduce_scatter_tensor(flat, "sum", pieces, group)  # launched; waited by finish()
    sizes = [g.numel() // pieces for g in grads]  # not the gradients: freed once the backward returns

    def finish():
        out = _c10d.wait_tensor(pending).to(grad_dtype)
        for (shard, _, _, _), piece in zip(shards, torch.split(out, sizes)):
            _add_grad(shard, piece.view(shard._local_tensor.shape))

    torch.autograd.Variable._execution_engine.queue_callback(finish)


def _as_grad_of(p: torch.Tensor, local_grad: torch.Tensor) -> torch.Tensor:
    """``local_grad`` as autograd takes a gradient of parameter ``p``: a DTensor of ``p``'s
    placements (unreduced: :func:`reduce_after_step` sums it) when ``p`` is one."""
    if not isinstance(p, DTensor):
        return local_grad
    return DTensor.from_local(local_grad, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def reduce_after_step() -> None:
    """All-reduce (sum) the gradients that backwards within ``gradient_sync(AFTER_STEP)`` left
    unreduced in ``.grad``: per bucket, one flat buffer over the bucket's mesh axes (in its
    reduce dtype), written back into each parameter's ``.grad`` (a zero gradient for a
    parameter that got none, so that every device of the bucket's axes joins the same
    collectives)."""
    buckets = list(_AFTER_STEP.values())
    _AFTER_STEP.clear()
    for groups, reduce_dtype, params in buckets:
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        locals_ = [p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad for p in params]
        flat = torch.cat([g.reshape(-1) for g in locals_])
        flat = flat if reduce_dtype in (None, flat.dtype) else flat.to(reduce_dtype)
        out = _c10d.wait_tensor(sum_over_axes(flat, groups)).to(locals_[0].dtype)
        for g, piece in zip(locals_, torch.split(out, [g.numel() for g in locals_])):
            g.copy_(piece.view(g.shape))


def _world_group(groups: tuple[str, ...]) -> str | None:
    """The world's process group when ``groups`` (lines through this rank along distinct axes
    of one mesh) together span it, their sizes multiplying to the world size: one all-reduce
    over it sums what an all-reduce per axis would, moving ``2(N−1)/N`` of the buffer per
    device instead of ``Σ_a 2(n_a−1)/n_a`` (Thakur et al. 2005: 1.5 instead of 2 buffers
    on a 2 x 2 mesh), with one latency, and all of it overlapped with the backward. ``None``
    for a single axis or axes that do not span the world."""
    if len(groups) < 2:
        return None
    size = math.prod(dist.distributed_c10d._resolve_process_group(g).size() for g in groups)
    return dist.group.WORLD.group_name if size == dist.get_world_size() else None


_BUFFERS = WeakIdKeyDictionary()  # a bucket's first parameter -> its flat buffer


def _reusable_buffer(params, grads) -> torch.Tensor | None:
    """The flat buffer this bucket reduced in last time, when nothing else holds its storage
    any more (the ``.grad`` views of the last step were dropped, e.g. by
    ``zero_grad(set_to_none=True)``, and the caller kept no view of them); a new one, kept
    for the next step, on the first backward; ``None`` (reduce in a fresh buffer) when it
    is still held, under simulated ranks, or when this torch cannot count storage users."""
    if local_tensor_mode() is not None or not hasattr(torch._C, "_storage_Use_Count"):
        return None
    numel, like = sum(g.numel() for g in grads), grads[0]
    buf = _BUFFERS.get(params[0])
    if buf is None or buf.numel() != numel or buf.dtype != like.dtype or buf.device != like.device:
        buf = _BUFFERS[params[0]] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf
    # users of the storage: this tensor and the temporary storage object, or more when held
    return buf if torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2 else None


def reduce_grads_in_bucket(groups: tuple[str, ...], *params: torch.Tensor,
                           reduce_dtype: torch.dtype | None = None, scatter: bool = False) -> tuple[torch.Tensor, ...]:
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
        scatter: the parameters are whole copies of ZeRO-2 parameters (:func:`shard_gradient`):
            their gradients are reduce-scattered over ``groups`` (one group, or axes spanning
            the world) onto the shards instead (:func:`_reduce_scatter_onto_shards`).

    Returns:
        one local tensor per parameter, an autograd leaf of this bucket.
    """
    return _BucketReduction.apply(tuple(groups), reduce_dtype, scatter, *params)


def sum_over_axes(x: torch.Tensor, groups: tuple[str, ...]) -> torch.Tensor:
    """``x`` all-reduced (sum) over the mesh axes whose process groups are ``groups``: the sum
    that one all-reduce per axis in turn gives, as one all-reduce over the world's group when
    the axes span it (:func:`_world_group`: one latency and one synchronization of the ranks
    instead of one per axis). Returns the launched collective's output, which
    ``_c10d_functional.wait_tensor`` waits for like any functional collective's; when the
    axes do not span the world, the all-reduces over all but the last axis are waited here.
    Differentiable (autograd's conjugate of each all-reduce: the gradient all-reduced over
    the same group).

    Args:
        x: the local summand, contiguous.
        groups: c10d process-group names, one per mesh axis, at least one.
    """
    groups = tuple(groups)
    world = _world_group(groups)
    if world is not None:
        return _c10d.all_reduce(x, "sum", world)
    for group in groups[:-1]:
        x = _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group))
    return _c10d.all_reduce(x, "sum", groups[-1])


_aten = torch.ops.aten
_READS_NO_VALUE = {_aten.ones_like.default, _aten.zeros_like.default, _aten.empty_like.default}
_IN_FLIGHT: list[torch.Tensor] = []  # sums launched by deferred_reduced_output and maybe not waited yet


class PendingSum(torch.Tensor):
    """A tensor returned whole whose all-reduce (sum) may still be in flight: any op reading
    it waits for the all-reduce first and runs on the plain result (which it returns), so
    every value read is the reduced one; only ``ones_like``, ``zeros_like`` and
    ``empty_like``, which read no value (the seed ``loss.backward()`` makes), run without
    waiting. Shape, dtype, device, ``requires_grad`` and ``grad_fn`` are those of the sum;
    printing, formatting (``f"{loss:.4f}"``), ``tolist()`` and pickling (``torch.save``) see the
    reduced value as a plain tensor.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl  # results are plain tensors

    @staticmethod
    def __new__(cls, pending: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, pending.shape, strides=pending.stride(), dtype=pending.dtype,
                                                device=pending.device, requires_grad=False)
        t._pending = pending
        return t

    def wait(self) -> torch.Tensor:
        """The reduced value, a plain tensor (waits for the all-reduce the first time)."""
        return _c10d.wait_tensor(self._pending)

    def __repr__(self, *, tensor_contents=None):
        return repr(self.wait())

    # Tensor's own versions of these serve plain tensors only (or refuse subclasses)
    def __format__(self, format_spec: str) -> str:
        return self.wait().__format__(format_spec)

    def tolist(self):
        return self.wait().tolist()

    def __reduce_ex__(self, protocol):
        return self.wait().__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _READS_NO_VALUE:
            return func(args[0]._pending, *args[1:], **kwargs)
        args, kwargs = pytree.tree_map_only(PendingSum, PendingSum.wait, (args, kwargs))
        return func(*args, **kwargs)


def _wait_in_flight() -> None:
    while _IN_FLIGHT:
        _c10d.wait_tensor(_IN_FLIGHT.pop())


class _DeferredSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, groups, copies):
        _wait_in_flight()  # the last step's sum, if nobody read it: at most one in flight
        world = _world_group(groups)
        first, rest = (world, ()) if world is not None else (groups[-1], groups[:-1])
        for group in rest:  # axes that do not span the world together: reduced at once
            x = _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group))
        sizes = [dist.distributed_c10d._resolve_process_group(g).size() for g in groups]
        ctx.factor = math.prod(sizes) / copies
        ctx.pending = _c10d.all_reduce(x, "sum", first)
        _IN_FLIGHT.append(ctx.pending)
        return PendingSum(ctx.pending)

    @staticmethod
    def backward(ctx, grad):
        pending = ctx.pending  # the step's collectives complete before backward() returns
        torch.autograd.Variable._execution_engine.queue_callback(lambda: _c10d.wait_tensor(pending))
        return per_rank(grad * ctx.factor), None, None


def deferred_reduced_output(x: torch.Tensor, groups: tuple[str, ...], copies: int) -> torch.Tensor:
    """A pending sum returned whole: ``x`` (this device's summand, e.g. of a loss)
    all-reduced (sum) over ``groups`` (one all-reduce over the world's group when they
    span it, as for gradient buckets), returned as a :class:`PendingSum` that waits for the
    all-reduce when something reads its value, or when the backward ends, whichever comes
    first, instead of waiting in the forward.

    The wait of a collective holds every rank until the slowest has reached it; a loss
    all-reduced and waited at the end of the forward adds such a synchronization to every
    step that DDP, whose forward has none, does not have (GPT-2, 4 gloo processes on 2
    cores: forward 108.6 ms of wall time per rank with the wait, 87.0 without it, DDP's 85.2;
    docs/design.md, "Forward and backward as fast as DDP's"). The backward needs no reduced value: the seed of a value
    returned replicated is the same on every device (DTensor's convention, which
    :func:`~autoparallel.runtime_kernels.returned` relies on), so the all-reduce of
    ``seed / copies`` over the groups that autograd would run as the conjugate of each
    forward all-reduce is ``seed · N / copies`` (``N`` the devices of ``groups``), computed
    locally.

    Without autograd (no grad needed) and under simulated ranks (LocalTensorMode) the sum
    is waited at once and returned as a plain tensor.

    Args:
        x: the local summand (contiguous), a ``Partial`` value along the mesh axes of ``groups``.
        groups: c10d process-group names of those axes, in the order the plan reduces them.
        copies: as for :func:`~autoparallel.runtime_kernels.returned`, the devices holding
            the returned value whole.

    Returns:
        the sum, the same on every device: a :class:`PendingSum` when ``x`` requires grad.
    """
    groups = tuple(groups)
    if x.requires_grad and local_tensor_mode() is None:
        return _DeferredSum.apply(x, groups, copies)
    for group in groups[:-1]:
        x = _c10d.wait_tensor(_c10d.all_reduce(x, "sum", group))
    return reduced_output(x, groups[-1], copies)
