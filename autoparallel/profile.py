"""Measuring the mesh a module runs on: collective times per mesh axis, the device's rates.

:func:`profile_mesh` (every rank calls it) times all-reduce, all-gather, reduce-scatter and
all-to-all over the process group of each mesh axis (and, on a mesh of two or more axes of
more than one device, an all-reduce and an all-to-all over the world's group: what a gradient
bucket and an expert exchange spanning the world run, ``WORLD_COLLECTIVES``) for message sizes doubling from ``min_bytes`` up to a bound set by free
memory, ``max_bytes`` and a time budget; each point
is the median over repetitions of the slowest rank. Per axis and collective it fits Hockney's
line and keeps the table (:class:`~autoparallel.solver.costs.CollectiveTable`); with the
device's achieved matmul FLOP/s and memory bandwidth (:func:`calibrate_device`) this is a
:class:`~autoparallel.solver.costs.CommProfile`, stored in the cache folder
(``profiles/mesh-<key>.json``, the key hashing backend, device type and name, world size,
mesh shape, the host of every rank in mesh order and the torch version) and loaded by the
next run instead of measuring again. Device rates are cached on their own
(``profiles/device-<key>.json``), once per device kind.

Every collective and every decision that changes which collectives run next is taken from
values all ranks agree on (reduced over the world), so the ranks never diverge.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import socket
import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.flop_counter import sdpa_flop_count

from . import cache
from .mesh import MeshSpec
from .options import PlanOptions
from .runtime_kernels.experts import ROUTED_EXPERTS, routed_experts, routed_experts_flops
from .solver.pipeline import plan_traced
from .tracer import capture
from .solver.costs import COLLECTIVES, PROFILE_FORMAT, WORLD_COLLECTIVES, CollectiveTable, CommProfile, CostModel, DevicePreset, profile_key

log = logging.getLogger(__name__)

_MATMUL_DTYPES = (torch.float32, torch.bfloat16)  # bf16's rate stands for every 16-bit float
_MAX_MATMUL_N = 8192
_BATCH_S = 1e-3  # a timed batch of back-to-back collectives lasts about this long or more
_MAX_CALLS = 16
_PLAUSIBLE_EFFICIENCY = (0.1, 3.0)  # a step efficiency outside it was measured under load (one cached 5.27)
_SIZE_STEP = 4  # measured message sizes grow by this factor: 4 KiB, 16 KiB, ... (8 sizes to 256 MiB)
_WINDOW_S = 0.03  # a timed sample of the device's rates repeats its op for at least this long
_CHAIN = 32  # ops in the chain whose forward and backward time the per-op overhead


def profile_mesh(device_mesh, *, cache_dir=None, time_budget: float = 3.0, calibration_budget: float = 2.0,
                 min_bytes: int = 4096, max_bytes: int = 256 * 2**20, repeats: int = 5,
                 refresh: bool = False) -> CommProfile:
    """Measure (or load from the cache) the costs of ``device_mesh``; every rank calls it.

    Args:
        device_mesh: a ``torch.distributed.device_mesh.DeviceMesh`` over a real process group.
        cache_dir: the cache folder (see :func:`autoparallel.cache.cache_path`); ``False``
            neither reads nor writes a profile.
        time_budget: seconds for the collective sweep, shared evenly among the (axis,
            collective) pairs (the all-reduce over the world, when measured, gets two shares); each pair stops growing its size (by 4x) when the next size
            would overrun its share (it measures at least three sizes).
        calibration_budget: seconds for measuring the device's rates, when not cached.
        min_bytes / max_bytes: the smallest and (at most) largest message in bytes; the
            largest is also bounded by a quarter of the free memory of the slowest rank.
        repeats: timed batches per size; the median is kept.
        refresh: measure again even when a cached profile exists (and replace it).

    Returns:
        the :class:`~autoparallel.solver.costs.CommProfile`, identical on every rank.

    Raises:
        TypeError: ``device_mesh`` is not a DeviceMesh.
        RuntimeError: no initialized process group.
        ValueError: a mesh that does not span the world, a simulated process group (the ``fake`` backend has no network to
            measure), a budget that is not positive, ``min_bytes``/``max_bytes`` not with
            ``4 <= min_bytes`` and ``2 * min_bytes <= max_bytes``, ``repeats`` below 1.
    """
    _check_arguments(device_mesh, time_budget, calibration_budget, min_bytes, max_bytes, repeats)
    identity = mesh_identity(device_mesh)
    folder = cache.cache_path(cache_dir)
    path = cache.profile_path(folder, f"mesh-{profile_key(identity)}")
    if not refresh:
        text = _from_rank0(lambda: _cached_text(path, CommProfile.from_json, "mesh profile"))
        if text is not None:
            log.info("loaded the mesh profile from the cache: %s", path)
            return CommProfile.from_json(text)
    log.info("profiling the mesh %s (about %.0f s)", tuple(device_mesh.mesh.shape), time_budget + calibration_budget)
    t0 = time.perf_counter()
    device = _local_device(device_mesh.device_type)
    rates = _calibrated(device, folder, identity, calibration_budget)
    max_bytes = _size_bound(device, max_bytes, min_bytes, _ranks_on_host(identity))
    shape = tuple(device_mesh.mesh.shape)
    pairs = [(a, k) for a in range(len(shape)) if shape[a] > 1 for k in COLLECTIVES]
    if len({a for a, _ in pairs}) > 1:  # gradient buckets and expert exchanges spanning the world
        pairs += [(None, k) for k in WORLD_COLLECTIVES]

    def group(a):
        return dist.group.WORLD if a is None else device_mesh.get_group(a)

    share = time_budget / (len(pairs) + 1)  # the world's all-reduce (DDP's gradient buckets) gets two shares
    tables = {(a, k): _measure(k, group(a), dist.get_world_size() if a is None else shape[a], device,
                               share * (2 if (a, k) == (None, "all_reduce") else 1), min_bytes, max_bytes, repeats)
              for a, k in pairs}
    names = device_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(len(shape)))
    seconds = _agree([time.perf_counter() - t0], dist.ReduceOp.MAX, device)[0]
    profile = CommProfile(identity, names, tables, rates, round(seconds, 3))
    if dist.get_rank() == 0 and path is not None:
        cache.write_text(path, profile.to_json(), "mesh profile")
    log.info("%s", profile)
    return profile


def _check_arguments(device_mesh, time_budget, calibration_budget, min_bytes, max_bytes, repeats) -> None:
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"profile_mesh: device_mesh must be a torch.distributed.device_mesh.DeviceMesh, not "
                        f"{type(device_mesh).__name__}")
    if not dist.is_initialized():
        raise RuntimeError("profile_mesh needs an initialized process group (torchrun / init_process_group)")
    if device_mesh.size() != dist.get_world_size():
        raise ValueError(f"profile_mesh: the mesh has {device_mesh.size()} devices but the world {dist.get_world_size()} "
                         "ranks; profile a mesh over every rank")
    if dist.get_backend() == "fake":
        raise ValueError("profile_mesh: the fake process group simulates ranks in one process and has no network "
                         "to measure; plan simulated meshes with a preset (CostModel('a100')) or a saved profile "
                         "(CostModel.from_profile(path))")
    for what, v in (("time_budget", time_budget), ("calibration_budget", calibration_budget)):
        if not (isinstance(v, (int, float)) and v > 0):
            raise ValueError(f"profile_mesh: {what} must be a positive number of seconds, got {v!r}")
    if not (isinstance(min_bytes, int) and isinstance(max_bytes, int) and 4 <= min_bytes and 2 * min_bytes <= max_bytes):
        raise ValueError(f"profile_mesh: need ints with 4 <= min_bytes and 2 * min_bytes <= max_bytes, got "
                         f"min_bytes={min_bytes!r}, max_bytes={max_bytes!r}")
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"profile_mesh: repeats must be an int >= 1, got {repeats!r}")


def mesh_identity(device_mesh) -> dict:
    """What a profile of ``device_mesh`` is valid for (the fields of
    :data:`~autoparallel.solver.costs.IDENTITY_FIELDS`), the same on every rank: the host
    name of every rank in mesh order (which axes cross hosts) and the set of device names
    (a collective over the world)."""
    world = dist.get_world_size()
    local = (socket.gethostname(), _device_name(device_mesh.device_type))
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    order = device_mesh.mesh.flatten().tolist()
    return {"backend": str(dist.get_backend()), "device_type": device_mesh.device_type,
            "device_name": ", ".join(sorted({name for _, name in gathered})), "world_size": world,
            "mesh_shape": list(device_mesh.mesh.shape), "hosts": [gathered[r][0] for r in order],
            "torch": torch.__version__}


def _device_name(device_type: str) -> str:
    if device_type != "cpu":
        return torch.get_device_module(device_type).get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    except OSError:  # not Linux
        names = []
    return names[0] if names else (platform.processor() or platform.machine() or "cpu")


def _local_device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.get_device_module(device.type).synchronize()


def _agree(values: list[float], op, device: torch.device) -> list[float]:
    """``values`` reduced over the world with ``op`` (MAX, MIN): what every rank sees."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def _from_rank0(produce):
    """``produce()`` run on rank 0 (text or None), broadcast to every rank."""
    box = [produce() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _cached_text(path, parse, what: str) -> str | None:
    """The cached text at ``path`` when ``parse`` accepts it; a file it rejects is ignored
    with a warning (and replaced after measuring)."""
    text = None if path is None else cache.read_text(path, what)
    if text is None:
        return None
    try:
        parse(text)
    except ValueError as e:
        log.warning("ignoring cached %s %s (%s); measuring again", what, path, e)
        return None
    return text


def _free_bytes(device: torch.device, ranks_on_host: int) -> int:
    if device.type != "cpu":
        return torch.get_device_module(device.type).mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // ranks_on_host


def _size_bound(device: torch.device, max_bytes: int, min_bytes: int, ranks_on_host: int) -> int:
    """The largest message to measure: ``max_bytes``, at most a quarter of the free memory of
    the slowest rank (an all-to-all holds two buffers of the message), at least ``2 * min_bytes``."""
    free = _agree([float(_free_bytes(device, ranks_on_host))], dist.ReduceOp.MIN, device)[0]
    return max(2 * min_bytes, min(max_bytes, int(free) // 4))


# ------------------------------------------------------------------ collectives
def _measure(kind: str, group, n: int, device: torch.device, budget: float, min_bytes: int, max_bytes: int,
             repeats: int) -> CollectiveTable:
    """The table of ``kind`` over ``group`` (``n`` ranks): sizes growing by :data:`_SIZE_STEP`
    from ``min_bytes`` while the next one fits in ``budget`` seconds (at least three) and
    ``max_bytes``; lookups interpolate between them (:class:`CollectiveTable`)."""
    sizes, times, spent, calls, size = [], [], 0.0, 4, min_bytes
    while size <= max_bytes or len(sizes) < 2:
        t0 = time.perf_counter()
        nbytes, local = _time_collective(kind, group, n, size, device, repeats, calls)
        t, wall = _agree([local, time.perf_counter() - t0], dist.ReduceOp.MAX, device)
        if not sizes or nbytes > sizes[-1]:
            sizes.append(nbytes)
            times.append(t)
        spent += wall
        if len(sizes) >= 3 and spent + 1.2 * wall * _growth(times) > budget:
            break
        size *= _SIZE_STEP
        calls = max(1, min(_MAX_CALLS, int(_BATCH_S / t)))
    return CollectiveTable.fit(sizes, times)


def _growth(times: list[float]) -> float:
    """How many times longer the next size's collective takes than the last one's, on the line
    through the last two measured times (sizes :data:`_SIZE_STEP` apart): about 1 while the
    latency dominates, :data:`_SIZE_STEP` once the bandwidth does."""
    if len(times) < 2:
        return _SIZE_STEP
    slope_part = _SIZE_STEP * max(0.0, times[-1] - times[-2])  # (t - t_prev) / (b - b/STEP) * (STEP b - b)
    return min(_SIZE_STEP, 1.0 + slope_part / times[-1])


def _time_collective(kind: str, group, n: int, size: int, device: torch.device, repeats: int,
                     calls: int) -> tuple[int, float]:
    """``(bytes, seconds)``: the message size in the byte convention of
    :meth:`~autoparallel.solver.costs.CostModel.collective_time` (all-reduce: the buffer;
    all-gather: the gathered output; reduce-scatter: the input; all-to-all: the buffer per
    rank) and this rank's median over ``repeats`` batches of ``calls`` back-to-back
    collectives, each batch started by a barrier of the group."""
    numel = max(n, size // 4 // n * n)  # float32 elements, a multiple of the group size
    buf = torch.zeros(numel, device=device)  # zeros: repeated sums stay finite
    if kind == "all_reduce":
        def run():
            dist.all_reduce(buf, group=group)
    elif kind == "all_gather":
        part = torch.zeros(numel // n, device=device)

        def run():
            dist.all_gather_single(buf, part, group=group)
    elif kind == "reduce_scatter":
        part = torch.empty(numel // n, device=device)

        def run():
            dist.reduce_scatter_single(part, buf, group=group)
    else:
        out = torch.empty_like(buf)

        def run():
            dist.all_to_all_single(out, buf, group=group)
    run()  # warm-up: connects the group, allocates
    samples = []
    for _ in range(repeats):
        dist.barrier(group=group)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        _sync(device)
        samples.append((time.perf_counter() - t0) / calls)
    return numel * 4, statistics.median(samples)


# ------------------------------------------------------------------ compute
def calibrate_device(device, *, time_budget: float = 2.0, ranks_on_host: int = 1) -> DevicePreset:
    """The achieved rates of ``device`` (this process alone), as a :class:`DevicePreset`.

    Matmul FLOP/s per dtype: square GEMMs ``n × n × n`` (``2n³`` FLOPs) from ``n = 256``,
    doubling while the next fits in the dtype's share of the budget (up to 8192); the best
    median rate is kept (fp32, and bf16 for every 16-bit float). Memory bandwidth: a copy
    (2 bytes moved per byte) and a pointwise add (3) of a buffer far larger than caches; the
    better rate. Per-op overhead: a chain of 32 multiplications of a one-element tensor,
    forward and backward, over its 64 calls (2.8 µs a forward call and 4.9 µs a backward one
    on the 2-core test VM, torch 2.13; on a GPU, launches behind which no kernel runs
    longer). DTensor op overhead: AdamW's eight update ops on one-element DTensors over a
    one-device mesh, per op (:func:`_dtensor_op_overhead`). Attention efficiency:
    ``scaled_dot_product_attention`` forward and backward on ``[4, 8, 256, 64]`` (fp32 on a CPU,
    bf16 elsewhere), its FLOP/s over that of the matmul at its peak size, the two timed in
    alternation (:func:`_attention_efficiency`). Host link and host memory: :func:`_host_rates`. Step
    efficiency: a reference training step timed against
    what the roofline of these rates predicts for it (:func:`_step_efficiency`); experts efficiency
    likewise for the routed experts' kernel (:func:`_experts_efficiency`). Each rate is the median of 3
    samples, each repeating its op for at least 30 ms: longer than a scheduler's time slice,
    so processes that share cores (4 ranks on 2 cores) measure their share and not a lucky
    slice alone. Memory: the device's total, or on CPU the host's divided by
    ``ranks_on_host``. Core share: on CPU, the cores over ``ranks_on_host`` times the
    intra-op threads, at most 1 (:func:`_core_share`). Roofline use: Williams, Waterman, Patterson, CACM 2009.

    Args:
        device: a ``torch.device`` or its string.
        time_budget: seconds, shared by the two matmul dtypes and the bandwidth runs.
        ranks_on_host: processes sharing this host's memory.

    Raises:
        RuntimeError: as torch raises for a device that cannot be used.
    """
    device = torch.device(device)
    with _rng_kept(device):  # the caller's random streams are the same with or without a cached profile
        return _calibrate(device, time_budget, ranks_on_host)


def _rng_kept(device: torch.device):
    """A context that restores the CPU's random state (and ``device``'s, if not a CPU) on exit."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    index = device.index if device.index is not None else torch.get_device_module(device.type).current_device()
    return torch.random.fork_rng(devices=[index], device_type=device.type)


def _calibrate(device: torch.device, time_budget: float, ranks_on_host: int,
               agree: Callable[[float], float] = lambda x: x) -> DevicePreset:
    """:func:`calibrate_device`'s measurements. ``agree(x)`` returns the largest ``x`` of the
    ranks calibrating at once, and so passes them together (every rank calls it as often):
    before each phase and each matmul size, so that each measurement runs on all of them at the
    same time, as a training step does, and the ranks leave the matmul sizes together. Where
    ranks share cores, what one measures depends on what the others run meanwhile: without
    a barrier per phase, one 4-rank calibration on 2 cores priced steps 1.3x too slow and the
    next 0.66x; with one per phase only, a rank that left the sizes early left the cores to the
    others' largest sizes, and the 4 ranks' fp32 rate came out 5.4e10 in one calibration and
    3.4e10 in the next on the same machine."""
    share = time_budget / (len(_MATMUL_DTYPES) + 1)
    peaks = []
    for dtype in _MATMUL_DTYPES:
        agree(0.0)
        peaks.append(_matmul_rate(device, dtype, share, agree))
    (fp32, n32), (half, n16) = peaks
    n_attention = n32 if device.type == "cpu" else n16  # the dtype SDPA is timed in
    if device.type == "cpu":
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // max(1, ranks_on_host)
    else:
        memory = torch.get_device_module(device.type).get_device_properties(device).total_memory
    measured = []
    for phase in (lambda: _memory_rate(device, share, ranks_on_host, agree), lambda: _op_overhead(device, agree),
                  lambda: _dtensor_op_overhead(device, agree), lambda: _attention_efficiency(device, n_attention, agree)):
        agree(0.0)
        measured.append(phase())
    bw, overhead, dtensor, attention = measured
    link, host_bw = _host_rates(device, bw, share)
    rates = DevicePreset(f"measured {_device_name(device.type)}", fp32, half, bw, float(memory), overhead, dtensor,
                         attention, host_link_bw=link, host_mem_bw=host_bw,
                         core_share=_core_share(device, ranks_on_host))
    agree(0.0)
    rates = dataclasses.replace(rates, step_efficiency=_step_efficiency(device, rates, agree))
    agree(0.0)
    return dataclasses.replace(rates, experts_efficiency=_experts_efficiency(device, rates, agree))


def _core_share(device: torch.device, ranks_on_host: int) -> float:
    """The share of a core each compute thread gets with every rank of the host busy: the
    cores this process may run on over ``ranks_on_host`` times its intra-op threads, at
    most 1; 1 on a GPU (:attr:`DevicePreset.core_share`)."""
    if device.type != "cpu":
        return 1.0
    return min(1.0, len(os.sched_getaffinity(0)) / (max(1, ranks_on_host) * torch.get_num_threads()))


def _host_rates(device: torch.device, device_bw: float, seconds: float) -> tuple[float, float]:
    """``(host_link_bw, host_mem_bw)`` in bytes/s: a 64 MiB copy from pinned host memory to
    ``device`` and the host's memory rate (:func:`_memory_rate`); on a CPU, host and device are
    one memory, whose copy moves two bytes per byte copied (``device_bw / 2``, ``device_bw``)."""
    if device.type == "cpu":
        return device_bw / 2, device_bw
    src = torch.empty(2**24, dtype=torch.float32, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    link = src.nbytes / _median_time(lambda: dst.copy_(src, non_blocking=True), device)
    return link, _memory_rate(torch.device("cpu"), seconds, 1)


def _median_time(fn, device: torch.device, repeats: int = 3, agree: Callable[[float], float] = lambda x: x) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` samples of the same number of
    calls: as many as a first, untimed run needed to pass ``_WINDOW_S``, calling ``fn`` in
    doubling batches (one synchronization per batch), and where ``agree`` spans several ranks
    (:func:`_calibrate`), the most any of them needed, every sample started together. Ranks
    that share cores then run for the whole of every sample; with a window each, one that had
    passed its window left the cores to the others' last batch, which ran faster."""
    fn()  # warm-up
    calls, batch = 0, 1
    agree(0.0)
    _sync(device)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < _WINDOW_S:
        for _ in range(batch):
            fn()
        calls += batch
        _sync(device)
        batch *= 2
    calls = int(agree(float(calls)))
    samples = []
    for _ in range(repeats):
        agree(0.0)
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        samples.append((time.perf_counter() - t0) / calls)
    return max(statistics.median(samples), 1e-9)


def _op_overhead(device: torch.device, agree: Callable[[float], float] = lambda x: x) -> float:
    """Seconds per op call: a chain of ``_CHAIN`` multiplications of a one-element tensor,
    its forward and its backward (``2 · _CHAIN`` calls), timed by :func:`_median_time`."""
    x = torch.ones(1, device=device, requires_grad=True)

    def chain():
        y = x
        for _ in range(_CHAIN):
            y = torch.mul(y, 1.0)
        y.backward()

    return _median_time(chain, device, agree=agree) / (2 * _CHAIN)


def _dtensor_op_overhead(device: torch.device, agree: Callable[[float], float] = lambda x: x) -> float:
    """Seconds per op on DTensors: the eight ops of AdamW's per-tensor update (torch's
    ``_single_tensor_adam``: a multiplication by a Python number for the weight decay,
    ``lerp_``, ``mul_``, ``addcmul_``, ``sqrt``, a division, ``add_``, ``addcdiv_``) on
    one-element DTensors replicated over a mesh of this process' one device, timed by
    :func:`_median_time`, per op. The ops differ (a multiplication by a Python number takes
    about three times a ``lerp_``: DTensor wraps the number as a tensor), so the mix an
    optimizer runs is what is timed. The mesh has no process group of its own (DeviceMesh's
    private ``_init_backend=False`` and ``_rank``): element-wise ops on replicated DTensors
    communicate nothing, so this works with or without an initialized process group and
    never talks to the other ranks."""
    from torch.distributed.tensor import DTensor, Replicate

    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = DeviceMesh(device.type, [rank], _init_backend=False, _rank=rank)
    p, g, m, v = (DTensor.from_local(torch.ones(1, device=device), mesh, [Replicate()], run_check=False)
                  for _ in range(4))

    def update():
        p.mul_(1.0)
        m.lerp_(g, 0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        denom = (v.sqrt() / 1.0).add_(1e-8)
        p.addcdiv_(m, denom, value=-1e-3)

    return _median_time(update, device, agree=agree) / 8


class _ReferenceBlocks(torch.nn.Module):
    """The reference of :func:`_step_efficiency`: two pre-norm transformer encoder layers of
    ``torch.nn`` (width 512, 8 heads, feed-forward 2048, no dropout) and a mean-square loss."""

    def __init__(self, width: int = 512):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(width, width // 64, 4 * width, dropout=0.0, batch_first=True,
                                             norm_first=True) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _step_efficiency(device: torch.device, rates: DevicePreset,
                     agree: Callable[[float], float] = lambda x: x) -> float:
    """The forward and backward of :class:`_ReferenceBlocks` on a ``[2, 128, 512]`` input as
    planned for one device with ``rates`` (the estimate's compute less the optimizer step), over
    its measured time (:func:`_median_time`): the share of the roofline's rates a training step
    achieves in place (:attr:`DevicePreset.step_efficiency`)."""
    with torch.device(device):
        model, x = _ReferenceBlocks(), torch.randn(2, 128, 512)
    meta = (torch.empty(x.shape, device="meta"),)
    options = PlanOptions(cost_model=CostModel(rates), cache_dir=False, device=device.type)
    estimate = plan_traced(capture(model, meta, device=device.type), MeshSpec((1,)), options).estimate
    predicted = estimate.compute_s - estimate.optimizer_s
    return predicted / _median_time(lambda: model(x).backward(), device, agree=agree)


def _experts_efficiency(device: torch.device, rates: DevicePreset,
                        agree: Callable[[float], float] = lambda x: x) -> float:
    """The routed experts' kernel (:func:`~autoparallel.runtime_kernels.experts.routed_experts`,
    what the per-device code runs) forward and backward on 512 tokens of hidden size 256, each
    routed to 2 of 8 experts of intermediate size 512 (routing drawn at random, about 128 rows
    per expert; fp32 on a CPU, bf16 elsewhere), as :meth:`CostModel.compute_time` prices it
    under ``rates`` with this efficiency 1, over its measured time (:func:`_median_time`):
    :attr:`DevicePreset.experts_efficiency`. The 2-core test VM measured 0.60-0.65 alone."""
    tokens, hidden, inter, experts, k = 512, 256, 512, 8, 2
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    with torch.device(device):
        x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
        index = torch.rand(tokens, experts).topk(k).indices
        weights = torch.rand(tokens, k, dtype=dtype, requires_grad=True)
        gate_up = torch.randn(experts, 2 * inter, hidden, dtype=dtype).mul_(0.02).requires_grad_(True)
        down = torch.randn(experts, hidden, inter, dtype=dtype).mul_(0.02).requires_grad_(True)
    flops = routed_experts_flops(*(t.shape for t in (x, index, weights, gate_up, down)))
    traffic = sum(t.nbytes for t in (x, index, weights, gate_up, down)) + x.nbytes  # inputs and output
    priced = CostModel(rates).compute_time(ROUTED_EXPERTS, flops, traffic, dtype, True)
    return priced / _median_time(lambda: routed_experts(x, index, weights, gate_up, down, "silu").sum().backward(),
                                 device, agree=agree)


def _attention_efficiency(device: torch.device, n: int, agree: Callable[[float], float] = lambda x: x) -> float:
    """FLOP/s of ``scaled_dot_product_attention``'s forward and backward on q, k, v of
    ``[4, 8, 256, 64]`` over the FLOP/s of an ``n × n`` matmul, ``n`` the size at which
    :func:`_matmul_rate` found the peak (fp32 on a CPU, bf16 elsewhere: the dtype its kernels
    are timed in). The two are timed in alternation, 3 samples each, and the median of the
    3 ratios is kept: a load that comes and goes (other processes on shared cores) slows
    both alike. Timed apart, a 2-core machine loaded by a second test run measured 14.6 for
    what is 0.5-0.6 unloaded. The attention's work is 3.5 times its forward's FLOPs (torch's
    ``sdpa_flop_count``): the backward does 2.5 times the forward's."""
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    q, k, v = (torch.randn(4, 8, 256, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=dtype)

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = 3.5 * sdpa_flop_count(q.shape, k.shape, v.shape)
    ratios = [flops / _median_time(step, device, 1, agree)
              / (2 * n**3 / _median_time(lambda: torch.mm(a, b, out=out), device, 1, agree)) for _ in range(3)]
    return statistics.median(ratios)


def _matmul_rate(device: torch.device, dtype: torch.dtype, budget: float,
                 agree: Callable[[float], float] = lambda x: x) -> tuple[float, int]:
    """``(FLOP/s, n)``: the best rate of ``n × n`` matmuls in ``dtype``, ``n`` doubling from
    256 while ``budget`` seconds allow (on the slowest of the ranks ``agree`` spans, which
    start each size and stop together: :func:`_calibrate`), and the ``n`` that reached it."""
    (best, best_n), spent, n = (0.0, 256), 0.0, 256
    while n <= _MAX_MATMUL_N:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        t0 = time.perf_counter()
        t = _median_time(lambda: torch.mm(a, b, out=out), device, agree=agree)
        if 2 * n**3 / t > best:
            best, best_n = 2 * n**3 / t, n
        spent += time.perf_counter() - t0
        if agree(float(spent + 4 * max(8 * t, _WINDOW_S) > budget)):  # the next size does 8x the work
            break
        n *= 2
    return best, best_n


def _memory_rate(device: torch.device, budget: float, ranks_on_host: int,
                 agree: Callable[[float], float] = lambda x: x) -> float:
    nbytes = 64 * 2**20 if device.type == "cpu" else 512 * 2**20
    nbytes = max(2**20, min(nbytes, _free_bytes(device, ranks_on_host) // 8))
    a = torch.ones(nbytes // 4, device=device)
    b, c = torch.ones_like(a), torch.empty_like(a)
    repeats = 3 if budget > 0.5 else 1
    copy = 2 * nbytes / _median_time(lambda: c.copy_(a), device, repeats, agree)
    add = 3 * nbytes / _median_time(lambda: torch.add(a, b, out=c), device, repeats, agree)
    return max(copy, add)


def _calibrated(device: torch.device, folder, identity: dict, budget: float) -> DevicePreset:
    """The device's rates: cached per device kind (device type and names, torch version, CPU
    threads, ranks per host), else measured on every rank at once (as training runs): the
    rates of the rank whose training step is slowest (:func:`_slowest_rank`), and the least
    memory of any rank."""
    kind = {"device_type": identity["device_type"], "device_name": identity["device_name"],
            "torch": identity["torch"], "threads": torch.get_num_threads(), "ranks_on_host": _ranks_on_host(identity),
            "format": PROFILE_FORMAT}
    key = hashlib.sha256(json.dumps(kind, sort_keys=True).encode()).hexdigest()[:20]
    path = cache.profile_path(folder, f"device-{key}")
    text = _from_rank0(lambda: _cached_text(path, _device_from_json, "device profile"))
    if text is not None:
        return _device_from_json(text)
    with _rng_kept(device):  # as calibrate_device, the ranks passing each phase and matmul size together
        mine = _calibrate(device, budget, kind["ranks_on_host"],
                          agree=lambda x: _agree([x], dist.ReduceOp.MAX, device)[0])
    memory = _agree([mine.memory], dist.ReduceOp.MIN, device)[0]
    rates = dataclasses.replace(_slowest_rank(mine, device), memory=memory)
    plausible = _PLAUSIBLE_EFFICIENCY[0] <= rates.step_efficiency <= _PLAUSIBLE_EFFICIENCY[1]
    if not plausible:  # measured while other work shared the cores: used for this run, never cached
        log.warning("device calibration: step efficiency %.2f is outside %s (other work on the cores?); "
                    "not caching it", rates.step_efficiency, _PLAUSIBLE_EFFICIENCY)
    if dist.get_rank() == 0 and path is not None and plausible:
        cache.write_text(path, json.dumps(rates.to_json()), "device profile")
    return rates


def _slowest_rank(mine: DevicePreset, device: torch.device) -> DevicePreset:
    """The calibration of the rank whose training step runs slowest: the least matmul rate
    times step efficiency (the reference step's achieved rate), every rate of that one rank.

    The efficiencies are ratios to the same rank's own rates, measured moments apart; where
    ranks share cores (4 ranks on 2) what a rank measures depends on what the others run at
    that moment, so the least rate of one rank and the least efficiency of another are not
    one machine: taking each least on its own priced this VM's 4-rank steps 1.3x too slow."""
    fields = ("flops_fp32", "flops_half", "mem_bw", "op_overhead", "dtensor_op_overhead", "attention_efficiency",
              "host_link_bw", "host_mem_bw", "experts_efficiency", "step_efficiency")  # step_efficiency last: the argmin reads it
    mine_row = torch.tensor([float(getattr(mine, f)) for f in fields], dtype=torch.float64, device=device)
    rows = torch.empty(dist.get_world_size() * len(fields), dtype=torch.float64, device=device)
    dist.all_gather_single(rows, mine_row)
    rows = rows.view(-1, len(fields))
    slowest = rows[int(torch.argmin(rows[:, 0] * rows[:, -1]))].tolist()
    return dataclasses.replace(mine, **dict(zip(fields, slowest)))


def _device_from_json(text: str) -> DevicePreset:
    try:
        d = json.loads(text)
    except ValueError as e:
        raise ValueError(f"not JSON: {e}") from None
    return DevicePreset.from_json(d)


def _ranks_on_host(identity: dict) -> int:
    """The most ranks any host runs."""
    hosts = identity["hosts"]
    return max(hosts.count(h) for h in hosts)
