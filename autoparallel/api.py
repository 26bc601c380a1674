"""The one-line API: orchestration of the stages (the only module that knows them all)."""

from __future__ import annotations

import builtins
import copy
import logging
import os
import time
import warnings
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from . import cache, errors, precision, progress, recipes
from .codegen import ParallelModule
from .constraints import cache_key as constraints_key, resolve as resolve_constraints
from .constraints import policy_cast, restrict as restrict_strategies
from .codegen.code import readable
from .codegen.module import Variant
from .errors import AutoParallelError, MeshMismatchError
from .mesh import MeshSpec, mesh_shape_tuple
from .passes import apply_plan
from .passes.apply_plan import process_groups
from .passes.checkpoint import apply_checkpointing
from .passes.grad_buckets import DEFAULT_BUCKET_CAP_BYTES
from .passes.fused_parts import rejoin_projection_parts
from .passes.causal_mask import causal_masks_as_flags
from .passes.cross_entropy import fuse_cross_entropy
from .passes.gqa import fold_repeated_kv
from .passes.overlap import overlap_collectives
from .graph import tensor_inputs
from .passes.dropout import shard_random_ops
from .pickling import ParallelGraph
from .placement import R, Shard, Spec, replicated, spec_str, spec_to_json
from .plan import Plan
from .profile import profile_mesh
from .solver import CostModel
from .solver.memory import DEFAULT_OPTIMIZER, MemoryModel, device_capacity, preset_capacity, resolve_budget
from .solver.planner import Planner, written_back_outputs
from .strategies import StrategyGenerator
from .strategies.coverage import CoverageReport, coverage_of
from .tracer import ColoTracer
from .tracer.autocast import ambient_autocast
from .tracer.annotate import node_info
from .validate import check_planning_arguments, validate_plan

log = logging.getLogger("autoparallel")

@progress.planning
def _plan_traced(traced, mesh: MeshSpec, *, cost_model, strict, solver, time_limit, parallelism,
                 share_layers, cache_dir, memory_budget=None, optimizer=DEFAULT_OPTIMIZER, device="cpu",
                 pinned: dict[str, Spec] | None = None, replicate_buffers: bool = False,
                 outputs: str = "sharded", constraints=None, mp_policy=None, baselines: bool = True):
    """Plan a traced model (``outputs``, ``mp_policy``, ``baselines``: as :func:`plan` takes them;
    ``traced`` captured under ``mp_policy``; no baselines for a plan with ``pinned``: a
    new mode or input shape of a running module). ``pinned`` (parameter/buffer
    name → spec, as in ``Plan.param_placements``) keeps each parameter's and buffer's
    ``get_attr`` node at that spec; raises AutoParallelError when one is missing or has no
    such strategy.
    ``replicate_buffers`` plans every buffer replicated, not only those the forward writes
    (a model planned in eval mode: in training mode it may write them back whole).
    ``constraints``: as :func:`plan` takes them (:mod:`autoparallel.constraints`)."""
    cost_model = cost_model or CostModel()
    user_pins = resolve_constraints(constraints, traced, mesh) if constraints else []
    budget = resolve_budget(memory_budget, lambda: preset_capacity(cost_model.device))
    baselines = baselines and pinned is None
    options = {"strict": strict, "solver": solver, "parallelism": parallelism, "share_layers": share_layers,
               "memory_budget": budget, "optimizer": optimizer, "device": device,
               "replicate_buffers": replicate_buffers, "outputs": outputs,
               "mp_policy": precision.policy_to_json(mp_policy), "baselines": baselines}
    if pinned is not None:
        options["pinned"] = {k: spec_to_json(v) for k, v in sorted(pinned.items())}
    if user_pins:
        options["constraints"] = constraints_key(user_pins)
    folder = cache.cache_path(cache_dir)
    key = cache.plan_key(traced, mesh, cost_model, options) if folder is not None else ""
    hit = cache.load(folder, key, traced, mesh)  # validated against the graph: a stale or edited file is ignored
    if hit is not None and pinned is not None and any(tuple(s) != tuple(pinned.get(k, s))
                                                      for k, s in hit.param_placements.items()):
        log.warning("ignoring the cached plan: it moves a parameter or buffer the module holds elsewhere; "
                    "planning again")
        hit = None
    if hit is not None:
        hit.solver_stats.cache = "hit"
        hit.solver_stats.stamped_layers = traced.stamped_layers  # the graph is the same either way
        return hit
    t0 = time.perf_counter()
    progress.stage("strategies")
    gen = StrategyGenerator(mesh.shape, strict=strict)
    strategies = gen.generate(traced.gm)
    repl = (R,) * mesh.ndim
    # buffers written back whole after each forward (in the other mode too, with replicate_buffers)
    written = set(traced.buffers) if replicate_buffers else set(traced.buffer_mutations.values())
    for node in strategies:
        if node.op == "get_attr" and node.target in written:
            strategies[node] = [s for s in strategies[node] if s.outputs[0] == repl]
    unconstrained = {n: list(ss) for n, ss in strategies.items()}  # what the baselines narrow
    if parallelism == "data":  # (checked by check_planning_arguments: "auto", "data" or "fsdp")
        for node in strategies:
            if node.op == "get_attr":
                strategies[node] = [s for s in strategies[node] if s.outputs[0] == repl]
    if parallelism == "fsdp":
        _fsdp(strategies, repl)
    if pinned is not None:
        _pin(strategies, traced, pinned, mesh.ndim)
    restrict_strategies(strategies, gen.aliases, user_pins, mesh.axis_names)
    t1 = time.perf_counter()
    log.info("strategies: %d nodes, %d strategies (%.2f s)", len(strategies),
             sum(len(v) for v in strategies.values()), t1 - t0)
    names = dict(traced.params)
    names.update(traced.buffers)
    t2 = time.perf_counter()
    whole = written_back_outputs(traced.gm, traced.buffer_mutations)  # returned whole, to be written back
    progress.stage("memory model")
    memory = MemoryModel(traced.gm, gen.aliases, mesh.shape, optimizer=optimizer, device=device,
                         traced_on=traced.device, outputs=outputs, whole_outputs=whole)
    t_memory = time.perf_counter() - t2
    planner = Planner(traced.gm, strategies, gen.aliases, mesh, cost_model, names, share_layers=share_layers,
                      memory=memory, outputs=outputs, whole_outputs=whole,
                      reduce_dtype=precision.reduce_dtype(mp_policy), optimizer=optimizer, device=device)
    progress.stage("costs and ILP solve")
    plan = planner.solve(solver=solver, time_limit=time_limit, memory_budget=budget)
    plan.estimate = replace(plan.estimate, costs=cost_model.describe())
    st = plan.solver_stats
    log.info("ILP: %d node vars, %d edge vars, solved by %s in %.2f s (costs %.2f s); estimated step %.3g s",
             st.binary_vars, st.edge_vars, st.solver, st.solve_s, st.stage_s["costs"], plan.estimate.step_time_s)
    st.stage_s["strategies"] = t1 - t0
    st.stage_s["memory"] = t_memory
    st.stamped_layers = traced.stamped_layers
    plan.inspection.fallback_ops = sorted(gen.fallbacks)
    st.cache = "miss" if folder is not None else "off"
    plan.mp_policy = mp_policy
    if user_pins:
        plan.inspection.placement_constraints = {p.pattern: p.text(mesh.axis_names) for p in user_pins}
    if baselines:
        progress.stage("baselines")
        t3 = time.perf_counter()
        rows = recipes.price(traced, mesh, planner, unconstrained, solver=solver, time_limit=time_limit,
                             memory_budget=budget, costs=plan.estimate.costs)
        plan.inspection.baselines = recipes.baselines(rows)
        st.stage_s["baselines"] = time.perf_counter() - t3
        log.info("baselines: %d recipes priced (%.2f s)", len(rows), st.stage_s["baselines"])
    cache.store(folder, key, plan)
    return plan


def _fsdp(strategies, repl: Spec) -> None:
    """``parallelism="fsdp"``: every trainable parameter kept sharded along every mesh axis
    (where a strategy of it does so) and used whole: its consumers take it replicated, so the
    plan all-gathers it before use and reduce-scatters its gradient (ZeRO-3, Rajbhandari et
    al. 2020, §5; PyTorch FSDP)."""
    params = set()
    for node, ss in strategies.items():
        if node.op == "get_attr" and node_info(node).requires_grad:
            params.add(node)
            split = [s for s in ss if all(isinstance(p, Shard) for p in s.outputs[0])]
            strategies[node] = split or ss
    # under a mixed-precision policy a parameter is read through its cast (tracer/casts.py): the
    # cast runs on the shard and its consumers gather the half-precision copy, as FSDP2 does
    params = {policy_cast(p) or p for p in params}
    for node, ss in strategies.items():
        pos = [j for j, (_, x) in enumerate(tensor_inputs(node)) if x in params] if node.op == "call_function" else []
        whole = [s for s in ss if all(s.inputs[j] == repl for j in pos)]
        if pos and whole:
            strategies[node] = whole


def _pin(strategies, traced, pinned: dict[str, Spec], mesh_ndim: int) -> None:
    """Keep only the strategies of each parameter/buffer ``get_attr`` node whose output spec is
    its pinned one (the strategy output and ``Plan.param_placements`` are the same spec tuple)."""
    state = set(traced.params) | set(traced.buffers)
    for node in strategies:
        if node.op != "get_attr" or node.target not in state:
            continue
        kind = "parameter" if node.target in traced.params else "buffer"
        want = pinned.get(node.target)
        if want is None:
            raise AutoParallelError(f"{kind} {node.target} has no placement to keep: it is not in the first plan "
                                    "(the new capture reads state the first one did not)")
        kept = [s for s in strategies[node] if tuple(s.outputs[0]) == tuple(want)]
        if not kept:
            shape = tuple(node.meta["val"].shape)
            have = sorted({spec_str(s.outputs[0], len(shape)) for s in strategies[node]})
            raise AutoParallelError(f"{kind} {node.target} {shape} cannot keep its placement "
                                    f"{spec_str(want, len(shape))} in the new plan: its strategies are {have}")
        strategies[node] = kept


def plan(model: nn.Module, meta_inputs, *, mesh_shape=None, mesh_spec: MeshSpec | None = None,
         cost_model: CostModel | None = None, strict: bool = False, solver: str = "cbc",
         time_limit: float = 60.0, parallelism: str = "auto", share_layers: bool = True,
         cache_dir=None, memory_budget: int | str | None = None, optimizer: str = DEFAULT_OPTIMIZER,
         device: str = "cpu", stamp_layers: bool = True, mesh: MeshSpec | None = None,
         share_blocks: bool | None = None, outputs: str = "sharded", constraints=None,
         mp_policy: MixedPrecisionPolicy | None = None, baselines: bool = True) -> Plan:
    """Plan how to parallelize ``model`` without any process group.

    Args:
        model: the model (real or meta-device weights).
        meta_inputs: dict of keyword arguments or tuple of positional ones, tensors on the
            meta device (or FakeTensors) with **global** shapes.
        mesh_shape: devices per mesh axis, e.g. ``(2, 4)``, or an int for a 1-D mesh; or
            give ``mesh_spec`` (not both).
        mesh_spec: a :class:`MeshSpec` (shape, axis names, alpha/beta); the same keyword as
            :func:`autoparallelize`'s. With neither, a profiled ``cost_model`` gives its mesh
            (:meth:`~autoparallel.solver.costs.CommProfile.mesh_spec`).
        cost_model: a :class:`CostModel` (default: A100 preset); a saved profile of a real
            mesh prices it as measured: ``CostModel.from_profile(path)``.
            ``plan.estimate.costs`` records which costs priced the plan.
        strict: error on ops without a sharding rule instead of replicating them.
        solver: ``"cbc"`` or ``"highs"``.
        time_limit: seconds for the ILP solver.
        parallelism: ``"auto"`` (search everything), ``"data"`` (parameters replicated:
            prices plain data parallelism under the same cost model) or ``"fsdp"`` (parameters
            sharded along every mesh axis and all-gathered for use: fully sharded data
            parallelism).
        share_layers: one set of ILP variables for identical repeated layers (``share_blocks``
            is its deprecated name).
        cache_dir: plan cache folder; ``None`` for the default (``AUTOPARALLEL_CACHE_DIR``
            or ``~/.cache/autoparallel``), ``False`` for no cache (see :mod:`autoparallel.cache`).
        memory_budget: peak bytes per device the training step may use (an int, or a
            string such as ``"12GiB"``); ``None`` (default) for the device's memory less a
            10 % reserve (``cost_model``'s preset capacity: 80 GiB for a100 and h100, this
            host's memory for cpu; :func:`autoparallelize` reads the real device's);
            ``"unlimited"`` for no limit. The peak is modelled by
            :mod:`autoparallel.solver.memory` (parameters, gradients, optimizer states,
            saved activations, gathered weights, temporaries and runtime buffers with their
            liveness); when sharding alone does not fit, activations are recomputed.
        optimizer: ``"adamw"`` (default), ``"adam"``, ``"sgd_momentum"`` or ``"sgd"``:
            how many state tensors per parameter the memory model counts.
        device: device type the module will run on; selects the kernels whose saved
            tensors the memory model measures (e.g. SDPA's).
        stamp_layers: capture a deep stack of identical layers by tracing four of them and
            copying the rest (:mod:`autoparallel.tracer.stamp`: guarded, falls back to a full
            capture); ``False`` traces every layer.
        outputs: how the module returns the model's outputs. ``"sharded"`` (default): each
            in the placement its producer computes it in, pending sums reduced, so a
            language model's logits stay split (the module returns a DTensor;
            ``.full_tensor()`` gathers it on demand) while a 0-d loss comes back whole;
            ``"replicated"``: every output whole on every device. The plan prices exactly
            this (docs/design.md, "Outputs").
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (or ``None``: every
            dtype the model's own, as today): the graph is captured and priced with parameters
            cast to ``param_dtype`` in the forward (fp32 master parameters, gradients and
            optimizer states), gradients reduced in ``reduce_dtype``; recorded in
            ``plan.mp_policy`` (:mod:`autoparallel.precision`; docs/design.md, "Mixed precision").
        constraints: ``{pattern: placements}``: every parameter, buffer, module output,
            input or output whose name matches the glob ``pattern`` is placed as given
            (text such as ``"S0(tp)"`` or a tuple of DTensor placements) and the rest is
            planned around them (grammar and matching: :mod:`autoparallel.constraints`).
        baselines: also plan data parallelism and the other hand-written recipes of
            :func:`autoparallel.recipes.recipes` (DDP, FSDP, Megatron TP, FSDP + TP) on the same
            graph, strategies and costs, each as the plan solved with the recipe's constraints
            (:func:`autoparallel.recipes.price`: no second trace or pricing, one ILP solve per
            recipe), recorded in ``plan.inspection.baselines`` and printed by ``str(plan)``.
            DDP is always planned, the other recipes unless a lower bound of their step
            shows they cannot be the fastest. Costs a problem build per recipe and an ILP
            solve per planned one: measured about +40 % planning CPU time on GPT-2 small and
            +65-70 % on Llama-3-8B dims (docs/design.md, "Inspecting and steering the
            plan", Baselines); ``False`` leaves them out.

    Returns:
        the :class:`Plan`; ``plan.solver_stats.stage_s`` holds per-stage seconds;
        ``plan.estimate.memory`` the modelled peak and its breakdown.

    Raises:
        CaptureError, ShardingRuleError, InfeasiblePlanError: see :mod:`autoparallel.errors`
            (a budget no plan fits raises InfeasiblePlanError with the smallest reachable peak).
        TypeError: an argument of the wrong type, e.g. ``mesh_shape`` not an int or a
            sequence of ints (:func:`autoparallel.validate.check_planning_arguments`).
        ConstraintError: a constraint that matches nothing, bad placement text, or a tensor
            that cannot be placed as asked (naming the pattern, tensor and legal placements).
        ValueError: neither (unless ``cost_model`` is profiled) or both of ``mesh_shape`` and
            ``mesh_spec``, a mesh shape other than a profiled ``cost_model``'s, a mesh axis below 1, an
            unreadable ``memory_budget``, an unknown ``solver``, ``parallelism``,
            ``optimizer`` or ``outputs``, a ``time_limit`` that is not positive.
    """
    mesh = _plan_mesh(model, meta_inputs, mesh_shape, mesh_spec, mesh, cost_model)
    share_layers = _renamed("plan", "share_layers", share_layers, "share_blocks", share_blocks, True)
    check_planning_arguments(cost_model=cost_model, strict=strict, solver=solver, time_limit=time_limit,
                             parallelism=parallelism, share_layers=share_layers, cache_dir=cache_dir,
                             memory_budget=memory_budget, optimizer=optimizer, device=device,
                             stamp_layers=stamp_layers, outputs=outputs, constraints=constraints)
    baselines = _flag("baselines", baselines)
    t0 = time.perf_counter()
    mp_policy = precision.check_policy(mp_policy)
    traced = _trace(model, meta_inputs, stamp_layers, mp_policy, device)
    t_trace = time.perf_counter() - t0
    p = _plan_traced(traced, mesh, cost_model=cost_model, strict=strict, solver=solver,
                     time_limit=time_limit, parallelism=parallelism, share_layers=share_layers, cache_dir=cache_dir,
                     memory_budget=memory_budget, optimizer=optimizer, device=device, outputs=outputs,
                     constraints=constraints, mp_policy=mp_policy, baselines=baselines)
    p.solver_stats.stage_s["trace"] = t_trace
    return p


def _plan_mesh(model, meta_inputs, mesh_shape, mesh_spec, mesh, cost_model) -> MeshSpec:
    """The :class:`MeshSpec` :func:`plan` plans for, from ``mesh_shape``, ``mesh_spec`` (or its
    deprecated name ``mesh``) or a profiled ``cost_model``; checks ``model`` and ``meta_inputs``.

    Raises:
        TypeError, ValueError: as listed by :func:`plan`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if not isinstance(meta_inputs, (dict, tuple, list)):
        raise TypeError(f"meta_inputs must be a dict of keyword arguments or a tuple of positional ones, not "
                        f"{type(meta_inputs).__name__} (wrap a single tensor x as (x,))")
    keyword = "mesh" if mesh is not None else "mesh_spec"  # the one the caller used, for errors
    mesh = _renamed("plan", "mesh_spec", mesh_spec, "mesh", mesh)
    if mesh is None and mesh_shape is None and isinstance(cost_model, CostModel) and cost_model.profile:
        mesh = cost_model.profile.mesh_spec()  # the profiled mesh with its links' alpha and beta
    if (mesh is None) == (mesh_shape is None):
        raise ValueError("plan() needs one of mesh_shape=(...) and mesh_spec=MeshSpec(...), "
                         + ("not both" if mesh is not None else "got neither"))
    if mesh is None:
        return MeshSpec(mesh_shape_tuple(mesh_shape, "mesh_shape"))
    if not isinstance(mesh, MeshSpec):
        raise TypeError(f"{keyword} must be an autoparallel.MeshSpec, not {mesh!r}; pass a shape as mesh_shape=")
    return mesh


def _flag(name: str, value) -> bool:
    """``value`` of boolean keyword ``name``.

    Raises:
        TypeError: ``value`` is not a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, not {value!r}")
    return value


def _renamed(fn: str, new_name: str, new, old_name: str, old, new_default=None):
    """The value of keyword ``new_name`` of ``fn``, or of its deprecated name ``old_name`` when
    that was given (with a DeprecationWarning).

    Raises:
        ValueError: both names given.
    """
    if old is None:
        return new
    warnings.warn(f"{fn}({old_name}=...) is deprecated; pass {new_name}=", DeprecationWarning, stacklevel=3)
    if new is not new_default:
        raise ValueError(f"{fn}(): give {new_name}= only ({old_name}= is its deprecated name)")
    return old


def coverage(model: nn.Module, meta_inputs, *, stamp_layers: bool = True) -> CoverageReport:
    """Every ATen op of ``model``'s captured graph, with where its strategies come from (own
    rule, replicated by rule, replicate fallback) and the module paths that use it.

    Raises:
        CaptureError: when torch.export cannot capture the model.
    """
    return coverage_of(ColoTracer(stamp=stamp_layers).trace(model, meta_inputs).gm)


def _device_budget(memory_budget, device_mesh):
    """``memory_budget`` as given, or for ``None`` the bytes of this rank's device less the
    reserve (:func:`~autoparallel.solver.memory.resolve_budget`): free GPU memory, or on CPUs
    the host's memory shared by its ranks (``LOCAL_WORLD_SIZE`` as torchrun sets it; every rank
    when they are simulated in this process)."""
    if memory_budget is not None:
        return memory_budget
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or (dist.get_world_size() if _is_simulated() else 1)
    return resolve_budget(None, lambda: device_capacity(device_mesh.device_type, ranks))


def _is_simulated() -> bool:
    return dist.get_backend() == "fake"


def autoparallelize(model: nn.Module, meta_inputs, *, device_mesh, cost_model: CostModel | None = None,
                    strict: bool = False, solver: str = "cbc", time_limit: float = 60.0,
                    parallelism: str = "auto", mesh_spec: MeshSpec | None = None, share_layers: bool = True,
                    cache_dir=None, memory_budget: int | str | None = None,
                    optimizer: str = DEFAULT_OPTIMIZER, stamp_layers: bool = True,
                    replan: bool = False, check_batch_every: int = 100,
                    plan: Plan | str | None = None, bucket_cap_mb: float = 25,
                    share_blocks: bool | None = None, outputs: str = "sharded",
                    constraints=None, mp_policy: MixedPrecisionPolicy | None = None,
                    baselines: bool = True) -> ParallelModule:
    """Parallelize ``model`` over ``device_mesh``: the one line.

    Args:
        model: the model with its real weights (every rank may hold any values: rank 0's
            are distributed). The returned module takes the weights over (it holds sharded
            copies; the model's own tensors are not updated by training it).
        meta_inputs: dict of keyword arguments or tuple of positional ones: meta tensors
            or FakeTensors with the **global** batch shapes, and the non-tensor arguments
            the module will be called with (``use_cache=False``), whose values are planned for.
        device_mesh: a ``torch.distributed.device_mesh.DeviceMesh`` spanning the world, its
            ranks in any order along each axis.
        cost_model: a :class:`CostModel`. Default: the costs of this mesh, measured by
            :func:`autoparallel.profile_mesh` on first use (every rank, seconds) and loaded
            from the cache folder's ``profiles/`` afterwards (``cache_dir=False`` turns off
            the plan cache only: the profile, which describes the machine, still goes to the
            default folder); the A100 preset when ``mesh_spec`` or ``plan`` is given, and
            under simulated ranks (the ``fake`` process group has no network to measure).
        strict: error on ops without a sharding rule instead of replicating them.
        solver / time_limit: the ILP solver and its limit in seconds.
        parallelism: ``"auto"`` or ``"data"`` (see :func:`plan`).
        mesh_spec: alpha/beta per mesh axis (default: the profile's, see ``cost_model``, or
            :class:`MeshSpec` defaults).
        share_layers / cache_dir / optimizer / stamp_layers: see :func:`plan`.
        memory_budget: see :func:`plan`; ``None`` (default) is the memory of this rank's
            device less a 10 % reserve: the free memory of a GPU
            (``torch.cuda.mem_get_info``), or on CPUs the host's memory divided among the
            ranks on it (``LOCAL_WORLD_SIZE``, or every rank when they are simulated).
        outputs: ``"sharded"`` (default) returns outputs the plan keeps split as DTensors
            (``out.logits.full_tensor()`` for the whole value; a loss is a plain tensor),
            ``"replicated"`` every output whole (see :func:`plan`). With ``plan=``, the
            plan's own ``plan.outputs`` applies.
        constraints: placements to keep, ``{pattern: placements}`` (see :func:`plan`).
        baselines: price data parallelism and the hand-written recipes beside the plan (see
            :func:`plan`; not for the plans of a new mode or input shape).
        mp_policy: mixed precision (see :func:`plan`): the module's parameters stay in the
            model's dtype (fp32 master weights for the optimizer), its forward casts them to
            ``param_dtype``; ignored when ``plan`` is given (its own policy applies).
        replan: when a call's inputs have other tensor shapes or dtypes, or other non-tensor
            values, than ``meta_inputs`` (same structure and keywords; e.g. the smaller last
            batch of an epoch), capture and plan the model again for them, with every
            parameter and buffer pinned to the placement the module holds, and cache the new
            graph by input signature; ``False`` (default) raises InputMismatchError instead.
            Costs one capture and one ILP solve per new signature (seconds), on the call that
            first sees it, on every rank (the plan is solved on rank 0 and broadcast). A new
            mode (``pmodel.eval()`` after planning in training mode) is captured and planned
            the same way whatever ``replan`` says.
        check_batch_every: compare a fingerprint of the inputs across ranks on the first call
            and every this many calls (one all-reduce of two float64 numbers per input);
            ranks that pass different batches raise InputMismatchError. ``0`` never checks.
        bucket_cap_mb: the largest gradient bucket in MiB: gradients of parameters replicated
            along mesh axes are all-reduced in buckets of at most this size, each launched
            during the backward as soon as its gradients exist (DDP's argument of that name;
            :mod:`autoparallel.passes.grad_buckets`).
        plan: a :class:`Plan` (or its JSON) to run instead of planning, e.g. one saved with
            ``plan.to_json()`` or edited by hand; it is validated against the captured graph
            (:func:`autoparallel.validate.validate_plan`) on every rank.

    Returns:
        a :class:`ParallelModule`: call it like the model, with the global batch on every rank.

    Raises:
        MeshMismatchError: the mesh does not span the whole process group.
        PlanMismatchError: a ``plan`` that does not fit the captured graph or the mesh (the
            message names the first mismatch); ValueError: unreadable plan JSON.
        TypeError, ValueError: an argument of the wrong type or value (named in the message).
        CaptureError, ShardingRuleError, InfeasiblePlanError: see :mod:`autoparallel.errors`;
            planning runs on rank 0 and any error it raises is raised on every rank (with
            ``replan=True`` or a new mode, also from a call; AutoParallelError there when the
            new capture reads other parameters than the first).
    """
    share_layers = _renamed("autoparallelize", "share_layers", share_layers, "share_blocks", share_blocks, True)
    check_planning_arguments(cost_model=cost_model, strict=strict, solver=solver, time_limit=time_limit,
                             parallelism=parallelism, share_layers=share_layers, cache_dir=cache_dir,
                             memory_budget=memory_budget, optimizer=optimizer, stamp_layers=stamp_layers,
                             outputs=outputs, constraints=constraints)
    plan = _check_run(model, device_mesh, plan)
    mesh, cost_model = _mesh_and_costs(device_mesh, cost_model, mesh_spec, plan, cache_dir)
    options = dict(cost_model=cost_model, strict=strict, solver=solver, time_limit=time_limit,
                   parallelism=parallelism, share_layers=share_layers, cache_dir=cache_dir,
                   memory_budget=_device_budget(memory_budget, device_mesh), optimizer=optimizer,
                   device=device_mesh.device_type,
                   replicate_buffers=not model.training, outputs=plan.outputs if plan is not None else outputs,
                   constraints=constraints, baselines=_flag("baselines", baselines),
                   mp_policy=plan.mp_policy if plan is not None else precision.check_policy(mp_policy))
    with maybe_disable_local_tensor_mode():  # capture and planning see no simulated ranks
        traced = _trace(model, meta_inputs, stamp_layers, options["mp_policy"], device_mesh.device_type)
        if plan is None:
            plan = _plan_on_rank0(traced, mesh, options)
        else:
            validate_plan(plan, traced, mesh_shape=tuple(device_mesh.mesh.shape))
        recapture = _Recapture(model, mesh, device_mesh, options, stamp_layers=stamp_layers,
                               keywords=isinstance(meta_inputs, dict), replan=replan)
    pmodel = emit(model, traced, plan, device_mesh, check_batch_every=check_batch_every,
                  bucket_cap_bytes=_bucket_cap_bytes(bucket_cap_mb))
    pmodel.__dict__["_recapture"] = recapture
    return pmodel


def _check_run(model: nn.Module, device_mesh, plan) -> Plan | None:
    """The checks of :func:`autoparallelize` that need no capture; returns ``plan`` read from
    its JSON when given as text.

    Raises:
        TypeError: ``plan`` or ``device_mesh`` of the wrong type.
        MeshMismatchError: no process group, or a mesh that does not span the world.
        AutoParallelError: parameters on the meta device.
    """
    if isinstance(plan, str):
        plan = Plan.from_json(plan)
    elif plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be an autoparallel.Plan, its JSON string or None, not {type(plan).__name__}")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh (e.g. from "
                        f"init_device_mesh), not {type(device_mesh).__name__}")
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
    return plan


def _mesh_and_costs(device_mesh, cost_model, mesh_spec, plan, cache_dir) -> tuple[MeshSpec, CostModel | None]:
    """The :class:`MeshSpec` and cost model :func:`autoparallelize` plans with: with neither
    given (and no plan), the mesh it runs on, profiled on first use by every rank and loaded
    from the cache after (:func:`~autoparallel.profile.profile_mesh`); simulated ranks keep
    the preset.

    Raises:
        MeshMismatchError: ``mesh_spec`` of another shape than ``device_mesh``.
    """
    if cost_model is None and mesh_spec is None and plan is None and not _is_simulated():
        cost_model = CostModel.from_profile(profile_mesh(device_mesh, cache_dir=cache_dir or None))
        mesh_spec = cost_model.profile.mesh_spec(device_mesh.mesh_dim_names)
    mesh = mesh_spec or MeshSpec.from_device_mesh(device_mesh)
    if tuple(mesh.shape) != tuple(device_mesh.mesh.shape):
        raise MeshMismatchError(f"mesh_spec shape {mesh.shape} differs from the device mesh "
                                f"{tuple(device_mesh.mesh.shape)}")
    return mesh, cost_model


def _trace(model: nn.Module, meta_inputs, stamp_layers: bool, mp_policy: MixedPrecisionPolicy | None = None,
           device: str = "cpu"):
    """The captured graph of ``model`` on ``meta_inputs`` under ``mp_policy`` and the
    ``torch.autocast`` enabled now for ``device`` (:class:`ColoTracer`), logged."""
    t0 = time.perf_counter()
    traced = ColoTracer(stamp=stamp_layers, mp_policy=mp_policy,
                        autocast=ambient_autocast(device)).trace(model, meta_inputs)
    log.info("traced %s: %d graph nodes (%.2f s)", type(model).__name__, len(traced.gm.graph.nodes),
             time.perf_counter() - t0)
    return traced


def _bucket_cap_bytes(bucket_cap_mb) -> int:
    """``bucket_cap_mb`` MiB in bytes (at least 1).

    Raises:
        ValueError: not a positive number."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
    return max(1, int(bucket_cap_mb * 2**20))


def _plan_on_rank0(traced, mesh: MeshSpec, options: dict, pinned=None) -> Plan:
    """Plan on rank 0 and broadcast it (every rank plans when there is one, or all are
    simulated in this process). Call with local tensor mode off.

    Raises:
        whatever planning raised on rank 0, on every rank: an error of autoparallel or of
        Python's builtins with the same type and message, anything else as AutoParallelError.
    """
    world = dist.get_world_size()
    if world == 1 or _is_simulated():
        return _plan_traced(traced, mesh, pinned=pinned, **options)
    payload = [None]
    if dist.get_rank() == 0:
        try:
            payload = [("plan", _plan_traced(traced, mesh, pinned=pinned, **options).to_json())]
        except Exception as e:
            payload = [("error", type(e).__name__, str(e))]
            dist.broadcast_object_list(payload, src=0)
            raise
    dist.broadcast_object_list(payload, src=0)
    if payload[0][0] == "error":
        _, kind, message = payload[0]
        raise _rank0_error(kind, message)
    return Plan.from_json(payload[0][1])


def _rank0_error(kind: str, message: str) -> Exception:
    """The exception rank 0 raised while planning, rebuilt from its type name and message."""
    cls = getattr(errors, kind, None) or getattr(builtins, kind, None)
    fallback = AutoParallelError(f"planning on rank 0 raised {kind}: {message}")
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return fallback
    try:
        return cls(f"{message} (raised while planning on rank 0)")
    except TypeError:  # a constructor that takes other arguments
        return fallback


def meta_skeleton(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are meta tensors of the same shapes and
    dtypes (parameters stay ``nn.Parameter`` with the same ``requires_grad``; tied tensors
    share one copy): enough to capture it again, and no weight is copied or kept alive."""
    memo: dict[int, object] = {}
    state = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    for _, t in state:
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    try:
        return copy.deepcopy(model, memo)
    except Exception as e:  # an attribute deepcopy cannot copy (a lock, a process group, ...)
        raise AutoParallelError(f"replan=True keeps a meta-device copy of {type(model).__name__} to capture it "
                                f"again, but copy.deepcopy failed: {type(e).__name__}: {e}; make the model's "
                                "attributes copyable, or call autoparallelize again for each input shape") from e


class _Recapture:
    """Captures and plans the model again for a mode or an input signature a
    :class:`ParallelModule` has no graph for: a capture of a meta skeleton of the model in the
    module's mode (``train()``/``eval()``), a plan with every parameter and buffer pinned to its
    placement in the module (every parameter and buffer of the model is there, so a capture
    that reads other state than the first, e.g. no ``num_batches_tracked`` in eval mode, is
    planned alike), a new per-device graph over the same parameters. New signatures only under
    ``replan=True``; new modes always. Holds no reference to the model or its weights.

    Attributes:
        replan: whether new input signatures are planned (else they raise InputMismatchError).
        captures: how many captures it made.
    """

    def __init__(self, model: nn.Module, mesh: MeshSpec, device_mesh, options: dict, *,
                 stamp_layers: bool, keywords: bool, replan: bool):
        self.skeleton, self.copy_error = None, None
        try:
            self.skeleton = meta_skeleton(model)
        except AutoParallelError as e:
            if replan:
                raise
            self.copy_error = e  # raised when another mode is asked for
        self.mesh, self.device_mesh, self.options = mesh, device_mesh, options
        self.stamp_layers, self.keywords, self.replan = stamp_layers, keywords, replan
        self.grad_enabled = torch.is_grad_enabled()  # capture in the grad mode the first capture saw
        self.captures = 0

    def __call__(self, pmodel: ParallelModule, args, kwargs) -> Variant:
        """Plan and add the graph for inputs ``(args, kwargs)`` (structure already checked) in
        ``pmodel``'s mode."""
        if self.skeleton is None:
            raise AutoParallelError(f"{'training' if pmodel.training else 'eval'} mode has no graph yet, and "
                                    f"capturing one failed: {self.copy_error}")
        t0 = time.perf_counter()
        with maybe_disable_local_tensor_mode(), torch.set_grad_enabled(self.grad_enabled):
            meta = pytree.tree_map_only(torch.Tensor, lambda t: torch.empty(tuple(t.shape), dtype=t.dtype,
                                                                            device="meta"),
                                        dict(kwargs) if self.keywords else tuple(args))
            self.skeleton.train(pmodel.training)
            traced = ColoTracer(stamp=self.stamp_layers, mp_policy=self.options["mp_policy"],
                                autocast=ambient_autocast(self.device_mesh.device_type)).trace(self.skeleton, meta)
            self.captures += 1
            held = list(pmodel.named_parameters(remove_duplicate=False)) + \
                list(pmodel.named_buffers(remove_duplicate=False))
            pinned = {name: tuple(t.placements) if isinstance(t, DTensor) else replicated(self.device_mesh.ndim)
                      for name, t in held}
            p = _plan_on_rank0(traced, self.mesh, self.options, pinned=pinned)
        variant = _add_variant(pmodel, traced, p, self.device_mesh)
        log.info("planned %s mode for inputs %s (%.2f s; %d graphs cached)",
                 "training" if variant.training else "eval", [s for s, _ in variant.input_meta],
                 time.perf_counter() - t0, len(pmodel.plans))
        return variant


def _device_graph_module(traced, plan: Plan, device_mesh, root, bucket_cap_bytes: int) -> fx.GraphModule:
    """The per-device graph of ``plan`` for ``traced`` as a GraphModule over ``root`` (a module
    or a dict: where its ``get_attr`` nodes read parameters, buffers and constants):
    :func:`apply_plan` (gradient buckets of at most ``bucket_cap_bytes``), per-shard random
    ops, the parts of fused projections rejoined where a device computes them from one whole
    weight, grouped-query attention given to SDPA unrepeated, constant causal masks as
    ``is_causal``, cross-entropies over whole classes with a one-pass backward, activation
    checkpointing, then the forward's collectives scheduled for overlap."""
    groups = process_groups(device_mesh.mesh_dim_names or plan.mesh.axis_names,
                            [device_mesh.get_group(a).group_name for a in range(device_mesh.ndim)])
    targets = set(traced.params) | set(traced.buffers)
    graph = apply_plan(traced.gm, plan, groups, device_mesh.device_type, targets, device_mesh.size(),
                       traced_on=traced.device, bucket_cap_bytes=bucket_cap_bytes)
    shard_random_ops(graph, plan)  # one mask per distinct shard, drawn before checkpoint regions exist
    rejoin_projection_parts(graph, traced.gm.graph)
    fold_repeated_kv(graph, traced.gm.graph)
    causal_masks_as_flags(graph, traced.gm.graph, plan)
    fuse_cross_entropy(graph, traced.gm.graph)
    gm = ParallelGraph(root, graph, class_name="ParallelGraph")  # refuses pickling (pickling.py)
    if plan.checkpoint:
        stages = plan.checkpoint.stages
        stage_of = {n: stages[n.meta["source"]] for n in gm.graph.nodes if n.meta.get("source") in stages}
        apply_checkpointing(gm, stage_of, plan.checkpoint.regions)
    overlap_collectives(gm.graph)
    return readable(gm)  # gm and its checkpoint regions print their comments; one recompile each


def _add_variant(pmodel: ParallelModule, traced, plan: Plan, device_mesh, root=None) -> Variant:
    gm = _device_graph_module(traced, plan, device_mesh, pmodel.graph_root(traced.constants) if root is None else root,
                              pmodel.bucket_cap_bytes)
    return pmodel.add_variant(gm, plan, in_spec=traced.in_spec, out_spec=traced.out_spec,
                              input_meta=traced.input_meta, buffer_mutations=traced.buffer_mutations)


def emit(model: nn.Module, traced, plan: Plan, device_mesh, check_batch_every: int = 100,
         bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES) -> ParallelModule:
    """Apply ``plan`` to the traced graph of ``model`` and build the ParallelModule (the last
    two stages of :func:`autoparallelize`; also used to run hand-picked plans); gradients
    are reduced in buckets of at most ``bucket_cap_bytes``."""
    pmodel = ParallelModule(model, None, plan, device_mesh, param_names=traced.params, buffer_names=traced.buffers,
                            constants=traced.constants, check_batch_every=check_batch_every)
    pmodel.__dict__["bucket_cap_bytes"] = bucket_cap_bytes  # every graph of the module buckets alike
    _add_variant(pmodel, traced, plan, device_mesh, root=pmodel)  # the first graph reads the module itself
    return pmodel
