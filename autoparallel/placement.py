"""Sharding specs: one DTensor placement per mesh axis, and their compact notation.

A *spec* is a tuple with one entry per mesh axis, each ``Shard(d)``, ``Replicate()`` or
``Partial()`` from ``torch.distributed.tensor``. When several mesh axes shard the same
tensor dim, the dim is split over them in ascending axis order (DTensor's convention):
on a 2×2 mesh, ``(Shard(0), Shard(0))`` gives rank (i, j) chunk ``2·i + j`` of dim 0.

Printed in the notation of Alpa and Colossal-AI: one token per tensor dim, ``R`` for a
dim that is not split, ``S<axes>`` for a dim split over those mesh axes, then
``P<axes>`` for pending sums: a [4, 8, 16] tensor with spec (Shard(0), Shard(2)) prints
``S0 R S1``; (Shard(1), Shard(1)) prints ``R S01 R``; (Partial(), Replicate()) ``R R R P0``.

**Uneven splits.** A dim of size ``s`` that a mesh axis of ``n`` devices does not divide may
be split by that one axis alone, as ``torch.chunk`` (and DTensor's ``Shard``) cut it: device
``i`` holds rows ``[i·c, min((i+1)·c, s))`` with ``c = ceil(s / n)``, so the first devices hold
``c`` rows and the last ones fewer. Only splits that leave every device at least one row are
valid (``(n-1)·c < s``: 50257 over 4 is 12565, 12565, 12565, 12562; 5 over 4 is refused, its
last device would hold nothing). A dim split over several mesh axes must be divided evenly.
:func:`local_shape` gives the largest shard (``c``): what costs and memory are priced by.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Sequence

import torch
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
    """Per-device shape of a tensor of global ``shape`` under ``spec``: the largest shard,
    ``ceil(s / n)`` along a dim of size ``s`` split in ``n`` pieces (exact for even splits)."""
    return _local_shape(tuple(shape), tuple(spec), tuple(mesh_shape))


@functools.lru_cache(maxsize=65536)
def _local_shape(shape: tuple[int, ...], spec: Spec, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-s // num_shards(spec, d, mesh_shape)) for d, s in enumerate(shape))


def chunk_ok(size: int, pieces: int) -> bool:
    """Whether ``torch.chunk`` cuts a dim of ``size`` into ``pieces`` nonempty pieces (always
    for an even split)."""
    return size % pieces == 0 or (pieces - 1) * -(-size // pieces) < size


def uneven_dims(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Tensor dims that ``spec`` splits unevenly (see "Uneven splits" above)."""
    return tuple(d for d, s in enumerate(shape) if s % num_shards(spec, d, mesh_shape))


def chunk_length(coord, axis: int, size: int, pieces: int):
    """Rows of a dim of ``size`` split unevenly in ``pieces`` along mesh ``axis`` that this
    device holds: ``min(c, size - i·c)`` with ``c = ceil(size / pieces)`` and ``i`` the
    device's coordinate on ``axis`` (read from ``coord``, the int64 ``mesh_coord`` tensor).

    Called by the emitted code. On one process the result is an ``int``; under
    ``LocalTensorMode`` ``coord`` holds one value per simulated rank and the result is a
    ``SymInt`` with one value per rank, which ``narrow`` takes as it is: the code stays the
    same on every rank (docs/design.md, "Rank-dependent code without rank-dependent Python")."""
    c = -(-size // pieces)
    return torch.sym_min(c, size - coord.tolist()[axis] * c)


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


def named_placement(p, axis) -> str:
    """One mesh axis' placement with the axis name: ``S<dim>(<axis>)``, ``P(<axis>)`` or ``R``."""
    if isinstance(p, Shard):
        return f"S{p.dim}({axis})"
    if isinstance(p, Partial):
        return f"P({axis})"
    return "R"


def format_spec(spec: Spec, axis_names: Sequence[str]) -> str:
    """The named notation of ``spec``: one item per mesh axis that is not replicated, in
    mesh order, e.g. ``"S0(dp) S1(tp)"``, ``"P(tp)"``; ``"R"`` when replicated everywhere.
    :func:`autoparallel.constraints.parse_spec` reads it back."""
    return " ".join(named_placement(p, a) for p, a in zip(spec, axis_names) if not isinstance(p, Replicate)) or "R"


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


_SHARD_TOKEN = re.compile(r"S(0|[1-9][0-9]*)")


def spec_from_json(items: Sequence[str]) -> Spec:
    """Inverse of :func:`spec_to_json`.

    Raises:
        ValueError: when ``items`` is not a list of ``"R"``, ``"P"`` or ``"S<d>"`` strings
            (``d`` a tensor dim, written without sign or leading zeros).
    """
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"a spec must be a list of placements such as ['S0', 'R'], not {items!r}")
    if not all(isinstance(s, str) for s in items):
        bad = next(s for s in items if not isinstance(s, str))
        raise ValueError(f"bad placement {bad!r} in spec {list(items)}: expected 'R', 'P' or 'S<d>' "
                         "with d a tensor dim >= 0")
    return _parse_spec(tuple(items))


@functools.lru_cache(maxsize=4096)
def _parse_spec(items: tuple[str, ...]) -> Spec:
    out = []
    for s in items:
        if s == "R":
            out.append(R)
        elif s == "P":
            out.append(P)
        elif _SHARD_TOKEN.fullmatch(s):
            out.append(Shard(int(s[1:])))
        else:
            raise ValueError(f"bad placement {s!r} in spec {list(items)}: expected 'R', 'P' or 'S<d>' "
                             "with d a tensor dim >= 0")
    return tuple(out)


def spec_problem(spec: Spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> str | None:
    """Why ``spec`` cannot place a tensor of global ``shape`` on a mesh of ``mesh_shape``, or
    ``None`` when it can: one placement per mesh axis, each ``Shard(d)`` with ``0 <= d <
    len(shape)``, ``Replicate()`` or ``Partial()``, every split dim divided evenly or split
    unevenly by one mesh axis (see "Uneven splits" above)."""
    if len(spec) != len(mesh_shape):
        return f"has {len(spec)} placements for a {len(mesh_shape)}-axis mesh"
    for a, p in enumerate(spec):
        if isinstance(p, Shard):
            if not 0 <= p.dim < len(shape):
                return f"splits dim {p.dim} of a {len(shape)}-dim tensor (mesh axis {a})"
        elif not isinstance(p, (Replicate, Partial)):
            return f"has {p!r} on mesh axis {a}, not Shard, Replicate or Partial"
    if not is_valid(spec, shape, mesh_shape):
        return (f"splits a dim of shape {tuple(shape)} over mesh {tuple(mesh_shape)} in a way no device "
                "layout holds (uneven over several mesh axes, or leaving a device empty)")
    return None


def is_valid(spec: Spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dim is divided evenly by the mesh axes splitting it, or split
    unevenly by a single mesh axis with no device left empty."""
    for d, s in enumerate(shape):
        n = num_shards(spec, d, mesh_shape)
        if n > 1 and s % n and (len(shard_axes(spec, d)) > 1 or not chunk_ok(s, n)):
            return False
    return all(not isinstance(p, Shard) or p.dim < len(shape) for p in spec)
