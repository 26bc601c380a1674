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
from dataclasses import dataclass
from typing import Sequence

DEFAULT_ALPHA = 5e-6  # seconds per collective
DEFAULT_BETA = 1e-11  # seconds per byte (100 GB/s)


def _per_axis(value, ndim: int, what: str) -> tuple[float, ...]:
    if isinstance(value, (int, float)):
        return (float(value),) * ndim
    vals = tuple(float(v) for v in value)
    if len(vals) != ndim:
        raise ValueError(f"MeshSpec: {what} has {len(vals)} entries but the mesh has {ndim} axes")
    return vals


@dataclass(frozen=True)
class MeshSpec:
    """A logical mesh: ``shape`` (devices per axis), axis names, and per-axis link costs.

    Args:
        shape: devices along each mesh axis, e.g. ``(2, 4)`` for 8 devices.
        axis_names: one name per axis; default ``("dim0", "dim1", ...)``.
        alpha: latency in seconds per collective, one number or one per axis.
        beta: inverse bandwidth in seconds per byte, one number or one per axis.

    Raises:
        ValueError: on a non-positive axis size or per-axis lists of the wrong length.
    """

    shape: tuple[int, ...]
    axis_names: tuple[str, ...] | None = None
    alpha: float | Sequence[float] = DEFAULT_ALPHA
    beta: float | Sequence[float] = DEFAULT_BETA

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape)
        if not shape or any(s < 1 for s in shape):
            raise ValueError(f"MeshSpec: bad mesh shape {self.shape}")
        object.__setattr__(self, "shape", shape)
        names = self.axis_names or tuple(f"dim{i}" for i in range(len(shape)))
        if len(names) != len(shape):
            raise ValueError(f"MeshSpec: {len(names)} axis names for a {len(shape)}-axis mesh")
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
        return cls(tuple(d["shape"]), tuple(d["axis_names"]), tuple(d["alpha"]), tuple(d["beta"]))
