"""The one-line API: orchestration of the stages (the only module that knows them all)."""

from __future__ import annotations

import logging
import time

import torch.distributed as dist
import torch.nn as nn
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

from . import cache
from .codegen import ParallelModule
from .errors import AutoParallelError, MeshMismatchError
from .mesh import MeshSpec
from .passes import apply_plan
from .passes.checkpoint import apply_checkpointing
from .solver.remat import region_from_json
from .placement import R
from .plan import Plan
from .solver import CostModel
from .solver.memory import DEFAULT_OPTIMIZER, MemoryModel, parse_bytes
from .solver.planner import Planner
from .strategies import StrategyGenerator
from .strategies.coverage import CoverageReport, coverage_of
from .tracer import ColoTracer

log = logging.getLogger("autoparallel")


def _plan_traced(traced, mesh: MeshSpec, *, cost_model, strict, solver, time_limit, parallelism,
                 share_blocks, cache_dir, memory_budget=None, optimizer=DEFAULT_OPTIMIZER, device="cpu"):
    cost_model = cost_model or CostModel()
    budget = parse_bytes(memory_budget) if memory_budget is not None else None
    options = {"strict": strict, "solver": solver, "parallelism": parallelism, "share_blocks": share_blocks,
               "memory_budget": budget, "optimizer": optimizer, "device": device}
    folder = cache.cache_path(cache_dir)
    key = cache.plan_key(traced, mesh, cost_model, options) if folder is not None else ""
    hit = cache.load(folder, key)
    if hit is not None:
        hit.solver_stats["cache"] = "hit"
        return hit
    t0 = time.perf_counter()
    gen = StrategyGenerator(mesh.shape, strict=strict)
    strategies = gen.generate(traced.gm)
    if parallelism == "data":
        repl = (R,) * mesh.ndim
        for node in strategies:
            if node.op == "get_attr":
                strategies[node] = [s for s in strategies[node] if s.outputs[0] == repl]
    elif parallelism != "auto":
        raise ValueError(f"parallelism must be 'auto' or 'data', not {parallelism!r}")
    t1 = time.perf_counter()
    log.info("strategies: %d nodes, %d strategies (%.2f s)", len(strategies),
             sum(len(v) for v in strategies.values()), t1 - t0)
    names = dict(traced.params)
    names.update(traced.buffers)
    t2 = time.perf_counter()
    memory = MemoryModel(traced.gm, gen.aliases, mesh.shape, optimizer=optimizer, device=device,
                         traced_on=traced.device)
    t_memory = time.perf_counter() - t2
    planner = Planner(traced.gm, strategies, gen.aliases, mesh, cost_model, names, share_blocks=share_blocks,
                      memory=memory)
    plan = planner.solve(solver=solver, time_limit=time_limit, memory_budget=budget)
    st = plan.solver_stats
    log.info("ILP: %d node vars, %d edge vars, solved by %s in %.2f s (costs %.2f s); estimated step %.3g s",
             st["binary_vars"], st["edge_vars"], st["solver"], st["solve_s"], st["costs_s"],
             plan.estimate["step_time_s"])
    plan.solver_stats["strategies_s"] = t1 - t0
    plan.solver_stats["memory_s"] = t_memory
    plan.solver_stats["fallback_ops"] = sorted(gen.fallbacks)
    plan.solver_stats["cache"] = "miss" if folder is not None else "off"
    cache.store(folder, key, plan)
    return plan


def plan(model: nn.Module, meta_inputs, *, mesh_shape=None, mesh: MeshSpec | None = None,
         cost_model: CostModel | None = None, strict: bool = False, solver: str = "cbc",
         time_limit: float = 60.0, parallelism: str = "auto", share_blocks: bool = True,
         cache_dir=None, memory_budget: int | str | None = None, optimizer: str = DEFAULT_OPTIMIZER,
         device: str = "cpu") -> Plan:
    """Plan how to parallelize ``model`` without any process group.

    Args:
        model: the model (real or meta-device weights).
        meta_inputs: dict of keyword arguments or tuple of positional ones, tensors on the
            meta device (or FakeTensors) with **global** shapes.
        mesh_shape: devices per mesh axis, e.g. ``(2, 4)``; or give ``mesh``.
        mesh: a :class:`MeshSpec` (shape, axis names, alpha/beta).
        cost_model: a :class:`CostModel` (default: A100 preset).
        strict: error on ops without a sharding rule instead of replicating them.
        solver: ``"cbc"`` or ``"highs"``.
        time_limit: seconds for the ILP solver.
        parallelism: ``"auto"`` (search everything) or ``"data"`` (parameters replicated:
            prices plain data parallelism under the same cost model).
        share_blocks: one set of ILP variables for identical repeated blocks (layers).
        cache_dir: plan cache folder; ``None`` for the default (``AUTOPARALLEL_CACHE_DIR``
            or ``~/.cache/autoparallel``), ``False`` for no cache (see :mod:`autoparallel.cache`).
        memory_budget: peak bytes per device the training step may use (an int, or a
            string such as ``"12GiB"``); ``None`` for no limit. The peak is modelled by
            :mod:`autoparallel.solver.memory` (parameters, gradients, optimizer states,
            saved activations and temporaries with their liveness).
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd_momentum"`` or ``"sgd"``:
            how many state tensors per parameter the memory model counts.
        device: device type the module will run on; selects the kernels whose saved
            tensors the memory model measures (e.g. SDPA's).

    Returns:
        the :class:`Plan`; ``plan.solver_stats`` includes per-stage seconds;
        ``plan.estimate["memory"]`` the modelled peak and its breakdown.

    Raises:
        CaptureError, ShardingRuleError, InfeasiblePlanError: see :mod:`autoparallel.errors`
            (a budget no plan fits raises InfeasiblePlanError with the smallest reachable peak).
        ValueError: an unreadable ``memory_budget`` or unknown ``optimizer``.
    """
    if mesh is None:
        if mesh_shape is None:
            raise ValueError("plan() needs mesh_shape=(...) or mesh=MeshSpec(...)")
        mesh = MeshSpec(tuple(mesh_shape))
    t0 = time.perf_counter()
    traced = ColoTracer().trace(model, meta_inputs)
    t_trace = time.perf_counter() - t0
    log.info("traced %s: %d graph nodes (%.2f s)", type(model).__name__, len(traced.gm.graph.nodes), t_trace)
    p = _plan_traced(traced, mesh, cost_model=cost_model, strict=strict, solver=solver,
                     time_limit=time_limit, parallelism=parallelism, share_blocks=share_blocks, cache_dir=cache_dir,
                     memory_budget=memory_budget, optimizer=optimizer, device=device)
    p.solver_stats["trace_s"] = t_trace
    return p


def coverage(model: nn.Module, meta_inputs) -> CoverageReport:
    """Every ATen op of ``model``'s captured graph, with where its strategies come from (own
    rule, replicated by rule, replicate fallback) and the module paths that use it.

    Raises:
        CaptureError: when torch.export cannot capture the model.
    """
    return coverage_of(ColoTracer().trace(model, meta_inputs).gm)


def _is_simulated() -> bool:
    return dist.get_backend() == "fake"


def autoparallelize(model: nn.Module, meta_inputs, *, device_mesh, cost_model: CostModel | None = None,
                    strict: bool = False, solver: str = "cbc", time_limit: float = 60.0,
                    parallelism: str = "auto", mesh_spec: MeshSpec | None = None, share_blocks: bool = True,
                    cache_dir=None, memory_budget: int | str | None = None,
                    optimizer: str = DEFAULT_OPTIMIZER) -> ParallelModule:
    """Parallelize ``model`` over ``device_mesh``: the one line.

    Args:
        model: the model with its real weights (every rank may hold any values: rank 0's
            are distributed).
        meta_inputs: dict of keyword arguments or tuple of positional ones: meta tensors
            or FakeTensors with the **global** batch shapes.
        device_mesh: a ``torch.distributed.device_mesh.DeviceMesh`` spanning the world.
        cost_model: a :class:`CostModel` (default: A100 preset).
        strict: error on ops without a sharding rule instead of replicating them.
        solver / time_limit: the ILP solver and its limit in seconds.
        parallelism: ``"auto"`` or ``"data"`` (see :func:`plan`).
        mesh_spec: alpha/beta per mesh axis (default: :class:`MeshSpec` defaults).
        share_blocks / cache_dir / memory_budget / optimizer: see :func:`plan`.

    Returns:
        a :class:`ParallelModule`: call it like the model, with the global batch on every rank.

    Raises:
        MeshMismatchError: the mesh does not span the whole process group.
        CaptureError, ShardingRuleError, InfeasiblePlanError: see :mod:`autoparallel.errors`.
    """
    if not dist.is_initialized():
        raise MeshMismatchError("autoparallelize needs an initialized process group (torchrun / "
                                "init_process_group); use autoparallel.plan() to plan without one")
    world = dist.get_world_size()
    if device_mesh.size() != world:
        raise MeshMismatchError(f"the device mesh has {device_mesh.size()} devices (shape "
                                f"{tuple(device_mesh.mesh.shape)}) but the world size is {world}; "
                                "build the mesh over all ranks, e.g. init_device_mesh(device, shape) "
                                "with prod(shape) == world size")
    on_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if on_meta:
        raise AutoParallelError(f"autoparallelize needs the model's real weights, but {len(on_meta)} parameters "
                                f"(e.g. {on_meta[0]}) are on the meta device; load or initialize them first, "
                                "or use autoparallel.plan() to plan without weights")
    mesh = mesh_spec or MeshSpec.from_device_mesh(device_mesh)
    if tuple(mesh.shape) != tuple(device_mesh.mesh.shape):
        raise MeshMismatchError(f"mesh_spec shape {mesh.shape} differs from the device mesh "
                                f"{tuple(device_mesh.mesh.shape)}")
    with maybe_disable_local_tensor_mode():  # capture and planning see no simulated ranks
        t0 = time.perf_counter()
        traced = ColoTracer().trace(model, meta_inputs)
        log.info("traced %s: %d graph nodes (%.2f s)", type(model).__name__, len(traced.gm.graph.nodes),
                 time.perf_counter() - t0)
        if world == 1 or _is_simulated() or dist.get_rank() == 0:
            p = _plan_traced(traced, mesh, cost_model=cost_model, strict=strict, solver=solver,
                             time_limit=time_limit, parallelism=parallelism, share_blocks=share_blocks,
                             cache_dir=cache_dir, memory_budget=memory_budget, optimizer=optimizer,
                             device=device_mesh.device_type)
            payload = [p.to_json()]
        else:
            payload = [None]
    if world > 1 and not _is_simulated():
        dist.broadcast_object_list(payload, src=0)
        p = Plan.from_json(payload[0])
    return emit(model, traced, p, device_mesh)


def emit(model: nn.Module, traced, plan: Plan, device_mesh) -> ParallelModule:
    """Apply ``plan`` to the traced graph of ``model`` and build the ParallelModule (the last
    two stages of :func:`autoparallelize`; also used to run hand-picked plans)."""
    groups = [device_mesh.get_group(a).group_name for a in range(device_mesh.ndim)]
    targets = set(traced.params) | set(traced.buffers)
    graph = apply_plan(traced.gm, plan, groups, device_mesh.device_type, targets, device_mesh.size(),
                       traced_on=traced.device)
    pmodel = ParallelModule(model, graph, plan, device_mesh, in_spec=traced.in_spec, out_spec=traced.out_spec,
                            input_meta=traced.input_meta, param_names=traced.params,
                            buffer_names=traced.buffers, constants=traced.constants)
    if plan.checkpoint:
        stages = plan.checkpoint["stages"]
        gm = pmodel.graph_module
        stage_of = {n: stages[n.meta["source"]] for n in gm.graph.nodes if n.meta.get("source") in stages}
        apply_checkpointing(gm, stage_of, [region_from_json(r) for r in plan.checkpoint["regions"]])
    return pmodel
