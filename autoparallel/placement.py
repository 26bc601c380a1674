"""Sharding specs: one DTensor placement per mesh axis, and their compact notation.

A *spec* is a tuple with one entry per mesh axis, each ``Shard(d)``, ``Replicate()`` or
``Partial()`` from ``torch.distributed.tensor``. When several mesh axes shard the same
tensor dim, the dim is split over them in ascending axis order (DTensor's convention):
on a 2×2 mesh, ``(Shard(0), Shard(0))`` gives rank (i, j) chunk ``2·i + j`` of dim 0.

Printed in the notation of Alpa and Colossal-AI: one token per tensor dim, ``R`` for a
dim that is not split, ``S<axes>`` for a dim split over those mesh axes, then
``P<axes>`` for pending sums: a [4, 8, 16] tensor with spec (Shard(0), Shard(2)) prints
``S0 R S1``; (Shard(1), Shard(1)) prints ``R S01 R``; (Partial(), Replicate()) ``R R R P0``.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

Spec = tuple[Placement, ...]

R = Replicate()
P = Partial()


def replicated(ndim_mesh: int) -> Spec:
    """The fully replicated spec on a mesh with ``ndim_mesh`` axes."""
    return (R,) * ndim_mesh


def shard_axes(spec: Spec, dim: int) -> tuple[int, ...]:
    """Mesh axes (ascending) that split tensor dim ``dim``."""
    return tuple(a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == dim)


def partial_axes(spec: Spec) -> tuple[int, ...]:
    """Mesh axes along which the tensor holds pending sums."""
    return tuple(a for a, p in enumerate(spec) if isinstance(p, Partial))


def num_shards(spec: Spec, dim: int, mesh_shape: Sequence[int]) -> int:
    """How many pieces tensor dim ``dim`` is cut into."""
    return math.prod(mesh_shape[a] for a in shard_axes(spec, dim))


def local_shape(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Per-device shape of a tensor of global ``shape`` under ``spec`` (dims divide evenly)."""
    return _local_shape(tuple(shape), tuple(spec), tuple(mesh_shape))


@functools.lru_cache(maxsize=65536)
def _local_shape(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(s // num_shards(spec, d, mesh_shape) for d, s in enumerate(shape))


def shard_fraction(spec: Spec, mesh_shape: Sequence[int]) -> int:
    """Product of the sizes of the mesh axes that shard some dim: global/local numel."""
    return math.prod(n for n, p in zip(mesh_shape, spec) if isinstance(p, Shard))


def spec_str(spec: Spec, ndim: int) -> str:
    """Compact notation, e.g. ``S0 R S1`` or ``R S01 P1`` (see module docstring)."""
    toks = []
    for d in range(ndim):
        axes = shard_axes(spec, d)
        toks.append("S" + "".join(map(str, axes)) if axes else "R")
    pax = partial_axes(spec)
    if pax:
        toks.append("P" + "".join(map(str, pax)))
    return " ".join(toks) if toks else "R"


def spec_to_json(spec: Spec) -> list[str]:
    """JSON form: one string per mesh axis, ``"S<d>"``, ``"R"`` or ``"P"``."""
    out = []
    for p in spec:
        if isinstance(p, Shard):
            out.append(f"S{p.dim}")
        elif isinstance(p, Partial):
            out.append("P")
        else:
            out.append("R")
    return out


def spec_from_json(items: Sequence[str]) -> Spec:
    """Inverse of :func:`spec_to_json`."""
    out = []
    for s in items:
        if s == "R":
            out.append(R)
        elif s == "P":
            out.append(P)
        elif s.startswith("S"):
            out.append(Shard(int(s[1:])))
        else:
            raise ValueError(f"bad placement {s!r} in spec {list(items)}")
    return tuple(out)


def is_valid(spec: Spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dim is divided evenly by the mesh axes splitting it."""
    for d, s in enumerate(shape):
        n = num_shards(spec, d, mesh_shape)
        if n > 1 and s % n:
            return False
    return all(not isinstance(p, Shard) or p.dim < len(shape) for p in spec)
