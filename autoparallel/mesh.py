"""MeshSpec: the logical device mesh the planner reasons about.

The alpha-beta model prices a collective over mesh axis ``a`` of ``n`` devices moving
``B`` bytes as ``alpha[a] + f(n) · B · beta[a]`` (Hockney's model; the per-collective
factors are in :mod:`autoparallel.solver.costs`). Defaults describe devices linked by
NVLink-class interconnect: latency 5 µs and 100 GB/s of bus bandwidth per axis
(beta = 1e-11 s/byte). Pass measured values for a real cluster, e.g. a slower outer
axis across nodes: ``MeshSpec((2, 8), alpha=(2e-5, 5e-6), beta=(4e-11, 1e-11))``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

DEFAULT_ALPHA = 5e-6  # seconds per collective
DEFAULT_BETA = 1e-11  # seconds per byte (100 GB/s)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _items(value) -> tuple | None:
    """The entries of a list-like ``value`` (not a string), or ``None``."""
    if isinstance(value, (str, bytes)):
        return None
    try:
        return tuple(value)
    except TypeError:
        return None


def _per_axis(value, ndim: int, what: str) -> tuple[float, ...]:
    if _is_real(value):
        vals = (float(value),) * ndim
    else:
        items = _items(value)
        if items is None or not all(_is_real(v) for v in items):
            raise TypeError(f"MeshSpec: {what} must be a number or one number per mesh axis, not {value!r}")
        vals = tuple(float(v) for v in items)
    if len(vals) != ndim:
        raise ValueError(f"MeshSpec: {what} has {len(vals)} entries but the mesh has {ndim} axes")
    if not all(math.isfinite(v) and v > 0 for v in vals):
        raise ValueError(f"MeshSpec: {what} must be positive and finite on every axis, got {value!r}")
    return vals


def mesh_shape_tuple(shape, what: str = "mesh shape") -> tuple[int, ...]:
    """``shape`` (an int, or a sequence of ints) as a tuple of positive ints.

    Raises:
        TypeError: ``shape`` is neither an int nor a sequence of ints.
        ValueError: an empty shape or an axis size below 1.
    """
    items = (shape,) if _is_int(shape) else _items(shape)
    if items is None or not all(_is_int(s) for s in items):
        raise TypeError(f"{what} must be an int or a sequence of ints such as (2, 4), not {shape!r}")
    if not items or any(s < 1 for s in items):
        raise ValueError(f"{what} must have at least one axis and every axis at least 1 device, "
                         f"got {items}")
    return tuple(int(s) for s in items)


@dataclass(frozen=True)
class MeshSpec:
    """A logical mesh: ``shape`` (devices per axis), axis names, and per-axis link costs.

    Args:
        shape: devices along each mesh axis, e.g. ``(2, 4)`` for 8 devices; an int for a
            1-D mesh.
        axis_names: one distinct name per axis; default ``("dim0", "dim1", ...)``.
        alpha: latency in seconds per collective, one number or one per axis; positive, finite.
        beta: inverse bandwidth in seconds per byte, one number or one per axis; positive, finite.

    Raises:
        TypeError: a shape that is not ints, names that are not strings, alpha/beta that
            are not numbers.
        ValueError: an empty shape, an axis size below 1, names empty, repeated or of the
            wrong count, alpha/beta not positive and finite or with the wrong number of entries.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] | None = None
    alpha: float | Sequence[float] = DEFAULT_ALPHA
    beta: float | Sequence[float] = DEFAULT_BETA

    def __post_init__(self):
        shape = mesh_shape_tuple(self.shape, "MeshSpec: shape")
        object.__setattr__(self, "shape", shape)
        names = self.axis_names
        if names is None:
            names = tuple(f"dim{i}" for i in range(len(shape)))
        items = _items(names)
        if items is None or not all(isinstance(n, str) for n in items):
            raise TypeError(f"MeshSpec: axis_names must be a sequence of strings, not {names!r}")
        names = items
        if len(names) != len(shape):
            raise ValueError(f"MeshSpec: axis_names {names} has {len(names)} names for a {len(shape)}-axis mesh")
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"MeshSpec: axis_names must be distinct non-empty strings, got {names}")
        object.__setattr__(self, "axis_names", tuple(names))
        object.__setattr__(self, "alpha", _per_axis(self.alpha, len(shape), "alpha"))
        object.__setattr__(self, "beta", _per_axis(self.beta, len(shape), "beta"))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @classmethod
    def from_device_mesh(cls, device_mesh, **kwargs) -> "MeshSpec":
        """The MeshSpec of a ``torch.distributed.device_mesh.DeviceMesh``."""
        names = device_mesh.mesh_dim_names
        return cls(tuple(device_mesh.mesh.shape), axis_names=tuple(names) if names else None, **kwargs)

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "axis_names": list(self.axis_names),
                "alpha": list(self.alpha), "beta": list(self.beta)}

    @classmethod
    def from_json(cls, d: dict) -> "MeshSpec":
        """Inverse of :meth:`to_json`; raises as the constructor does."""
        return cls(d["shape"], d["axis_names"], d["alpha"], d["beta"])
