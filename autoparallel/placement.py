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

**Splits in units.** A :class:`UnitShard` ``(dim, unit)`` cuts a dim of ``s`` rows as
``torch.chunk`` cuts its ``s / unit`` units, each piece whole units: 25 heads of 8 columns
(``s = 200``) on 2 devices are 13 and 12 heads, 104 and 96 columns, where a plain cut gives
100 and 100. Pieces are ``c = unit · ceil(s / unit / n)`` rows, the last ones shorter. It
is a ``Shard`` for every purpose but the piece sizes (``isinstance(p, Shard)`` holds, and it
equals no plain ``Shard``); only cuts that differ from the even one exist (``s / unit`` not
divided by ``n``; else the spec is the plain ``Shard(dim)``). DTensor cannot hold it: it
places activations, and slices of parameters cut locally, never a stored parameter.
Printed ``S<axes>u<unit>`` (``R R S1u8``), in JSON ``"S<dim>u<unit>"``.
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


class UnitShard(Shard):
    """``Shard(dim)`` cut in whole units of ``unit`` rows (module docstring, "Splits in units").

    Args:
        dim: the tensor dim split.
        unit: rows per unit, an int >= 2 (a unit of 1 is the plain ``Shard(dim)``).

    Raises:
        ValueError: ``unit`` is not an int >= 2.
    """

    def __init__(self, dim: int, unit: int):
        if not isinstance(unit, int) or unit < 2:
            raise ValueError(f"a unit split needs a unit of at least 2 rows, not {unit!r} (use Shard({dim}))")
        super().__init__(dim)
        self.unit = unit

    def __eq__(self, other) -> bool:
        return isinstance(other, UnitShard) and (self.dim, self.unit) == (other.dim, other.unit)

    def __hash__(self) -> int:
        return hash((self.dim, self.unit))

    def __reduce__(self):
        return UnitShard, (self.dim, self.unit)

    def __repr__(self) -> str:
        return f"UnitShard(dim={self.dim}, unit={self.unit})"

    def __str__(self) -> str:
        return f"S({self.dim})u{self.unit}"


def shard(dim: int, unit: int = 1) -> Shard:
    """``Shard(dim)`` for ``unit == 1``, else ``UnitShard(dim, unit)``."""
    return Shard(dim) if unit == 1 else UnitShard(dim, unit)


def unit_of(p: Placement) -> int:
    """Rows per unit of a placement's cut: ``p.unit`` for a :class:`UnitShard`, else 1."""
    return getattr(p, "unit", 1)


def dim_unit(spec: Spec, dim: int) -> int:
    """Rows per unit of the cut of tensor dim ``dim`` under ``spec`` (1 unless a
    :class:`UnitShard` splits it)."""
    return max((unit_of(p) for p in spec if isinstance(p, Shard) and p.dim == dim), default=1)


def piece_length(size: int, pieces: int, unit: int = 1) -> int:
    """Rows of the largest piece of a dim of ``size`` rows cut in ``pieces`` as ``torch.chunk``
    cuts its ``size / unit`` units: ``unit · ceil(size / unit / pieces)``."""
    return unit * -(-(size // unit) // pieces)


def replicated(ndim_mesh: int) -> Spec:
    """The fully replicated spec on a mesh with ``ndim_mesh`` axes."""
    return (R,) * ndim_mesh


def is_replicated(spec: Spec) -> bool:
    """Whether ``spec`` replicates the tensor on every mesh axis (a whole copy per device)."""
    return all(p == R for p in spec)


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
    return tuple(piece_length(s, num_shards(spec, d, mesh_shape), dim_unit(spec, d)) for d, s in enumerate(shape))


def chunk_ok(size: int, pieces: int, unit: int = 1) -> bool:
    """Whether ``torch.chunk`` cuts the ``size / unit`` units of a dim of ``size`` rows into
    ``pieces`` nonempty pieces (always for an even split; never when ``unit`` does not
    divide ``size``)."""
    units = size // unit
    return size % unit == 0 and (units % pieces == 0 or (pieces - 1) * -(-units // pieces) < units)


def uneven_dims(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Tensor dims that ``spec`` splits unevenly, plainly or in units (see above)."""
    return tuple(d for d, s in enumerate(shape) if s % (num_shards(spec, d, mesh_shape) * dim_unit(spec, d)))


def chunk_length(coord, axis: int, size: int, pieces: int, unit: int = 1):
    """Rows of a dim of ``size`` split unevenly in ``pieces`` along mesh ``axis`` (in units
    of ``unit`` rows) that this device holds: ``min(c, size - i·c)`` with ``c =
    piece_length(size, pieces, unit)`` and ``i`` the device's coordinate on ``axis`` (read
    from ``coord``, the int64 ``mesh_coord`` tensor).

    Called by the emitted code. On one process the result is an ``int``; under
    ``LocalTensorMode`` ``coord`` holds one value per simulated rank and the result is a
    ``SymInt`` with one value per rank, which ``narrow`` takes as it is: the code stays the
    same on every rank (docs/design.md, "Rank-dependent code without rank-dependent Python")."""
    c = piece_length(size, pieces, unit)
    return torch.sym_min(c, size - coord.tolist()[axis] * c)


def shard_fraction(spec: Spec, mesh_shape: Sequence[int]) -> int:
    """Product of the sizes of the mesh axes that shard some dim: global/local numel."""
    return math.prod(n for n, p in zip(mesh_shape, spec) if isinstance(p, Shard))


def _unit_suffix(unit: int) -> str:
    return f"u{unit}" if unit > 1 else ""


def spec_str(spec: Spec, ndim: int) -> str:
    """Compact notation, e.g. ``S0 R S1``, ``R S01 P1`` or ``R R S1u8`` (see module docstring)."""
    toks = []
    for d in range(ndim):
        axes = shard_axes(spec, d)
        toks.append("S" + "".join(map(str, axes)) + _unit_suffix(dim_unit(spec, d)) if axes else "R")
    pax = partial_axes(spec)
    if pax:
        toks.append("P" + "".join(map(str, pax)))
    return " ".join(toks) if toks else "R"


def named_placement(p, axis) -> str:
    """One mesh axis' placement with the axis name: ``S<dim>(<axis>)`` (``S<dim>u<unit>(<axis>)``
    for a :class:`UnitShard`), ``P(<axis>)`` or ``R``."""
    if isinstance(p, Shard):
        return f"S{p.dim}{_unit_suffix(unit_of(p))}({axis})"
    if isinstance(p, Partial):
        return f"P({axis})"
    return "R"


def format_spec(spec: Spec, axis_names: Sequence[str]) -> str:
    """The named notation of ``spec``: one item per mesh axis that is not replicated, in
    mesh order, e.g. ``"S0(dp) S1(tp)"``, ``"P(tp)"``; ``"R"`` when replicated everywhere.
    :func:`autoparallel.constraints.parse_spec` reads it back."""
    return " ".join(named_placement(p, a) for p, a in zip(spec, axis_names) if not isinstance(p, Replicate)) or "R"


def spec_to_json(spec: Spec) -> list[str]:
    """JSON form: one string per mesh axis, ``"S<d>"`` (``"S<d>u<unit>"`` for a
    :class:`UnitShard`), ``"R"`` or ``"P"``."""
    out = []
    for p in spec:
        if isinstance(p, Shard):
            out.append(f"S{p.dim}{_unit_suffix(unit_of(p))}")
        elif isinstance(p, Partial):
            out.append("P")
        else:
            out.append("R")
    return out


_SHARD_TOKEN = re.compile(r"S(0|[1-9][0-9]*)(?:u([2-9]|[1-9][0-9]+))?")


def spec_from_json(items: Sequence[str]) -> Spec:
    """Inverse of :func:`spec_to_json`.

    Raises:
        ValueError: when ``items`` is not a list of ``"R"``, ``"P"``, ``"S<d>"`` or
            ``"S<d>u<unit>"`` strings (``d`` a tensor dim, ``unit`` >= 2, written without sign
            or leading zeros).
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
        elif m := _SHARD_TOKEN.fullmatch(s):
            out.append(shard(int(m.group(1)), int(m.group(2) or 1)))
        else:
            raise ValueError(f"bad placement {s!r} in spec {list(items)}: expected 'R', 'P', 'S<d>' or "
                             "'S<d>u<unit>' with d a tensor dim >= 0 and unit >= 2")
    return tuple(out)


def spec_problem(spec: Spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> str | None:
    """Why ``spec`` cannot place a tensor of global ``shape`` on a mesh of ``mesh_shape``, or
    ``None`` when it can: one placement per mesh axis, each ``Shard(d)`` (or
    :class:`UnitShard`) with ``0 <= d < len(shape)``, ``Replicate()`` or ``Partial()``, every
    split dim divided evenly or split unevenly (plainly or in units) by one mesh axis (see
    "Uneven splits" and "Splits in units" above)."""
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
                "layout holds (uneven over several mesh axes, leaving a device empty, or in units that do not "
                "divide the dim or that cut it evenly)")
    return None


def is_valid(spec: Spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """True when every sharded dim is divided evenly by the mesh axes splitting it, or split
    unevenly by a single mesh axis with no device left empty; a dim cut in units (a
    :class:`UnitShard`) must be a whole number of units that the axis does not divide."""
    for d, s in enumerate(shape):
        n = num_shards(spec, d, mesh_shape)
        u = dim_unit(spec, d)
        if u > 1 and (n == 1 or s % u or (s // u) % n == 0):
            return False
        if n > 1 and s % (n * u) and (len(shard_axes(spec, d)) > 1 or not chunk_ok(s, n, u)):
            return False
    return all(not isinstance(p, Shard) or p.dim < len(shape) for p in spec)
