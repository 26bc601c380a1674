"""The public functions: each builds the options and calls the stages in order, capture
(:mod:`autoparallel.tracer`) → planning (:mod:`autoparallel.solver.pipeline`) → lowering and
the module (:mod:`autoparallel.codegen.emit`). Nothing here is called back by a stage."""

from __future__ import annotations

import math
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._local_tensor import maybe_disable_local_tensor_mode
from torch.distributed.device_mesh import DeviceMesh

from .codegen import ParallelModule
from .codegen.emit import Recapture, Restage, check_rank_order, emit, emit_pipeline, meta_skeleton
from .errors import AutoParallelError, MeshMismatchError
from .mesh import MeshSpec, mesh_shape_tuple
from .options import PlanOptions
from .plan import Plan
from .profile import profile_mesh
from .recipes import Comparison, Row
from .solver import CostModel
from .solver.memory import device_capacity, resolve_budget
from .solver.pipeline import on_rank0, plan_on_rank0, plan_traced
from .solver.stages import pipeline_axis, plan_stages, recipe_row, replan_stages
from .strategies.coverage import CoverageReport, coverage_of
from .tracer import capture
from .tracer.batch import global_batch, microbatch
from .tracer.stamp import find_layer_list
from .tracer.untie import untie_pieces
from .validate import validate_plan


def plan(model: nn.Module, meta_inputs, *, mesh_shape=None, mesh_spec: MeshSpec | None = None,
         options: PlanOptions | None = None, mesh: MeshSpec | None = None, **keywords) -> Plan:
    """Plan how to parallelize ``model`` without any process group.

    Args:
        model: the model (real or meta-device weights).
        meta_inputs: dict of keyword arguments or tuple of positional ones, tensors on the
            meta device (or FakeTensors) with **global** shapes; with ``inputs="local"`` the
            shapes one rank passes (the plan is for the global batch: each tensor's dim 0 times
            the number of devices, ``prod(mesh_shape)``).
        mesh_shape: devices per mesh axis, e.g. ``(2, 4)``, or an int for a 1-D mesh; or
            give ``mesh_spec`` (not both).
        mesh_spec: a :class:`MeshSpec` (shape, axis names, alpha/beta; ``mesh`` is its
            deprecated name). With neither, a profiled ``cost_model`` gives its mesh
            (:meth:`~autoparallel.solver.costs.CommProfile.mesh_spec`).
        options: a :class:`~autoparallel.PlanOptions`; ``keywords`` (any of its fields, e.g.
            ``memory_budget="12GiB"``, ``cost_model=``, ``mp_policy=``) replace its fields.
            Each option, its default and meaning are documented once, on PlanOptions.

    Returns:
        the :class:`Plan`; ``plan.solver_stats.stage_s`` holds per-stage seconds;
        ``plan.estimate`` the estimated step and modelled peak.

    Raises:
        CaptureError, ShardingRuleError, InfeasiblePlanError: see :mod:`autoparallel.errors`
            (a budget no plan fits raises InfeasiblePlanError with the smallest reachable peak).
        TypeError: an argument of the wrong type, or a keyword that is no option (naming the
            closest ones).
        ConstraintError: a constraint that matches nothing, bad placement text, or a tensor
            that cannot be placed as asked (naming the pattern, tensor and legal placements).
        ValueError: neither (unless ``cost_model`` is profiled) or both of ``mesh_shape`` and
            ``mesh_spec``, a mesh axis below 1, and the bad option values PlanOptions lists.
    """
    opts = PlanOptions.build(options, "plan", **keywords)
    mesh_spec = _plan_mesh(model, meta_inputs, mesh_shape, mesh_spec, mesh, opts.cost_model)
    meta_inputs = _global_inputs(meta_inputs, opts, mesh_spec.shape)
    t0 = time.perf_counter()
    if _pipelined(mesh_spec, opts):
        return _plan_stages(model, meta_inputs, mesh_spec, opts)
    traced = capture(model, meta_inputs, stamp_layers=opts.stamp_layers, mp_policy=opts.mp_policy,
                     device=opts.device)
    t_trace = time.perf_counter() - t0
    p = plan_traced(traced, mesh_spec, opts)
    p.solver_stats.stage_s["trace"] = t_trace
    return p


def _pipelined(mesh_spec: MeshSpec, opts: PlanOptions) -> bool:
    """Whether the plan may have pipeline stages: ``pipeline="auto"`` or a mesh axis named ``"pp"``."""
    return opts.pipeline == "auto" or pipeline_axis(mesh_spec, opts) is not None


def _plan_stages(model, meta_inputs, mesh_spec: MeshSpec, opts: PlanOptions, rows: list | None = None) -> Plan:
    """The plan of :func:`plan` when it may be pipelined (:func:`~autoparallel.solver.stages.
    plan_stages`), over the model's repeated layers, each microbatch captured on demand
    (:func:`_stage_capture`)."""
    layers = _layer_list(model)
    batch = next(t.shape[0] for t in pytree.tree_leaves(meta_inputs) if isinstance(t, torch.Tensor) and t.dim())

    captures: dict[int, object] = {}  # the search prices several stage splits per microbatch size

    def capture_at(microbatches: int):
        if microbatches not in captures:
            captures[microbatches] = _stage_capture(model, meta_inputs, opts, layers.path, microbatches)[0]
        return captures[microbatches]

    best = plan_stages(capture_at, mesh_spec, opts, layers=layers.path, num_layers=len(layers.layers), batch=batch)
    if rows is not None:  # compare(): the hand-written 3-D recipe, priced by the same step model
        rows.append(recipe_row(capture_at, mesh_spec, opts, layers=layers.path, num_layers=len(layers.layers),
                               batch=batch, plan=best))
    return best


def _layer_list(model):
    """The list of repeated layers pipeline stages cut (:func:`~autoparallel.tracer.stamp.find_layer_list`).

    Raises:
        AutoParallelError: the model has none."""
    layers = find_layer_list(model)
    if layers is None:
        raise AutoParallelError(f"pipeline stages cut a model's list of repeated layers, and {type(model).__name__} "
                                "has none (an nn.ModuleList of at least 6 alike layers); plan it without a 'pp' "
                                "mesh axis and with pipeline='off'")
    return layers


def _stage_capture(model, meta_inputs, opts: PlanOptions, layers: str, microbatches: int):
    """One microbatch of ``meta_inputs`` (global shapes) captured, its tied parameters untied
    between the pieces that read them (:func:`~autoparallel.tracer.untie.untie_pieces`);
    returns the capture and the untied names (new → original). One microbatch is the whole
    batch, the unpipelined plan's capture: its ties are kept, as every unpipelined capture's."""
    traced = capture(model, microbatch(meta_inputs, microbatches), stamp_layers=opts.stamp_layers,
                     mp_policy=opts.mp_policy, device=opts.device)
    return traced, untie_pieces(traced, layers) if microbatches > 1 else {}


def compare(model: nn.Module, meta_inputs, *, mesh_shape=None, mesh_spec: MeshSpec | None = None,
            options: PlanOptions | None = None, **keywords) -> Comparison:
    """Plan ``model`` and plan every recipe of :func:`autoparallel.recipes.recipes` (DDP,
    FSDP, Megatron TP, FSDP + TP) on the same capture, strategies and costs: an ILP solve per
    recipe, none skipped. The plan cache is neither read nor written (it keeps no recipe plans).

    Args:
        as :func:`plan`, less ``constraints`` (a recipe is a constraint set).

    Returns:
        a :class:`~autoparallel.recipes.Comparison`; its ``.plan`` holds the baselines in
        its estimate, which ``str(plan)`` prints.

    Raises:
        TypeError: ``constraints`` or ``baselines`` given (a recipe is a constraint set; the
            recipes are the baselines).
        The errors of :func:`plan` for the unconstrained plan; a recipe's ConstraintError or
        InfeasiblePlanError becomes its row's reason.
    """
    for key in ("constraints", "baselines"):
        if key in keywords or (options is not None and getattr(options, key)):
            raise TypeError(f"compare() prices the unconstrained plan against the recipes: pass no {key}")
    opts = PlanOptions.build(options, "compare", **keywords)
    mesh_spec = _plan_mesh(model, meta_inputs, mesh_shape, mesh_spec, None, opts.cost_model)
    if _pipelined(mesh_spec, opts):
        rows: list[Row] = []
        best = _plan_stages(model, _global_inputs(meta_inputs, opts, mesh_spec.shape), mesh_spec, opts, rows)
        return Comparison(mesh_spec, [Row("autoparallel plan", best)] + rows)
    traced = capture(model, _global_inputs(meta_inputs, opts, mesh_spec.shape), stamp_layers=opts.stamp_layers,
                     mp_policy=opts.mp_policy, device=opts.device)
    rows: list[Row] = []
    best = plan_traced(traced, mesh_spec, opts, rows=rows)
    return Comparison(mesh_spec, [Row("autoparallel plan", best)] + rows)


def _global_inputs(meta_inputs, opts: PlanOptions, mesh_shape):
    """The inputs the capture and the plan see: ``meta_inputs`` as given (``inputs="global"``),
    or, under ``inputs="local"`` (one rank's shapes), the global batch: each tensor's dim 0
    times the number of devices (:func:`~autoparallel.tracer.batch.global_batch`). The one
    place the facade turns local shapes into global ones (a re-plan does the same in
    :class:`~autoparallel.codegen.emit.Recapture`).

    Raises:
        ValueError: under ``inputs="local"``, a 0-d tensor input (named).
    """
    if opts.inputs != "local":
        return meta_inputs
    return global_batch(meta_inputs, math.prod(mesh_shape))


def _plan_mesh(model, meta_inputs, mesh_shape, mesh_spec, mesh, cost_model) -> MeshSpec:
    """The :class:`MeshSpec` :func:`plan` plans for, from ``mesh_shape``, ``mesh_spec`` (or its
    deprecated name ``mesh``) or a profiled ``cost_model``; checks ``model`` and ``meta_inputs``.

    Raises:
        TypeError, ValueError: as listed by :func:`plan`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    _refuse_parallel(model)
    if not isinstance(meta_inputs, (dict, tuple, list)):
        raise TypeError(f"meta_inputs must be a dict of keyword arguments or a tuple of positional ones, not "
                        f"{type(meta_inputs).__name__} (wrap a single tensor x as (x,))")
    keyword = "mesh" if mesh is not None else "mesh_spec"  # the one the caller used, for errors
    if mesh is not None:
        warnings.warn("plan(mesh=...) is deprecated; pass mesh_spec=", DeprecationWarning, stacklevel=3)
        if mesh_spec is not None:
            raise ValueError("plan(): give mesh_spec= only (mesh= is its deprecated name)")
        mesh_spec = mesh
    if mesh_spec is None and mesh_shape is None and isinstance(cost_model, CostModel) and cost_model.profile:
        mesh_spec = cost_model.profile.mesh_spec()  # the profiled mesh with its links' alpha and beta
    if (mesh_spec is None) == (mesh_shape is None):
        raise ValueError("plan() needs one of mesh_shape=(...) and mesh_spec=MeshSpec(...), "
                         + ("not both" if mesh_spec is not None else "got neither"))
    if mesh_spec is None:
        return MeshSpec(mesh_shape_tuple(mesh_shape, "mesh_shape"))
    if not isinstance(mesh_spec, MeshSpec):
        raise TypeError(f"{keyword} must be an autoparallel.MeshSpec, not {mesh_spec!r}; pass a shape as mesh_shape=")
    return mesh_spec


def coverage(model: nn.Module, meta_inputs, *, stamp_layers: bool = True) -> CoverageReport:
    """Every ATen op of ``model``'s captured graph, with where its strategies come from (own
    rule, replicated by rule, replicate fallback) and the module paths that use it.

    Raises:
        CaptureError: when torch.export cannot capture the model.
    """
    return coverage_of(capture(model, meta_inputs, stamp_layers=stamp_layers).gm)


def autoparallelize(model: nn.Module, meta_inputs, *, device_mesh, options: PlanOptions | None = None,
                    mesh_spec: MeshSpec | None = None, plan: Plan | str | None = None, replan: bool = True,
                    check_batch_every: int = 100, bucket_cap_mb: float = 25, **keywords) -> ParallelModule:
    """Parallelize ``model`` over ``device_mesh`` in place: the one line.

    Args:
        model: the model with its real weights (every rank may hold any values: rank 0's
            are distributed). It is parallelized in place and returned, as FSDP2's
            ``fully_shard`` does: it keeps its class (as a subclass,
            :class:`~autoparallel.ParallelModule`), submodules, attributes and methods; its
            parameters are replaced, under the same names, by the plan's (build the optimizer
            after the call; one built before raises at ``step()``).
        meta_inputs: dict of keyword arguments or tuple of positional ones: meta tensors
            or FakeTensors with the **global** batch shapes, and the non-tensor arguments
            the module will be called with (``use_cache=False``), whose values are planned for.
            With ``inputs="local"``: the shapes of what one rank passes, every rank its own
            batch (as under DDP with a ``DistributedSampler``); the module computes on the
            ranks' batches concatenated along dim 0 in rank order, its loss and gradients
            those of that global batch.
        device_mesh: a ``torch.distributed.device_mesh.DeviceMesh`` spanning the world, its
            ranks in any order along each axis.
        options / keywords: the planning options, as :func:`plan` takes them
            (:class:`~autoparallel.PlanOptions`), with these differences: ``device`` is the
            mesh's device type; ``cost_model=None`` means the costs of this mesh, measured by
            :func:`autoparallel.profile_mesh` on first use (every rank, seconds) and loaded
            from the cache folder's ``profiles/`` afterwards (the A100 preset when
            ``mesh_spec`` or ``plan`` is given, and under simulated ranks, whose ``fake``
            process group has no network to measure); ``memory_budget=None`` means the
            memory of this rank's device less a 10 % reserve (free GPU memory, or on CPUs
            the host's memory divided among its ranks, ``LOCAL_WORLD_SIZE``). With ``plan=``,
            the plan's own ``outputs``, ``mp_policy`` and ``inputs`` apply.
        mesh_spec: alpha/beta per mesh axis (default: the profile's, or :class:`MeshSpec`
            defaults).
        plan: a :class:`Plan` (or its JSON) to run instead of planning, e.g. one saved with
            ``plan.to_json()`` or edited by hand; it is validated against the captured graph
            (:func:`autoparallel.validate.validate_plan`) on every rank.
        replan: when a call with grad enabled has other inputs than ``meta_inputs`` (other
            keywords, tensor shapes or dtypes, non-tensor values; e.g. no ``labels``, or the
            smaller last batch of an epoch), capture and plan the model again for them, with
            every parameter and buffer pinned to the placement the model holds, and cache the
            new graph (default); ``False`` raises InputMismatchError instead. Costs one
            capture and one ILP solve per new call (seconds), on the call that first sees it,
            on every rank (the plan is solved on rank 0 and broadcast). A new mode
            (``model.eval()`` after planning in training mode) is captured and planned the
            same way whatever ``replan`` says. A new call under ``torch.no_grad()``
            (``generate``) runs the model's own forward on whole parameters instead
            (:class:`~autoparallel.ParallelModule`).
        check_batch_every: compare a fingerprint of the inputs across ranks on the first call
            and every this many calls (one all-reduce of two float64 numbers per input);
            ranks that pass different batches raise InputMismatchError. ``0`` never checks;
            never checked under ``inputs="local"``.
        bucket_cap_mb: the largest gradient bucket in MiB: gradients of parameters replicated
            along mesh axes are all-reduced in buckets of at most this size, each launched
            during the backward as soon as its gradients exist (DDP's argument of that name;
            :mod:`autoparallel.passes.grad_buckets`).

    Returns:
        ``model``, now a :class:`ParallelModule`: call it as before, with the global batch
        on every rank (``inputs="local"``: each rank with its own batch). Under a plan with
        pipeline stages (a mesh axis named ``"pp"``, or ``pipeline="auto"`` choosing them) it
        trains through ``model.step(**batch)`` instead (:mod:`autoparallel.codegen.pipeline`),
        which every plan offers.

    Raises:
        MeshMismatchError: the mesh does not span the whole process group; under
            ``inputs="local"``, a mesh whose devices are not numbered in rank order
            (:func:`~autoparallel.codegen.emit.check_rank_order`).
        PlanMismatchError: a ``plan`` that does not fit the captured graph or the mesh (the
            message names the first mismatch); ValueError: unreadable plan JSON.
        TypeError, ValueError: an argument of the wrong type or value (named in the message).
        CaptureError, ShardingRuleError, InfeasiblePlanError: see :mod:`autoparallel.errors`;
            planning runs on rank 0 and any error it raises is raised on every rank (with
            ``replan=True`` or a new mode, also from a call; AutoParallelError there when the
            new capture reads other parameters than the first).
    """
    opts = PlanOptions.build(options, "autoparallelize", **keywords)
    cap = _bucket_cap_bytes(bucket_cap_mb)
    plan = _check_run(model, device_mesh, plan)
    mesh, cost_model = _mesh_and_costs(device_mesh, opts.cost_model, mesh_spec, plan, opts.cache_dir)
    opts = PlanOptions.build(opts, cost_model=cost_model, device=device_mesh.device_type,
                             memory_budget=_device_budget(opts.memory_budget, device_mesh),
                             replicate_buffers=not model.training,
                             outputs=plan.outputs if plan is not None else opts.outputs,
                             mp_policy=plan.mp_policy if plan is not None else opts.mp_policy,
                             inputs=plan.inputs if plan is not None else opts.inputs)
    if opts.inputs == "local":
        check_rank_order(device_mesh)  # before planning: the batches must concatenate in rank order
    if pipeline_axis(mesh, opts) is not None:
        _refuse_local_inputs(opts)  # before planning
    if plan is None and _pipelined(mesh, opts):  # the search may keep no stages: then it runs as any plan
        global_inputs = _global_inputs(meta_inputs, opts, mesh.shape)
        with maybe_disable_local_tensor_mode():
            plan = on_rank0(lambda: _plan_stages(model, global_inputs, mesh, opts))
    if plan is not None and plan.pipeline is not None:
        return _parallelize_stages(model, _global_inputs(meta_inputs, opts, mesh.shape), device_mesh, opts, plan, cap)
    with maybe_disable_local_tensor_mode():  # capture and planning see no simulated ranks
        traced = capture(model, _global_inputs(meta_inputs, opts, mesh.shape), stamp_layers=opts.stamp_layers,
                         mp_policy=opts.mp_policy, device=opts.device)
        if plan is None:
            plan = plan_on_rank0(traced, mesh, opts)
        else:
            validate_plan(plan, traced, mesh_shape=tuple(device_mesh.mesh.shape))
        recapture = Recapture(model, mesh, device_mesh, opts, keywords=isinstance(meta_inputs, dict), replan=replan)
    pmodel = emit(model, traced, plan, device_mesh, check_batch_every=check_batch_every, bucket_cap_bytes=cap)
    pmodel._ap.recapture = recapture
    return pmodel


def _parallelize_stages(model, meta_inputs, device_mesh, opts: PlanOptions, plan: Plan, cap: int) -> ParallelModule:
    """:func:`autoparallelize` for a pipelined ``plan``: captured for its microbatch, emitted by
    :func:`~autoparallel.codegen.emit.emit_pipeline`.

    Raises:
        AutoParallelError: under ``inputs="local"`` (a pipeline's first stage reads the whole
            batch), or as :func:`autoparallelize`.
    """
    _refuse_local_inputs(opts)
    layers = _layer_list(model).path

    def capture_stage(module):
        return _stage_capture(module, meta_inputs, opts, layers, plan.pipeline.microbatches)

    def capture_and_plan(module):  # another mode or module attributes: the same stages, parameters pinned
        traced, untied = capture_stage(module)
        return traced, untied, on_rank0(lambda: replan_stages(traced, plan, opts))

    with maybe_disable_local_tensor_mode():
        traced, untied = capture_stage(model)
        validate_plan(plan, traced, mesh_shape=plan.mesh.shape)
        try:  # before the module drops other stages' parameters: another mode is captured from it
            skeleton = meta_skeleton(model, FakeTensorMode(allow_non_fake_inputs=True))
        except AutoParallelError as e:
            skeleton = e
    restage = Restage(skeleton, capture_and_plan, device_mesh)
    return emit_pipeline(model, traced, plan, device_mesh, untied, restage, cap)


def _refuse_local_inputs(opts: PlanOptions) -> None:
    """Raises:
        AutoParallelError: ``inputs="local"``, which pipeline stages do not take (the first
            stage reads the whole batch)."""
    if opts.inputs == "local":
        raise AutoParallelError("a pipelined plan reads the global batch on every rank: use inputs='global', or "
                                "pipeline='off' and no mesh axis named 'pp'")


def _check_run(model: nn.Module, device_mesh, plan) -> Plan | None:
    """The checks of :func:`autoparallelize` that need no capture; returns ``plan`` read from
    its JSON when given as text.

    Raises:
        TypeError: ``plan`` or ``device_mesh`` of the wrong type.
        MeshMismatchError: no process group, or a mesh that does not span the world.
        AutoParallelError: parameters on the meta device, or a model already parallelized.
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
    _refuse_parallel(model)
    on_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if on_meta:
        raise AutoParallelError(f"autoparallelize needs the model's real weights, but {len(on_meta)} parameters "
                                f"(e.g. {on_meta[0]}) are on the meta device; load or initialize them first, "
                                "or use autoparallel.plan() to plan without weights")
    return plan


def _refuse_parallel(model: nn.Module) -> None:
    """Raises:
        AutoParallelError: ``model`` is already parallelized (in place, by autoparallelize)."""
    if isinstance(model, ParallelModule):
        raise AutoParallelError(f"{type(model).__name__} is already parallelized; plan or parallelize the "
                                "model before autoparallelize (e.g. a copy made before the call)")


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


def _bucket_cap_bytes(bucket_cap_mb) -> int:
    """``bucket_cap_mb`` MiB in bytes (at least 1).

    Raises:
        ValueError: not a positive number."""
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {bucket_cap_mb!r}")
    return max(1, int(bucket_cap_mb * 2**20))


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
