"""The cost model: compute time (roofline), collective time (alpha-beta), memory.

All times are seconds, all memory bytes per device. Subclass :class:`CostModel` and pass
it as ``cost_model=`` to change how anything is priced; the solver only calls the public
methods below.

Formulas:

* compute: roofline (Williams, Waterman, Patterson, CACM 2009) on local shapes,
  ``max(FLOPs / peak FLOP/s, bytes moved / memory bandwidth)``; backward costs twice the
  forward FLOPs for matmul-like ops (one product for each input's gradient) and as much
  as the forward for the others.
* collectives over a mesh axis of ``n`` devices with per-axis ``alpha`` (s) and ``beta``
  (s/byte), bandwidth terms of ring algorithms (Thakur, Rabenseifner, Gropp, IJHPCA 2005):
  all-reduce ``α + 2(n−1)/n·B·β`` (B = buffer bytes), all-gather ``α + (n−1)/n·B·β``
  (B = gathered output bytes), reduce-scatter ``α + (n−1)/n·B·β`` (B = input bytes),
  all-to-all ``α + (n−1)/n·B·β`` (B = bytes per device: each device must push the
  (n−1)/n of its buffer bound elsewhere through its own link; we do not assume a
  full-bisection crossbar, which would give (n−1)/n²).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from ..mesh import MeshSpec
from ..tracer.annotate import MATMUL_LIKE


@dataclass(frozen=True)
class DevicePreset:
    """Peak rates of one device.

    Attributes:
        name: preset name.
        flops_fp32: dense fp32 (TF32 where the device uses it for matmuls) FLOP/s.
        flops_half: dense bf16/fp16 FLOP/s.
        mem_bw: memory bandwidth in bytes/s.
        memory: device memory in bytes.

    Raises:
        TypeError: a name that is not a string or a rate that is not a number.
        ValueError: a rate that is not positive and finite.
    """

    name: str
    flops_fp32: float
    flops_half: float
    mem_bw: float
    memory: float

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"DevicePreset: name must be a string, not {self.name!r}")
        for what in ("flops_fp32", "flops_half", "mem_bw", "memory"):
            v = getattr(self, what)
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                raise TypeError(f"DevicePreset: {what} must be a number, not {v!r}")
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"DevicePreset: {what} must be positive and finite, got {v!r}")


# Vendor datasheet peaks (dense, no sparsity).
PRESETS = {
    "a100": DevicePreset("a100", 156e12, 312e12, 2.0e12, 80 * 2**30),
    "h100": DevicePreset("h100", 495e12, 989e12, 3.35e12, 80 * 2**30),
    "cpu": DevicePreset("cpu", 1e11, 1e11, 2e10, 24 * 2**30),
}

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


class CostModel:
    """Prices compute, collectives and memory for the planner.

    Args:
        device: a preset name from :data:`PRESETS` or a :class:`DevicePreset`.

    Raises:
        TypeError: ``device`` is neither a string nor a :class:`DevicePreset`.
        ValueError: an unknown preset name.

    The mesh (with its per-axis alpha and beta) is bound by the planner through
    :meth:`bind`; subclasses may override any method, e.g. :meth:`collective_time` with
    measured tables.
    """

    def __init__(self, device: str | DevicePreset = "a100"):
        if isinstance(device, str):
            if device not in PRESETS:
                raise ValueError(f"unknown device preset {device!r}; choose one of {sorted(PRESETS)}")
            device = PRESETS[device]
        elif not isinstance(device, DevicePreset):
            raise TypeError(f"CostModel: device must be a preset name ({', '.join(sorted(PRESETS))}) or a "
                            f"DevicePreset, not {device!r}")
        self.device = device
        self.mesh: MeshSpec | None = None

    def bind(self, mesh: MeshSpec) -> "CostModel":
        self.mesh = mesh
        return self

    def key(self) -> str:
        """A string that identifies the pricing, part of the plan-cache key; subclasses with
        settings of their own should include them."""
        return f"{type(self).__module__}.{type(self).__qualname__}:{self.device}"

    # ------------------------------------------------------------ communication
    def collective_time(self, kind: str, axis: int, nbytes: float) -> float:
        """Seconds for one collective ``kind`` over mesh axis ``axis`` (formulas above).

        Raises:
            ValueError: for an unknown collective kind.
        """
        n = self.mesh.shape[axis]
        if n == 1:
            return 0.0
        a, b = self.mesh.alpha[axis], self.mesh.beta[axis]
        if kind == "all_reduce":
            return a + 2 * (n - 1) / n * nbytes * b
        if kind in ("all_gather", "reduce_scatter", "all_to_all"):
            return a + (n - 1) / n * nbytes * b
        raise ValueError(f"unknown collective {kind!r}")

    def grad_reduction_time(self, axis: int, nbytes: float) -> float:
        """Seconds a parameter's gradient of ``nbytes`` adds to the bucketed all-reduce over
        ``axis``: the bandwidth term only; the bucket's latency is paid once per axis."""
        n = self.mesh.shape[axis]
        return 0.0 if n == 1 else 2 * (n - 1) / n * nbytes * self.mesh.beta[axis]

    # ------------------------------------------------------------ compute
    def compute_time(self, target, flops: float, nbytes: float, dtype: torch.dtype | None,
                     requires_grad: bool) -> float:
        """Forward plus backward seconds of one op on one device.

        Args:
            target: the ATen op.
            flops: local forward FLOPs.
            nbytes: local bytes read and written by the forward.
            dtype: the op's output dtype (picks the FLOP/s peak).
            requires_grad: whether a backward runs.
        """
        peak = self.device.flops_half if dtype in (torch.float16, torch.bfloat16) else self.device.flops_fp32
        fwd = max(flops / peak, nbytes / self.device.mem_bw)
        if not requires_grad:
            return fwd
        bwd = 2 * fwd if target in MATMUL_LIKE else fwd
        return fwd + bwd
