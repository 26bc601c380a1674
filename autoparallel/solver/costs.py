"""The cost model: compute time (roofline), collective time (alpha-beta), memory.

All times are seconds, all memory bytes per device. Subclass :class:`CostModel` and pass
it as ``cost_model=`` to change how anything is priced; the solver only calls the public
methods below.

Formulas:

* compute: roofline (Williams, Waterman, Patterson, CACM 2009) on local shapes,
  ``max(FLOPs / peak FLOP/s, bytes moved / memory bandwidth)``; backward costs twice the
  forward FLOPs for matmul-like ops (one product for each input's gradient) and as much
  as the forward for the others; each call (the forward, each backward product) adds the
  device's measured per-op overhead (``DevicePreset.op_overhead``: dispatch, launch).
* collectives over a mesh axis of ``n`` devices with per-axis ``alpha`` (s) and ``beta``
  (s/byte), bandwidth terms of ring algorithms (Thakur, Rabenseifner, Gropp, IJHPCA 2005):
  all-reduce ``α + 2(n−1)/n·B·β`` (B = buffer bytes), all-gather ``α + (n−1)/n·B·β``
  (B = gathered output bytes), reduce-scatter ``α + (n−1)/n·B·β`` (B = input bytes),
  all-to-all ``α + (n−1)/n·B·β`` (B = bytes per device: each device must push the
  (n−1)/n of its buffer bound elsewhere through its own link; we do not assume a
  full-bisection crossbar, which would give (n−1)/n²).
* measured collectives (:class:`CommProfile`, made by :func:`autoparallel.profile_mesh`):
  per mesh axis and collective, Hockney's line ``t = α + β·B`` (Hockney, Parallel Computing
  1994) fitted to the measured times with ``B`` in the byte conventions above, so the ring
  factor is inside the fitted ``β``; where the measured table departs from the line by more
  than :data:`PROFILE_TOLERANCE` (relative), lookups interpolate the table instead.
* a gradient bucket replicated along axes that together span the world is all-reduced once
  over the world's ranks, and an expert-parallel exchange over every axis is one all-to-all
  over them (:meth:`CostModel.collective_time` with ``axis=None``): a profile's table
  measured over the world (:data:`WORLD_COLLECTIVES`), else the ring formula with the world's
  size and the slowest link of those axes.
* the optimizer step (:meth:`CostModel.optimizer_step_time`): per parameter, the update's
  memory traffic over its local shard plus a per-op overhead (DTensor's dispatch) times the
  ops ``torch.optim``'s implementation runs, counted in its source.
* communication overlapped with compute (:func:`exposed_comm_time`): launches served first
  come first served by one link while the compute runs on; only the time by which the link
  outlasts the compute is exposed (the makespan of a single machine with release dates,
  ``1|r_j|C_max`` in the notation of Graham et al., Annals of Discrete Mathematics 1979,
  which first come first served solves; e.g. Pinedo, "Scheduling: Theory, Algorithms, and
  Systems", Springer). The planner uses it for the gradient buckets that the runtime
  all-reduces during the backward (Li et al., VLDB 2020, §3.2-3.3).
"""

from __future__ import annotations

import bisect
import copy
import hashlib
import json
import math
import numbers
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tabulate import tabulate

from .. import units
from ..mesh import DEFAULT_ALPHA, DEFAULT_BETA, MeshSpec
from ..runtime_kernels.experts import ROUTED_EXPERTS
from ..tracer.annotate import MATMUL_LIKE

_SDPA = torch.ops.aten.scaled_dot_product_attention.default


@dataclass(frozen=True)
class DevicePreset:
    """Peak rates of one device.

    Attributes:
        name: preset name.
        flops_fp32: dense fp32 (TF32 where the device uses it for matmuls) FLOP/s.
        flops_half: dense bf16/fp16 FLOP/s.
        mem_bw: memory bandwidth in bytes/s.
        memory: device memory in bytes.
        op_overhead: seconds one op call costs beside its arithmetic and memory traffic
            (Python and dispatcher on a CPU, kernel launch on a GPU); an op's backward is
            another call (:meth:`CostModel.compute_time`). 0 leaves it out.
        dtensor_op_overhead: seconds one op on DTensor arguments costs beside its arithmetic
            and memory traffic (DTensor's dispatch and sharding propagation, then the local
            op's own dispatch): what each op of the optimizer step over the module's DTensor
            parameters pays (:meth:`CostModel.optimizer_step_time`). 0 leaves it out.
        attention_efficiency: the FLOP/s ``scaled_dot_product_attention`` achieves, forward
            and backward together, as a fraction of the matmul peak of its dtype (its fused
            kernels run softmax and masking between the products, below GEMM rates).
        experts_efficiency: what the routed experts' op
            (:data:`~autoparallel.runtime_kernels.experts.ROUTED_EXPERTS`) achieves forward and
            backward, as a fraction of what :meth:`CostModel.compute_time` prices for it with
            this 1 (its FLOPs as a matmul's, its inputs and output as its traffic): its kernel
            also sorts and gathers the (token, expert) pairs, runs one pair of products per
            expert on a few hundred rows, the activation between them, and scatters the
            results back, none of which those two terms see. ``compute_time`` divides the op's
            time by it.
        host_link_bw: bytes/s of a copy between host and device memory, each way (a
            host-offloaded parameter's shard to the device, its gradient back).
        host_mem_bw: bytes/s of host memory, where a host-offloaded parameter's optimizer
            step runs.
        step_efficiency: what a training step's ops achieve in place, as a fraction of what
            the roofline of the other rates predicts for them: measured rates come from
            kernels repeated on warm operands, while in a step each op reads what earlier ops
            left in memory, allocates its output beside the saved activations, and runs through
            the autograd engine. :meth:`CostModel.compute_time` divides by it; 1 takes the
            roofline as it is.
        core_share: the share of a CPU core each compute thread had while these rates were
            measured: the host's cores over its ranks' threads, at most 1 (1 on a GPU, or
            where threads do not outnumber cores). Rates measured with every rank busy on
            shared cores are each rank's share; a pipeline schedule, whose idle ranks lend
            their cores, reads it (:func:`autoparallel.solver.stages.step_model`).

    Raises:
        TypeError: a name that is not a string or a rate that is not a number.
        ValueError: a rate or an efficiency that is not positive and finite, a
            negative or infinite ``op_overhead`` or ``dtensor_op_overhead``.
    """

    name: str
    flops_fp32: float
    flops_half: float
    mem_bw: float
    memory: float
    op_overhead: float = 0.0
    dtensor_op_overhead: float = 0.0
    attention_efficiency: float = 1.0
    step_efficiency: float = 1.0
    host_link_bw: float = 25e9
    host_mem_bw: float = 1e11
    core_share: float = 1.0
    experts_efficiency: float = 1.0

    def __post_init__(self):
        if not isinstance(self.name, str):
            raise TypeError(f"DevicePreset: name must be a string, not {self.name!r}")
        for what in ("flops_fp32", "flops_half", "mem_bw", "memory", "attention_efficiency", "step_efficiency",
                     "host_link_bw", "host_mem_bw", "experts_efficiency"):
            v = getattr(self, what)
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                raise TypeError(f"DevicePreset: {what} must be a number, not {v!r}")
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"DevicePreset: {what} must be positive and finite, got {v!r}")
        if not (isinstance(self.core_share, numbers.Real) and 0 < self.core_share <= 1):
            raise ValueError(f"DevicePreset: core_share must be a number in (0, 1], got {self.core_share!r}")
        for what in ("op_overhead", "dtensor_op_overhead"):
            v = getattr(self, what)
            if not isinstance(v, numbers.Real) or isinstance(v, bool):
                raise TypeError(f"DevicePreset: {what} must be a number, not {v!r}")
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"DevicePreset: {what} must be >= 0 and finite, got {v!r}")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d) -> "DevicePreset":
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: not an object with exactly the fields of a preset, or a bad value.
        """
        names = ("name", "flops_fp32", "flops_half", "mem_bw", "memory", "op_overhead", "dtensor_op_overhead",
                 "attention_efficiency", "step_efficiency")
        host = ("host_link_bw", "host_mem_bw", "core_share", "experts_efficiency")  # absent from presets saved before they were measured
        if not isinstance(d, dict) or not set(names) <= set(d) <= set(names + host):
            raise ValueError(f"a device preset must be an object with the fields {names + host}, not {d!r}")
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(str(e)) from None


# Vendor datasheet peaks, dense (the datasheets print tensor-core rates "with sparsity", twice
# these): NVIDIA A100 Tensor Core GPU datasheet (SXM, 80 GB): TF32 156 TFLOPS, BF16/FP16
# 312 TFLOPS, HBM2e 2,039 GB/s; NVIDIA H100 Tensor Core GPU datasheet (SXM5): TF32 494.7
# (989 with sparsity), BF16/FP16 989.4 (1,979 with sparsity) TFLOPS, HBM3 3.35 TB/s.
# compute_time() picks flops_half for ops whose output is bf16 or fp16 (a model in bf16, or
# one planned under a mixed-precision policy: autoparallel.precision).
# op_overhead: eager PyTorch on a GPU pays a kernel launch plus the dispatcher per op, a few
# microseconds (5 us here, an order of magnitude, not a datasheet figure); the cpu preset's
# 4 us is what calibrate_device measured on the 2-core test VM (torch 2.13: 2.8 us a
# forward call, 4.9 us its backward). profile_mesh measures the real value.
# dtensor_op_overhead: DTensor's dispatch runs in the host's Python whatever the device, so every
# preset takes what the 2-core test VM gave (torch 2.13, idle): AdamW's per-tensor loop over the
# 52 DTensor parameters of GPT-2 (4 x 256) ran 6.6 ms longer than over plain tensors, 16 us more
# for each of its 416 DTensor ops, on top of a plain op's 2.5-4 us; calibrate_device measured
# 17-30 us per op (AdamW's eight update ops on one-element DTensors, load 3-4).
# attention_efficiency: FlashAttention-2 reaches up to 73 % of an A100's peak in the forward and
# up to 63 % in the backward (Dao, "FlashAttention-2", 2023, §4.1), less at short sequences and
# small head dims: the GPU presets take 0.5. The cpu preset's 0.4 is what calibrate_device
# measured on the 2-core test VM (torch 2.13's flash kernel for CPU, fp32: 70-90 GFLOP/s forward
# and backward at head dims 32-128, against 180 GFLOP/s of GEMM, one thread).
# host_link_bw: PCIe 4.0 x16 (A100) moves 31.5 GB/s each way and PCIe 5.0 x16 (H100) 63 GB/s
# (PCI-SIG base specifications); the presets take about 80 % of that. host_mem_bw: 100 GB/s, half a
# socket of eight DDR4-3200 channels (204.8 GB/s peak). On the cpu preset host and device are one
# memory: a copy reads and writes it (half its bandwidth), the host step runs at its bandwidth.
# step_efficiency and experts_efficiency: 1 in the presets (datasheet peaks have no measured
# step or kernel to compare with); calibrate_device measures them (step 0.76-0.82 on the 2-core
# test VM).
PRESETS = {
    "a100": DevicePreset("a100", 156e12, 312e12, 2.0e12, 80 * 2**30, op_overhead=5e-6, dtensor_op_overhead=20e-6,
                         attention_efficiency=0.5, host_link_bw=25e9, host_mem_bw=1e11),
    "h100": DevicePreset("h100", 495e12, 989e12, 3.35e12, 80 * 2**30, op_overhead=5e-6, dtensor_op_overhead=20e-6,
                         attention_efficiency=0.5, host_link_bw=50e9, host_mem_bw=1e11),
    "cpu": DevicePreset("cpu", 1e11, 1e11, 2e10, 24 * 2**30, op_overhead=4e-6, dtensor_op_overhead=20e-6,
                        attention_efficiency=0.4, host_link_bw=1e10, host_mem_bw=2e10),
}


@dataclass(frozen=True)
class OptimizerOps:
    """The ops one ``torch.optim`` step runs, for :meth:`CostModel.optimizer_step_time`.

    Attributes:
        per_param: ops on a parameter's tensors (parameter, gradient, states: DTensors in
            the emitted module), per parameter (the per-tensor loop).
        per_param_plain: ops on plain tensors per parameter (the step counter's increment
            and ``.item()``).
        per_group: foreach ops over the group's tensor lists (DTensors), per parameter group.
        per_group_plain: foreach ops on plain tensors per group (the step counters).
    """

    per_param: int
    per_param_plain: int
    per_group: int
    per_group_plain: int


OPTIMIZER_IMPLEMENTATIONS = ("for-loop", "foreach")

OPTIMIZER_OPS = {
    # torch 2.13 torch/optim/adam.py, _single_tensor_adam: plain `step_t += 1` (l. 414) and
    # `_get_value(step_t)` (.item(), l. 528); on the tensors `param.mul_` (decoupled weight decay,
    # l. 419; AdamW only: Adam's default weight_decay is 0), `exp_avg.lerp_` (l. 456),
    # `exp_avg_sq.mul_(...).addcmul_` (l. 475), `exp_avg_sq.sqrt() / ... .add_(eps)` (l. 544),
    # `param.addcdiv_` (l. 546).
    ("adamw", "for-loop"): OptimizerOps(8, 2, 0, 0),
    ("adam", "for-loop"): OptimizerOps(7, 2, 0, 0),
    # _multi_tensor_adam: plain `torch.tensor(1.0)` and `_foreach_add_` of the steps (l. 682), two
    # `.item()` per parameter (l. 772, 775); foreach `_mul_` (weight decay, l. 691; AdamW only),
    # `_lerp_` (l. 704), `_mul_` (l. 708), `_addcmul_` (l. 721), `_sqrt` (l. 790), `_div_`,
    # `_add_` (l. 792-793), `_addcdiv_` (l. 794).
    ("adamw", "foreach"): OptimizerOps(0, 2, 8, 2),
    ("adam", "foreach"): OptimizerOps(0, 2, 7, 2),
    # torch/optim/sgd.py (torch defaults: weight_decay 0; momentum 0 for "sgd"):
    # _single_tensor_sgd `param.add_` (l. 379), with momentum `buf.mul_(...).add_` (l. 364);
    # _multi_tensor_sgd `_foreach_add_` (l. 472), with momentum `_foreach_mul_`, `_foreach_add_`
    # (l. 445-446). Momentum buffers as after the first step (that one clones the gradient).
    ("sgd", "for-loop"): OptimizerOps(1, 0, 0, 0),
    ("sgd_momentum", "for-loop"): OptimizerOps(3, 0, 0, 0),
    ("sgd", "foreach"): OptimizerOps(0, 0, 1, 0),
    ("sgd_momentum", "foreach"): OptimizerOps(0, 0, 3, 0),
}
"""Ops per step of each optimizer (:data:`~autoparallel.solver.memory.OPTIMIZER_STATES`'s keys,
``torch.optim`` defaults) and implementation, counted in the torch source (lines of torch
2.13) and checked by counting the dispatched ops of real steps (tests/test_optimizer_cost.py)."""

OPTIMIZER_ELEMENTS = {"adamw": 20, "adam": 18, "sgd_momentum": 8, "sgd": 3}
"""Elements read and written per parameter element by one step of ``torch.optim``'s unfused
implementations (the per-tensor loop and foreach), each op of :data:`OPTIMIZER_OPS` one pass
over the tensors it reads and writes. AdamW: weight decay ``param.mul_`` 2, ``exp_avg.lerp_``
3, ``exp_avg_sq.mul_`` 2 and ``.addcmul_`` 3, the denominator's ``sqrt``, ``/`` and
``add_`` 2 each, ``param.addcdiv_`` 4; Adam without the weight decay, 18; SGD with momentum
``buf.mul_`` 2, ``buf.add_`` 3, ``param.add_`` 3; SGD ``param.add_`` 3. Every pass reaches
memory once the tensors exceed the cache (a parameter of a quarter MiB and up on a CPU core's
L2; a foreach op's whole list on a GPU): 72 bytes per fp32 element measured for AdamW's loop
over a 14M-parameter model on four CPU ranks against 80 priced."""


def optimizer_implementation(device_type: str) -> str:
    """The implementation ``torch.optim`` picks by default for parameters on ``device_type``
    (``torch/optim/optimizer.py``, ``_default_to_fused_or_foreach``: foreach where torch has
    foreach kernels, CUDA among them, the per-tensor loop elsewhere, CPU among them; fused is
    never the default): ``"foreach"`` or ``"for-loop"``."""
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return "foreach" if device_type in _get_foreach_kernels_supported_devices() else "for-loop"

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

WORLD_COLLECTIVES = ("all_reduce", "all_to_all")
"""The collectives the runtime runs over the world's group on a mesh of two or more axes of
more than one device, so that :func:`autoparallel.profile_mesh` measures them there too: the
all-reduce of a gradient bucket replicated along axes that span the world
(:mod:`autoparallel.runtime_kernels.grad_reduction`), and the all-to-all of an expert-parallel
exchange over every axis (:func:`autoparallel.runtime_kernels.experts.exchanges_over_the_mesh`)."""

PROFILE_TOLERANCE = 0.25
"""Largest relative deviation ``|line(B) − t(B)| / t(B)`` over the measured sizes for which a
fitted alpha-beta line prices a collective; beyond it the measured table is interpolated."""

# Version of the CommProfile JSON layout; part of the profile key.
PROFILE_FORMAT = 10  # 2: DevicePreset.op_overhead; 3: DevicePreset.dtensor_op_overhead; 4: a world all-reduce table;
#                    5: DevicePreset.attention_efficiency and step_efficiency;
#                    6: calibration phases run on every rank at once, the slowest rank's rates together;
#                    7: DevicePreset.core_share, attention timed beside the peak-size matmul;
#                    8: every calibration sample the same calls on every rank, started together;
#                    9: a world all-to-all table (expert exchanges over every axis);
#                   10: DevicePreset.experts_efficiency


def fit_alpha_beta(sizes, times) -> tuple[float, float]:
    """Hockney's line ``t = α + β·B`` through measured ``(B, t)`` points.

    Least squares on the relative error (weights ``1/t²``), so that the latency-bound small
    messages count as much as the bandwidth-bound large ones; ``α`` and ``β`` are kept ≥ 0
    (a negative one is set to 0 and the other refitted alone).

    Args:
        sizes: message bytes, at least two distinct.
        times: seconds per collective, positive, one per size.

    Returns:
        ``(alpha, beta)``: seconds, and seconds per byte.

    Raises:
        ValueError: fewer than two distinct sizes, lengths that differ, a time that is not
            positive and finite.
    """
    if len(sizes) != len(times) or len(set(sizes)) < 2:
        raise ValueError(f"fitting a line needs two or more distinct sizes with one time each, got {len(sizes)} "
                         f"sizes and {len(times)} times")
    if not all(math.isfinite(t) and t > 0 for t in times):
        raise ValueError(f"measured times must be positive and finite, got {list(times)}")
    scale = max(sizes)  # fit in units of the largest size: keeps the normal equations well scaled
    xs = [b / scale for b in sizes]
    w = [1 / t**2 for t in times]
    sw, sx, sxx = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * x * x for wi, x in zip(w, xs))
    st, sxt = sum(wi * t for wi, t in zip(w, times)), sum(wi * x * t for wi, x, t in zip(w, xs, times))
    det = sw * sxx - sx * sx
    alpha, slope = (sxx * st - sx * sxt) / det, (sw * sxt - sx * st) / det
    if slope < 0:
        alpha, slope = st / sw, 0.0
    elif alpha < 0:
        alpha, slope = 0.0, sxt / sxx
    return alpha, slope / scale


@dataclass(frozen=True)
class CollectiveTable:
    """Measured seconds of one collective over one mesh axis, and how lookups price it.

    Attributes:
        sizes: message bytes, ascending (the byte convention of :meth:`CostModel.collective_time`).
        times: seconds per collective at each size (median over repetitions, slowest rank).
        alpha / beta: the fitted line (:func:`fit_alpha_beta`), seconds and seconds per byte.
        deviation: largest relative deviation of the line from the measured times.
        interpolate: ``deviation > tolerance``: lookups interpolate the table, not the line.

    Raises:
        ValueError: (constructor) sizes not ascending positive ints, times not positive and
            finite, lengths that differ, fewer than two sizes, alpha/beta negative.
    """

    sizes: tuple[int, ...]
    times: tuple[float, ...]
    alpha: float
    beta: float
    deviation: float
    interpolate: bool
    _envelope: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        sizes, times = tuple(self.sizes), tuple(self.times)
        if len(sizes) < 2 or len(sizes) != len(times):
            raise ValueError(f"a collective table needs two or more sizes with one time each, got {len(sizes)} "
                             f"sizes and {len(times)} times")
        if not all(_is_int(b) and b > 0 for b in sizes) or any(a >= b for a, b in zip(sizes, sizes[1:])):
            raise ValueError(f"table sizes must be ascending positive ints, got {list(sizes)}")
        if not all(_is_real(t) and math.isfinite(t) and t > 0 for t in times):
            raise ValueError(f"table times must be positive and finite, got {list(times)}")
        for what in ("alpha", "beta", "deviation"):
            v = getattr(self, what)
            if not (_is_real(v) and math.isfinite(v) and v >= 0):
                raise ValueError(f"table {what} must be a finite number >= 0, got {v!r}")
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "times", times)
        # running maximum: a larger message never prices cheaper (measurement noise aside)
        envelope, top = [], 0.0
        for t in times:
            top = max(top, t)
            envelope.append(top)
        object.__setattr__(self, "_envelope", tuple(envelope))

    @classmethod
    def fit(cls, sizes, times, tolerance: float = PROFILE_TOLERANCE) -> "CollectiveTable":
        """The table of measured ``(sizes, times)`` with its fitted line and lookup mode.

        Raises:
            ValueError: as :func:`fit_alpha_beta` and the constructor.
        """
        alpha, beta = fit_alpha_beta(sizes, times)
        deviation = max(abs(alpha + beta * b - t) / t for b, t in zip(sizes, times))
        return cls(tuple(int(b) for b in sizes), tuple(float(t) for t in times), alpha, beta, deviation,
                   deviation > tolerance)

    def time(self, nbytes: float) -> float:
        """Seconds for a message of ``nbytes``: the line, or (``interpolate``) the table: linear
        between measured sizes over their running maximum, the smallest size's time below it,
        and proportional to bytes beyond the largest (bandwidth-bound there)."""
        if not self.interpolate:
            return self.alpha + self.beta * nbytes
        sizes, env = self.sizes, self._envelope
        if nbytes <= sizes[0]:
            return env[0]
        if nbytes >= sizes[-1]:
            return env[-1] * nbytes / sizes[-1]
        i = bisect.bisect_right(sizes, nbytes)
        lo, hi = sizes[i - 1], sizes[i]
        return env[i - 1] + (env[i] - env[i - 1]) * (nbytes - lo) / (hi - lo)

    def to_json(self) -> dict:
        return {"sizes": list(self.sizes), "times": list(self.times), "alpha": self.alpha, "beta": self.beta,
                "deviation": self.deviation, "interpolate": self.interpolate}

    @classmethod
    def from_json(cls, d) -> "CollectiveTable":
        """Inverse of :meth:`to_json`; raises ValueError for a malformed table."""
        names = ("sizes", "times", "alpha", "beta", "deviation", "interpolate")
        if not isinstance(d, dict) or set(d) != set(names):
            raise ValueError(f"a collective table must be an object with the fields {names}, not {d!r}")
        if not (isinstance(d["sizes"], list) and isinstance(d["times"], list) and isinstance(d["interpolate"], bool)):
            raise ValueError(f"a collective table needs lists of sizes and times and a boolean interpolate, "
                             f"not {d!r}")
        return cls(tuple(d["sizes"]), tuple(d["times"]), d["alpha"], d["beta"], d["deviation"], d["interpolate"])


IDENTITY_FIELDS = ("backend", "device_type", "device_name", "world_size", "mesh_shape", "hosts", "torch")
"""What a :class:`CommProfile` was measured on; its hash is the profile's cache key."""


def profile_key(identity: dict) -> str:
    """Hex digest (20 characters) of a profile identity: the :data:`IDENTITY_FIELDS` (process
    group backend, device type and name, world size, mesh shape, host name of every rank in
    mesh order, torch version) and :data:`PROFILE_FORMAT`.

    Raises:
        ValueError: a field missing or unknown.
    """
    if not isinstance(identity, dict) or set(identity) != set(IDENTITY_FIELDS):
        raise ValueError(f"a profile identity has the fields {IDENTITY_FIELDS}, got {identity!r}")
    text = json.dumps({"format": PROFILE_FORMAT, **identity}, sort_keys=True, default=list)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


@dataclass(frozen=True)
class CommProfile:
    """Measured costs of a device mesh: collective tables per mesh axis and the device's
    achieved compute rates. Made by :func:`autoparallel.profile_mesh`; priced by
    :meth:`CostModel.from_profile`. ``str(profile)`` is a table; :meth:`to_json` /
    :meth:`from_json` round-trip exactly.

    Attributes:
        identity: what it was measured on (:data:`IDENTITY_FIELDS`).
        axis_names: the mesh's axis names.
        tables: ``(mesh axis, collective)`` → :class:`CollectiveTable`, for every axis of
            more than one device and every collective in :data:`COLLECTIVES`; on a mesh with
            two or more such axes also ``(None, kind)`` for each kind of
            :data:`WORLD_COLLECTIVES`: the collective over every device at once (the world's
            group), which prices a gradient bucket and an expert exchange spanning the world
            (:meth:`CostModel.collective_time` with ``axis=None``).
        device: achieved matmul FLOP/s per dtype and memory bandwidth, as a :class:`DevicePreset`.
        profile_s: seconds the measurement took.

    Raises:
        ValueError: (constructor) an identity without the expected fields, axis names that do
            not match the mesh shape, a table for an axis or collective the mesh does not have.
    """

    identity: dict
    axis_names: tuple[str, ...]
    tables: dict
    device: DevicePreset
    profile_s: float = 0.0

    def __post_init__(self):
        profile_key(self.identity)  # checks the fields
        object.__setattr__(self, "identity", json.loads(json.dumps(self.identity)))  # tuples as lists, as in JSON
        shape = self.mesh_shape
        if not (isinstance(self.axis_names, (list, tuple)) and len(self.axis_names) == len(shape)
                and all(isinstance(n, str) for n in self.axis_names)):
            raise ValueError(f"profile: axis names {self.axis_names!r} are not one string per axis of the mesh {shape}")
        object.__setattr__(self, "axis_names", tuple(self.axis_names))
        spanning = sum(n > 1 for n in shape) > 1
        for (axis, kind), t in self.tables.items():
            world = axis is None and kind in WORLD_COLLECTIVES and spanning
            if kind not in COLLECTIVES or not (world or (_is_int(axis) and 0 <= axis < len(shape))):
                raise ValueError(f"profile: a table for {kind!r} over mesh axis {axis!r} of a mesh {shape}")
            if not isinstance(t, CollectiveTable):
                raise ValueError(f"profile: the table of {kind} over axis {axis} is not a CollectiveTable: {t!r}")
        if not isinstance(self.device, DevicePreset):
            raise ValueError(f"profile: device must be a DevicePreset, not {self.device!r}")

    @property
    def key(self) -> str:
        """The cache key (:func:`profile_key` of the identity)."""
        return profile_key(self.identity)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        return tuple(self.identity["mesh_shape"])

    def submesh(self, axis: int) -> "CommProfile":
        """The profile of the mesh less mesh axis ``axis`` (one pipeline stage's devices:
        :func:`~autoparallel.pipeline_plan.submesh`): the other axes' tables, renumbered; the
        world's tables are left out (they were measured over every device, the stage's group is
        smaller, and the formula over the kept axes' links prices it); the identity's mesh
        shape, world size and hosts (those of the stage at index 0 along ``axis``) the
        submesh's. A mesh of that axis alone leaves one device, ``(1,)`` named ``"stage"``.

        Raises:
            ValueError: ``axis`` not an axis of the profiled mesh.
        """
        shape = self.mesh_shape
        if not (_is_int(axis) and 0 <= axis < len(shape)):
            raise ValueError(f"profile: no mesh axis {axis!r} in a mesh {shape}")
        keep = [a for a in range(len(shape)) if a != axis]
        renumber = {a: i for i, a in enumerate(keep)}
        tables = {(renumber[a], kind): t for (a, kind), t in self.tables.items() if a is not None and a != axis}
        sub_shape = [shape[a] for a in keep] or [1]
        names = tuple(self.axis_names[a] for a in keep) or ("stage",)
        identity = dict(self.identity, mesh_shape=sub_shape, world_size=math.prod(sub_shape))
        hosts = self.identity.get("hosts")
        if isinstance(hosts, list) and len(hosts) == math.prod(shape):
            kept = []
            for rank, host in enumerate(hosts):  # mesh order: row-major over the shape
                r, coord = rank, []
                for n in reversed(shape):
                    coord.append(r % n)
                    r //= n
                if coord[::-1][axis] == 0:
                    kept.append(host)
            identity["hosts"] = kept
        return CommProfile(identity, names, tables, self.device, self.profile_s)

    def mesh_spec(self, axis_names=None) -> MeshSpec:
        """A :class:`MeshSpec` of the profiled mesh whose per-axis alpha and beta are the link's:
        the all-reduce line's ``α`` and its ``β`` divided by the ring factor ``2(n−1)/n``
        (positive floors for a fit that gave 0; :data:`~autoparallel.mesh.DEFAULT_ALPHA` and
        ``DEFAULT_BETA`` on axes of one device). ``axis_names`` default to the profile's."""
        alpha, beta = [], []
        for axis, n in enumerate(self.mesh_shape):
            t = self.tables.get((axis, "all_reduce"))
            alpha.append(max(t.alpha, 1e-9) if t else DEFAULT_ALPHA)
            beta.append(max(t.beta * n / (2 * (n - 1)), 1e-15) if t else DEFAULT_BETA)
        return MeshSpec(self.mesh_shape, axis_names or self.axis_names, tuple(alpha), tuple(beta))

    def table(self) -> str:
        """The profile as text: what it was measured on, the compute rates, and per axis and
        collective the fitted line, its largest deviation and the lookup it uses."""
        ident, dev = self.identity, self.device
        head = (f"mesh profile {self.key}: {ident['backend']} on {ident['world_size']} x {ident['device_type']} "
                f"({ident['device_name']}), mesh {self.mesh_shape}, hosts {sorted(set(ident['hosts']))}, "
                f"measured in {self.profile_s:.1f} s\n"
                f"compute: matmul {dev.flops_fp32 / 1e9:.4g} GFLOP/s fp32, {dev.flops_half / 1e9:.4g} GFLOP/s "
                f"16-bit; memory {dev.mem_bw / 1e9:.4g} GB/s")
        rows = []
        def order(item):  # by axis, the world's table last, then in COLLECTIVES order
            (axis, kind), _ = item
            return (len(self.mesh_shape) if axis is None else axis, COLLECTIVES.index(kind))

        for (axis, kind), t in sorted(self.tables.items(), key=order):
            where, n = (("world", math.prod(self.mesh_shape)) if axis is None
                        else (f"{axis} ({self.axis_names[axis]})", self.mesh_shape[axis]))
            rows.append([where, n, kind, units.seconds(t.alpha),
                         f"{1 / t.beta / 1e9:.3g}" if t.beta else "inf", f"{100 * t.deviation:.0f}%",
                         "table" if t.interpolate else "line", f"{units.nbytes(t.sizes[0])} .. {units.nbytes(t.sizes[-1])}"])
        hdr = ["axis", "devices", "collective", "alpha", "1/beta GB/s", "max dev", "lookup", "sizes"]
        return head + "\n" + tabulate(rows, hdr, tablefmt="simple")

    def __str__(self) -> str:
        return self.table()

    def to_json(self) -> str:
        return json.dumps({
            "format": PROFILE_FORMAT, "key": self.key, "identity": self.identity,
            "axis_names": list(self.axis_names), "device": self.device.to_json(), "profile_s": self.profile_s,
            "tables": [{"axis": a, "kind": k, **t.to_json()} for (a, k), t in self.tables.items()],
        }, default=list)

    @classmethod
    def from_json(cls, s: str) -> "CommProfile":
        """The profile written by :meth:`to_json`.

        Raises:
            ValueError: text that is not a profile of this format (the message says what is wrong).
        """
        try:
            d = json.loads(s)
        except (TypeError, ValueError) as e:
            raise ValueError(f"a mesh profile must be JSON text: {e}") from None
        names = ("format", "key", "identity", "axis_names", "device", "profile_s", "tables")
        if not isinstance(d, dict) or set(d) != set(names):
            raise ValueError(f"a mesh profile is an object with the fields {names}")
        if d["format"] != PROFILE_FORMAT:
            raise ValueError(f"mesh profile format {d['format']!r}, this version reads {PROFILE_FORMAT}")
        if not (isinstance(d["tables"], list) and all(isinstance(t, dict) for t in d["tables"])):
            raise ValueError("mesh profile: tables must be a list of objects")
        if not (_is_real(d["profile_s"]) and isinstance(d["identity"], dict)):
            raise ValueError("mesh profile: profile_s must be a number and identity an object")
        tables = {}
        for t in d["tables"]:
            t = dict(t)
            if "axis" not in t or "kind" not in t:
                raise ValueError(f"mesh profile: a table without its axis and kind: {t!r}")
            where = (t.pop("axis"), t.pop("kind"))
            tables[where] = CollectiveTable.from_json(t)
        profile = cls(d["identity"], d["axis_names"], tables, DevicePreset.from_json(d["device"]), d["profile_s"])
        if profile.key != d["key"]:
            raise ValueError(f"mesh profile: key {d['key']!r} does not match its identity ({profile.key})")
        return profile

    def save(self, path) -> None:
        """Write the JSON to ``path`` (OSError as ``Path.write_text`` raises it)."""
        Path(path).write_text(self.to_json())

    @classmethod
    def load(cls, path) -> "CommProfile":
        """Read a profile written by :meth:`save` (OSError, or ValueError for bad content)."""
        return cls.from_json(Path(path).read_text())


def exposed_comm_time(launches) -> float:
    """Seconds by which communication launched beside a stream of compute outlasts it.

    Each launch queues its communication on one link, served first come first served, while
    the compute goes on; the link is idle until the first launch. With ``g_i`` the
    communication and ``c_i`` the compute of launch ``i`` (in launch order), the link
    finishes ``max_k (r_k + Σ_{i≥k} g_i)`` where ``r_k = Σ_{i<k} c_i`` is the launch time
    (the makespan of ``1|r_j|C_max`` in first-come order), and the compute ends at
    ``Σ_i c_i``, so the exposed time is

        ``max(0, max_k Σ_{i≥k} (g_i − c_i))``.

    One launch with compute ``B`` after it gives ``max(0, G − B)``; the last launch is exposed
    by at least ``g_last − c_last``: nothing overlaps what is launched after the compute.

    Args:
        launches: ``(g_i, c_i)`` per launch, in launch order: seconds of communication
            launched, then seconds of compute that run after the launch and before the next
            one (after the last one: until the compute ends).

    Returns:
        the exposed seconds (≥ 0).
    """
    exposed = tail = 0.0
    for comm, compute in reversed(list(launches)):
        tail += comm - compute
        exposed = max(exposed, tail)
    return exposed


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


class CostModel:
    """Prices compute, collectives and memory for the planner.

    Args:
        device: a preset name from :data:`PRESETS` or a :class:`DevicePreset` (the roofline's
            peaks).
        profile: a :class:`CommProfile`: collectives over its mesh axes are priced from its
            measured tables instead of the mesh's alpha and beta (see :meth:`from_profile`).

    Raises:
        TypeError: ``device`` is neither a string nor a :class:`DevicePreset`, ``profile``
            not a :class:`CommProfile`.
        ValueError: an unknown preset name.

    The mesh (with its per-axis alpha and beta) is bound by the planner through
    :meth:`bind`; subclasses may override any method.
    """

    overlap_grad_reduction: bool = False
    """Whether gradient reduction launched during the backward is priced by its exposed time,
    what does not hide behind backward compute (:func:`exposed_comm_time`), as the emitted
    runtime launches it; ``False`` (default) prices every gradient all-reduce in full. Off by
    default because its max terms weaken the ILP's LP relaxation: an 8-layer LLaMA on (2, 2)
    solves in 52 s with it instead of 1 s (same optimum); a subclass setting it to ``True``
    turns it on."""

    expert_imbalance: float = 1.0
    """The busiest device's share of a mixture-of-experts layer's routed (token, expert) pairs
    over an even share, where a mesh axis splits the experts: its experts' compute, its
    all-to-alls and what its experts save for the backward are counted at that many times the
    even share
    (:func:`autoparallel.strategies.moe.routed_experts_load` and
    :func:`~autoparallel.strategies.moe.routed_experts_cost`), since every device waits for it
    at the layer's next all-to-all. ``1.0``
    (default) assumes balanced routing, what a load-balancing loss aims at; set it on an
    instance or a subclass (it is part of :meth:`key`)."""

    def __init__(self, device: str | DevicePreset = "a100", profile: CommProfile | None = None):
        if profile is not None and not isinstance(profile, CommProfile):
            raise TypeError(f"CostModel: profile must be a CommProfile or None, not {profile!r}")
        self.profile = profile
        if isinstance(device, str):
            if device not in PRESETS:
                raise ValueError(f"unknown device preset {device!r}; choose one of {sorted(PRESETS)}")
            device = PRESETS[device]
        elif not isinstance(device, DevicePreset):
            raise TypeError(f"CostModel: device must be a preset name ({', '.join(sorted(PRESETS))}) or a "
                            f"DevicePreset, not {device!r}")
        self.device = device
        self.mesh: MeshSpec | None = None

    @property
    def host_is_device(self) -> bool:
        """Whether the devices priced are this host's CPUs (the profile's device type, else the
        ``cpu`` preset): host memory is then the device's own, and a parameter offloaded to it
        is read in place, with no device copy (:func:`autoparallel.runtime_kernels.onto_device`)."""
        return (self.profile.identity["device_type"] if self.profile is not None else self.device.name) == "cpu"

    @classmethod
    def from_profile(cls, source, device: str | DevicePreset | None = None) -> "CostModel":
        """The cost model of a measured mesh: collectives from the profile's tables, compute
        from its measured rates (or ``device``, a preset name or :class:`DevicePreset`).

        Args:
            source: a :class:`CommProfile`, or the path of one saved with
                :meth:`CommProfile.save` (e.g. from the cache folder's ``profiles/``).

        Raises:
            OSError: an unreadable file; ValueError: a file that is not a profile.
        """
        profile = source if isinstance(source, CommProfile) else CommProfile.load(source)
        return cls(profile.device if device is None else device, profile=profile)

    def submesh(self, axis: int) -> "CostModel":
        """This cost model for the mesh less mesh axis ``axis`` (a pipeline stage's devices): a
        copy whose profile, if any, is :meth:`CommProfile.submesh`; ``self`` without a profile.

        Raises:
            ValueError: as :meth:`CommProfile.submesh`.
        """
        if self.profile is None:
            return self
        other = copy.copy(self)
        other.profile = self.profile.submesh(axis)
        other.mesh = None
        return other

    def bind(self, mesh: MeshSpec) -> "CostModel":
        """Bind the mesh to price.

        Raises:
            ValueError: a profiled cost model bound to a mesh of another shape than the profile's.
        """
        if self.profile is not None and tuple(mesh.shape) != self.profile.mesh_shape:
            raise ValueError(f"the cost model's profile was measured on a mesh {self.profile.mesh_shape}, "
                             f"not {tuple(mesh.shape)}; profile this mesh, or plan for the profiled shape")
        self.mesh = mesh
        return self

    def key(self) -> str:
        """A string that identifies the pricing, part of the plan-cache key; subclasses with
        settings of their own should include them. A profile adds its key and a digest of
        its measurements."""
        key = f"{type(self).__module__}.{type(self).__qualname__}:{self.device}"
        if self.overlap_grad_reduction:
            key += ":overlap_grad_reduction"
        if self.expert_imbalance != 1.0:
            key += f":expert_imbalance={self.expert_imbalance:g}"
        if self.profile is not None:
            key += f":profile={self.profile.key}:{hashlib.sha256(self.profile.to_json().encode()).hexdigest()[:16]}"
        return key

    def describe(self) -> str:
        """Which costs price the plan, for ``plan.estimate.costs``: ``"preset a100"``, or
        ``"profile <key> (<device name>)"`` (a subclass adds its class name)."""
        what = (f"profile {self.profile.key} ({self.profile.identity['device_name']})" if self.profile
                else f"preset {self.device.name}")
        return what if type(self) is CostModel else f"{type(self).__qualname__}: {what}"

    # ------------------------------------------------------------ communication
    def collective_time(self, kind: str, axis: int | None, nbytes: float) -> float:
        """Seconds for one collective ``kind`` over mesh axis ``axis`` (formulas above).

        ``axis=None``: over every device of the mesh at once, one process group spanning the
        world, as the runtime all-reduces a gradient bucket replicated along axes that
        together span it (:func:`autoparallel.runtime_kernels.grad_reduction._world_group`):
        the ring formulas with ``n`` the world size and ``α``, ``β`` the largest of the
        per-link values of the mesh's axes of more than one device (:meth:`_link`): a ring
        through every device crosses the links of every axis and runs at the pace of its
        slowest. A profile's table over the world (``(None, kind)``, measured by
        :func:`autoparallel.profile_mesh` for :data:`WORLD_COLLECTIVES`) prices it instead
        where it has one.

        Raises:
            ValueError: for an unknown collective kind.
        """
        if axis is None:
            n = math.prod(self.mesh.shape)
            links = [self._link(a) for a, m in enumerate(self.mesh.shape) if m > 1]
            table = self.profile.tables.get((None, kind)) if self.profile is not None else None
        else:
            n = self.mesh.shape[axis]
            links = [(self.mesh.alpha[axis], self.mesh.beta[axis])]
            table = self.profile.tables.get((axis, kind)) if self.profile is not None else None
        if n == 1:
            return 0.0
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}")
        if table is not None:
            return table.time(nbytes)
        a, b = max(x for x, _ in links), max(y for _, y in links)
        if kind == "all_reduce":
            return a + 2 * (n - 1) / n * nbytes * b
        return a + (n - 1) / n * nbytes * b

    def _link(self, axis: int) -> tuple[float, float]:
        """``(alpha, beta)`` of one link of mesh axis ``axis``: seconds, and seconds per byte
        without the ring factor (a profile's all-reduce line, its slope divided by
        ``2(n−1)/n``; else the mesh's)."""
        n = self.mesh.shape[axis]
        table = self.profile.tables.get((axis, "all_reduce")) if self.profile is not None else None
        if table is not None:
            return table.alpha, table.beta * n / (2 * (n - 1))
        return self.mesh.alpha[axis], self.mesh.beta[axis]

    def grad_reduction_time(self, axis: int | None, nbytes: float) -> float:
        """Seconds a parameter's gradient of ``nbytes`` adds to the bucketed all-reduce over
        ``axis``: the bandwidth term only (with a profile, the slope of its all-reduce line);
        the bucket's latency is paid once per axis. ``axis=None``: over the whole mesh as one
        group (a profile's world table, else :meth:`collective_time`'s estimate). The planner
        counts the part that the runtime overlaps with the backward as exposed time only
        (:func:`exposed_comm_time`)."""
        n = math.prod(self.mesh.shape) if axis is None else self.mesh.shape[axis]
        if n == 1:
            return 0.0
        table = self.profile.tables.get((axis, "all_reduce")) if self.profile is not None else None
        if table is not None:
            return table.beta * nbytes
        if axis is None:
            return self.collective_time("all_reduce", None, nbytes) - self.collective_time("all_reduce", None, 0)
        return 2 * (n - 1) / n * nbytes * self.mesh.beta[axis]

    # ------------------------------------------------------------ optimizer
    def host_copy_time(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` between host and device memory, one way
        (``device.host_link_bw``)."""
        return nbytes / self.device.host_link_bw

    def optimizer_step_time(self, numel: int, itemsize: int, optimizer: str = "adamw",
                            implementation: str = "for-loop", params: int = 1, dtensor: bool = True,
                            on_host: bool = False) -> float:
        """Seconds one optimizer step spends on one trainable parameter, on one device:

            ``E·numel·itemsize / mem_bw + k_p·o_D + k_pp·o + (k_g·o_D + k_gp·o) / params``

        with ``numel`` the elements of the parameter's *local shard* (a parameter sharded over
        ``n`` devices updates ``1/n`` of it on each: the point of ZeRO, Rajbhandari et al., SC
        2020, §5), ``E`` the elements read and written per element
        (:data:`OPTIMIZER_ELEMENTS`: 20 for AdamW), ``o_D`` the device's
        ``dtensor_op_overhead`` where the module's parameters, gradients and states are
        DTensors (``dtensor``; else ``o_D = o``: a plan that replicates every parameter on
        every device holds them as plain tensors), ``o`` its ``op_overhead`` (ops on plain
        tensors: the step counters), and ``k_p``,
        ``k_pp``, ``k_g``, ``k_gp`` the ops :data:`OPTIMIZER_OPS` counts per parameter and per
        parameter group for ``implementation``; a foreach group's ops are shared equally by its
        ``params`` parameters, so that the sum over the parameters is the step. The traffic
        term is the roofline's (Williams et al., CACM 2009) memory side; the update's FLOPs
        (about one per byte) are never the bound.

        Limits: every op's pass is priced from memory, which over-prices a parameter small
        enough that its tensors stay in cache between the per-tensor loop's ops (a few
        hundred KiB on a CPU). Python's own per-parameter work in ``Optimizer.step`` and the per-tensor
        work inside a foreach op are not counted. One parameter group of one dtype and device
        (``torch.optim``'s foreach groups its tensors by device and dtype).

        Args:
            numel: elements of the parameter on this device.
            itemsize: bytes per element of the parameter (and of its gradient and states).
            optimizer: a key of :data:`~autoparallel.solver.memory.OPTIMIZER_STATES`.
            implementation: ``"for-loop"`` or ``"foreach"`` (:func:`optimizer_implementation`).
            params: trainable parameters in the step (the foreach group's size).
            dtensor: whether the parameters are DTensors.
            on_host: the parameter is offloaded: its step runs in host memory
                (``device.host_mem_bw`` instead of ``mem_bw``).

        Raises:
            ValueError: an unknown optimizer or implementation, ``params`` below 1.
        """
        ops = OPTIMIZER_OPS.get((optimizer, implementation))
        if ops is None:
            raise ValueError(f"no optimizer cost for optimizer={optimizer!r}, implementation={implementation!r}; "
                             f"optimizers {sorted(OPTIMIZER_ELEMENTS)}, implementations {OPTIMIZER_IMPLEMENTATIONS}")
        if params < 1:
            raise ValueError(f"optimizer_step_time: params must be >= 1, got {params!r}")
        dev = self.device
        traffic = OPTIMIZER_ELEMENTS[optimizer] * numel * itemsize / (dev.host_mem_bw if on_host else dev.mem_bw)
        o_d = dev.dtensor_op_overhead if dtensor else dev.op_overhead
        per_param = ops.per_param * o_d + ops.per_param_plain * dev.op_overhead
        per_group = ops.per_group * o_d + ops.per_group_plain * dev.op_overhead
        return traffic + per_param + per_group / params

    # ------------------------------------------------------------ compute
    def compute_time(self, target, flops: float, nbytes: float, dtype: torch.dtype | None,
                     requires_grad: bool, grad_calls: int = 1) -> float:
        """Forward plus backward seconds of one op on one device: the roofline time
        (Williams, Waterman, Patterson, CACM 2009) plus ``device.op_overhead`` per call.

        The forward is one call. A matmul-like op's backward is two products like it (two
        calls); ``scaled_dot_product_attention``'s is one call of 2.5 times its forward's work
        (five products against two: torch's ``sdpa_backward_flop_count``), and its FLOPs run at
        ``device.attention_efficiency`` times the matmul peak; any other op's backward is
        ``grad_calls`` calls like its forward (one per input its gradient is computed for). The
        overhead adds: a CPU runs each op's dispatch and kernel one after the other in the
        calling thread; on a GPU a launch overlaps kernels that run longer, so there it
        over-estimates by up to ``op_overhead`` per call. The sum is divided by
        ``device.step_efficiency``, and for the routed experts' op by ``device.experts_efficiency``
        too.

        Args:
            target: the ATen op.
            flops: local forward FLOPs.
            nbytes: local bytes read and written by the forward.
            dtype: the op's output dtype (picks the FLOP/s peak).
            requires_grad: whether a backward runs.
            grad_calls: calls of the backward of an op that is neither matmul-like nor SDPA.
        """
        dev = self.device
        peak = dev.flops_half if dtype in (torch.float16, torch.bfloat16) else dev.flops_fp32
        if target is _SDPA:
            peak *= dev.attention_efficiency
        work = max(flops / peak, nbytes / dev.mem_bw)
        fwd = work + dev.op_overhead
        if not requires_grad:
            total = fwd
        elif target is _SDPA:
            total = fwd + 2.5 * work + dev.op_overhead
        else:
            total = fwd + (2 if target in MATMUL_LIKE else grad_calls) * fwd
        if target is ROUTED_EXPERTS:
            total /= dev.experts_efficiency
        return total / dev.step_efficiency
