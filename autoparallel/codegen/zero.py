"""The whole copies that parameters with sharded optimizer states are computed with (ZeRO stages 1, 2).

A parameter the plan names in ``state_placements`` (:mod:`autoparallel.strategies.zero`) is,
on the module, an ``nn.Parameter`` holding the shard the optimizer steps (a DTensor in the
state's placements), and beside it a whole copy (a DTensor in the parameter's placements,
replicated along the state's axes) that the per-device graphs read. The gradient buckets
all-reduce the copy's gradient as any replicated parameter's and hand each device its shard's
piece (:func:`~autoparallel.runtime_kernels.grad_reduction.shard_gradient`). Before each
forward, the shards that changed since they were last gathered (their version counter moved:
an optimizer step, ``load_state_dict``, any in-place write) are all-gathered into their copies,
in buckets per process group and dtype: ZeRO's all-gather of the updated parameters after the
step (Rajbhandari et al., SC 2020, §5.1), run when the next forward needs them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._local_tensor import local_tensor_mode
from torch.distributed.tensor import DTensor

from ..runtime_kernels.grad_reduction import shard_gradient

_c10d = torch.ops._c10d_functional


@dataclass
class ZeroParam:
    """One parameter whose optimizer states are sharded.

    Attributes:
        names: its names on the model (tied names included).
        shard: the ``nn.Parameter`` the optimizer steps (a DTensor in the state's placements).
        whole: the copy the graphs read (a DTensor in the parameter's placements, a leaf that
            requires grad whose gradient the buckets hand to ``shard``).
        dim: the tensor dim the shard is cut along.
        group: the c10d process group the shards are gathered over (one mesh axis, or the world's).
        pieces: the devices of that group.
        version: ``shard._version`` when it was last gathered into ``whole``.
    """

    names: list[str]
    shard: nn.Parameter
    whole: DTensor
    dim: int
    group: str
    pieces: int
    version: int


class ZeroState:
    """The module's :class:`ZeroParam` s and their gathering (module docstring).

    Args:
        params: the parameters, built by :func:`zero_param`.
    """

    def __init__(self, params: list[ZeroParam]):
        self.params = params

    def wholes(self) -> dict[str, DTensor]:
        """Name → the whole copy the graphs read, for every name of every parameter."""
        return {name: p.whole for p in self.params for name in p.names}

    @torch.no_grad()
    def refresh(self) -> None:
        """All-gather every shard that changed into its whole copy, in buckets of at most
        :data:`GATHER_BUCKET_BYTES` of shards per device per process group and dtype, the same
        collectives on every device (each device's shards change together, by the same optimizer
        step). A bucket's two buffers live while it is gathered, before the forward, when the
        step holds least; fresh ones cost no more than kept ones here (the allocator reuses their
        memory), while one flat buffer of every shard took 163 ms against 116 ms in buckets."""
        stale: dict[tuple, list[ZeroParam]] = {}
        for p in self.params:
            if p.shard._version != p.version:
                stale.setdefault((p.group, p.pieces, p.shard.dtype), []).append(p)
        for (group, pieces, dtype), params in stale.items():
            for bucket in _buckets(params, GATHER_BUCKET_BYTES // dtype.itemsize):
                mine = torch.cat([p.shard._local_tensor.reshape(-1) for p in bucket])
                rows = _all_gather(mine, pieces, group).view(pieces, -1)
                offset = 0
                for p in bucket:
                    shape = p.shard._local_tensor.shape
                    places = p.whole._local_tensor.unflatten(p.dim, (pieces, -1)).movedim(p.dim, 0)  # a view
                    places.copy_(rows[:, offset:offset + shape.numel()].view(pieces, *shape))
                    offset += shape.numel()
                    p.version = p.shard._version


GATHER_BUCKET_BYTES = 4 * 2 ** 20
"""Bytes of shards per device that :meth:`ZeroState.refresh` gathers at a time (a parameter
larger than that is a bucket of its own)."""


def _buckets(params: list[ZeroParam], cap: int) -> list[list[ZeroParam]]:
    """``params`` in order, cut into runs of at most ``cap`` shard elements (a larger one alone)."""
    out, size = [[]], 0
    for p in params:
        n = p.shard._local_tensor.numel()
        if out[-1] and size + n > cap:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return out


def _all_gather(mine: torch.Tensor, pieces: int, group: str) -> torch.Tensor:
    """``mine`` of every device of ``group`` (``pieces`` of them), concatenated in the group's
    rank order. On gloo as one broadcast from each device, launched together: gloo's all-gather
    of 16 MiB per device over 4 processes took 157 ms where the four broadcasts took 47 ms
    (docs/design.md, "ZeRO stages 1 and 2 per parameter"); elsewhere (NCCL, simulated ranks) one
    all-gather."""
    if local_tensor_mode() is not None:
        return _c10d.wait_tensor(_c10d.all_gather_into_tensor(mine, pieces, group))
    pg = dist.distributed_c10d._resolve_process_group(group)
    gathered = torch.empty(pieces * mine.numel(), dtype=mine.dtype, device=mine.device)
    if dist.get_backend(pg) != "gloo":
        dist.all_gather_into_tensor(gathered, mine, group=pg)
        return gathered
    parts = gathered.view(pieces, -1)
    parts[dist.get_rank(pg)].copy_(mine)
    works = [dist.broadcast(parts[i], src=src, group=pg, async_op=True)
             for i, src in enumerate(dist.get_process_group_ranks(pg))]
    for w in works:
        w.wait()
    return gathered


def zero_param(names: list[str], shard: nn.Parameter, whole: DTensor, device_mesh, coord: torch.Tensor) -> ZeroParam:
    """The :class:`ZeroParam` of ``shard`` (the optimizer's) and ``whole`` (the graphs'),
    registered with the gradient buckets so that ``shard`` receives its piece of the reduced
    gradient of ``whole``.

    Args:
        coord: this device's mesh coordinate, one int64 per axis (a LocalTensor under
            simulated ranks): where along the gathered axes its shard lies.
    """
    axes = [a for a, (p, q) in enumerate(zip(shard.placements, whole.placements)) if p != q]
    dim = shard.placements[axes[0]].dim
    sizes = [device_mesh.size(a) for a in axes]
    pieces = math.prod(sizes)
    if len(axes) == 1:
        group = device_mesh.get_group(axes[0]).group_name
    else:  # axes spanning the mesh: the world's group, ranks in the mesh's row-major order
        group = dist.group.WORLD.group_name
    index = coord[axes[0]:axes[0] + 1]
    for a, n in zip(axes[1:], sizes[1:]):
        index = index * n + coord[a:a + 1]
    shard_gradient(whole, shard, dim, pieces, index)
    return ZeroParam(names, shard, whole, dim, group, pieces, shard._version)
