"""The planning stage: a captured graph, a mesh and the options in, a :class:`Plan` out.

:func:`plan_traced` reads the plan cache, lists each node's strategies, narrows them by the
options (``parallelism``, pinned placements, constraints), models memory, solves the ILP
(and the checkpoint search under the budget), prices the hand-written recipes when asked,
and stores the plan. :func:`plan_on_rank0` solves once and broadcasts the plan, so that
every rank runs the same one.
"""

from __future__ import annotations

import builtins
import logging
import time
from dataclasses import dataclass, replace

import torch.distributed as dist

from .. import cache, errors, precision, progress, recipes, units
from ..constraints import cache_key as constraints_key, policy_cast, resolve as resolve_constraints
from ..constraints import restrict as restrict_strategies
from ..errors import AutoParallelError
from ..graph import tensor_inputs
from ..mesh import MeshSpec
from ..options import PlanOptions
from ..placement import R, Shard, Spec, spec_str, spec_to_json
from ..plan import Plan
from ..strategies import StrategyGenerator
from ..strategies.generator import split_inputs
from ..tracer.annotate import node_info
from .costs import CostModel
from .layout import Redistributor
from .memory import MemoryModel, preset_capacity, resolve_budget
from .planner import Planner
from .pricing import written_back_outputs

log = logging.getLogger("autoparallel")


@progress.planning
def plan_traced(traced, mesh: MeshSpec, options: PlanOptions, *, pinned: dict[str, Spec] | None = None,
                rows: list | None = None, prepared: "Prepared | None" = None) -> Plan:
    """The plan of ``traced`` (a :class:`~autoparallel.tracer.capture.TracedModel`, captured
    under ``options.mp_policy``) on ``mesh``.

    Args:
        pinned: parameter/buffer name → spec (as in ``Plan.param_placements``): each
            parameter's and buffer's ``get_attr`` node kept at that spec (the plan of a new
            mode or input shape of a running module; no recipes are priced for it).
        rows: when a list, every recipe is planned (none skipped by its lower bound) and its
            :class:`~autoparallel.recipes.Row` appended (:func:`autoparallel.compare`); the
            plan cache is then neither read nor written.
        prepared: :func:`prepare` of the same ``traced``, ``mesh``, ``pinned`` and ``options``
            but for the memory budget: its strategies, memory model and built problem are
            reused (the pipeline stage search solves one capture under two budgets).

    Raises:
        AutoParallelError: a pinned parameter or buffer missing or without such a strategy;
            CaptureError, ShardingRuleError, InfeasiblePlanError, ConstraintError as
            :func:`autoparallel.plan` lists them.
    """
    cost_model = options.cost_model or CostModel()
    budget = resolve_budget(options.memory_budget, lambda: preset_capacity(cost_model.device))
    baselines = (options.baselines or rows is not None) and pinned is None
    folder = cache.cache_path(options.cache_dir) if rows is None else None
    if folder is not None:
        user_pins = resolve_constraints(options.constraints, traced, mesh) if options.constraints else []
        key = cache.plan_key(traced, mesh, cost_model, _cache_options(options, budget, pinned, user_pins))
    else:
        key = ""
    hit = _cached(folder, key, traced, mesh, pinned)
    if hit is not None:
        return hit
    prepared = prepared or prepare(traced, mesh, options, pinned=pinned)
    planner, user_pins = prepared.planner, prepared.user_pins
    progress.stage("costs and ILP solve")
    plan = _solve(planner, options, budget, prepared)
    plan.estimate = replace(plan.estimate, costs=cost_model.describe())
    st = plan.solver_stats
    log.info("ILP: %d node vars, %d edge vars, solved by %s in %.2f s (costs %.2f s); estimated step %s",
             st.binary_vars, st.edge_vars, st.solver, st.solve_s, st.stage_s["costs"],
             units.seconds(plan.estimate.step_time_s))
    st.stage_s.update(strategies=prepared.strategies_s, memory=prepared.memory_s)
    st.stamped_layers = traced.stamped_layers
    st.cache = "miss" if folder is not None else "off"
    plan.inspection.fallback_ops = sorted(prepared.fallbacks)
    plan.mp_policy = options.mp_policy
    plan.inputs = options.inputs
    if user_pins:
        plan.inspection.placement_constraints = {p.pattern: p.text(mesh.axis_names) for p in user_pins}
    if baselines:
        _price_recipes(plan, traced, mesh, options, planner, prepared.unconstrained, budget, rows)
    cache.store(folder, key, plan)
    return plan


@dataclass
class Prepared:
    """What :func:`plan_traced` builds before it solves, reusable across memory budgets: the
    narrowed strategies' :class:`Planner` (with the memory model), the strategies before
    narrowing (what the recipes narrow), the fallback ops, the resolved constraints, the
    seconds each part took, and the built problem once a solve built it."""

    planner: Planner
    unconstrained: dict
    fallbacks: set
    user_pins: list
    strategies_s: float
    memory_s: float
    built: object = None


def prepare(traced, mesh: MeshSpec, options: PlanOptions, *, pinned: dict[str, Spec] | None = None) -> Prepared:
    """The strategies of ``traced`` on ``mesh`` narrowed by ``options`` and ``pinned``, and
    their planner (:class:`Prepared`); nothing here depends on ``options.memory_budget``."""
    cost_model = options.cost_model or CostModel()
    user_pins = resolve_constraints(options.constraints, traced, mesh) if options.constraints else []
    t0 = time.perf_counter()
    progress.stage("strategies")
    gen = StrategyGenerator(mesh.shape, strict=options.strict)
    strategies = gen.generate(traced.gm)
    unconstrained = _narrow(strategies, traced, options, mesh, pinned, user_pins, gen.aliases)
    t1 = time.perf_counter()
    log.info("strategies: %d nodes, %d strategies (%.2f s)", len(strategies),
             sum(len(v) for v in strategies.values()), t1 - t0)
    progress.stage("memory model")
    planner = _planner(traced, mesh, options, cost_model, strategies, gen.aliases)
    return Prepared(planner, unconstrained, set(gen.fallbacks), user_pins, t1 - t0, time.perf_counter() - t1)


def _cache_options(options: PlanOptions, budget, pinned, user_pins) -> dict:
    """The options part of the plan cache key (:func:`autoparallel.cache.plan_key`)."""
    key = options.cache_key(budget)
    if pinned is not None:
        key["pinned"] = {k: spec_to_json(v) for k, v in sorted(pinned.items())}
        key["baselines"] = False
    if user_pins:
        key["constraints"] = constraints_key(user_pins)
    return key


def _cached(folder, key: str, traced, mesh: MeshSpec, pinned) -> Plan | None:
    """The cached plan for ``key`` (validated against the graph), unless it moves a pinned
    parameter or buffer."""
    hit = cache.load(folder, key, traced, mesh)  # a stale or edited file is ignored
    if hit is not None and pinned is not None and any(tuple(s) != tuple(pinned.get(k, s))
                                                      for k, s in hit.param_placements.items()):
        log.warning("ignoring the cached plan: it moves a parameter or buffer the module holds elsewhere; "
                    "planning again")
        return None
    if hit is not None:
        hit.solver_stats.cache = "hit"
        hit.solver_stats.stamped_layers = traced.stamped_layers  # the graph is the same either way
    return hit


def _solve(planner: Planner, options: PlanOptions, budget: int | None, prepared: Prepared | None = None) -> Plan:
    """The planner's plan within ``budget``. When the fastest plan does not fit (the plan had to
    shard more or recompute, or none fits), the planner also prices, with ``options.zero``,
    optimizer states sharded over the axes that replicate their parameters
    (:mod:`autoparallel.strategies.zero`) and, with ``options.offload``, parameters held in host
    memory (:mod:`autoparallel.strategies.offload`), and the faster of the two plans wins: either
    may cost less than recomputation or sharding, and offloading may be the only way to fit.

    Raises:
        InfeasiblePlanError: no plan fits, even so.
    """
    keywords = dict(solver=options.solver, time_limit=options.time_limit, memory_budget=budget,
                    checkpointing=options.checkpointing)
    ways = [w for w, on in (("optimizer states sharded", options.zero),
                            ("parameters offloaded to host memory", options.offload)) if on]
    try:
        if prepared is not None and prepared.planner is planner:  # the problem built once across budgets
            t0 = time.perf_counter()
            if prepared.built is None:
                prepared.built = planner.build_problem()
            prepared.built.ilp.memory_rows = []  # a previous budget's rows
            t_build = time.perf_counter() - t0
            plan = planner.solve(**keywords, built=prepared.built)
            plan.solver_stats.stage_s["costs"] += t_build
        else:
            plan = planner.solve(**keywords)
    except errors.InfeasiblePlanError as e:
        if not ways or budget is None:
            raise
        log.info("no plan fits device memory (%s); pricing %s", e, " and ".join(ways))
        try:
            return planner.with_state_sharding(options.zero, options.offload).solve(**keywords)
        except errors.InfeasiblePlanError as again:
            raise errors.InfeasiblePlanError(f"{again} (even with {' and '.join(reversed(ways))})") from None
    if not ways or budget is None or (plan.solver_stats.memory_rounds <= 1 and not plan.checkpoint):
        return plan
    saved = planner.with_state_sharding(options.zero, options.offload).solve(**keywords)
    faster = saved.estimate.step_time_s < plan.estimate.step_time_s
    log.info("with %s the step is %s (%s without): %s", " and ".join(ways), units.seconds(saved.estimate.step_time_s),
             units.seconds(plan.estimate.step_time_s), "taken" if faster else "not taken")
    return saved if faster else plan


def _narrow(strategies, traced, options: PlanOptions, mesh: MeshSpec, pinned, user_pins, aliases) -> dict:
    """Narrow ``strategies`` in place by the options, pins and constraints; returns a copy of
    them before ``parallelism``, pins and constraints (what the recipes narrow). Under
    ``inputs="local"`` every tensor input arrives split, each rank holding its own batch
    (:func:`~autoparallel.strategies.generator.split_inputs`): the recipes see it so too.

    Raises:
        ValueError: under ``inputs="local"``, a 0-d tensor input or one the mesh cannot split.
    """
    repl = (R,) * mesh.ndim
    if options.inputs == "local":
        split_inputs(strategies, mesh.shape)
    # buffers written back whole after each forward (in the other mode too, with replicate_buffers)
    written = set(traced.buffers) if options.replicate_buffers else set(traced.buffer_mutations.values())
    for node in strategies:
        if node.op == "get_attr" and node.target in written:
            strategies[node] = [s for s in strategies[node] if s.outputs[0] == repl]
    unconstrained = {n: list(ss) for n, ss in strategies.items()}
    if options.parallelism == "data":
        for node in strategies:
            if node.op == "get_attr":
                strategies[node] = [s for s in strategies[node] if s.outputs[0] == repl]
    if options.parallelism == "fsdp":
        _fsdp(strategies, repl)
    if pinned is not None:
        _pin(strategies, traced, pinned)
    restrict_strategies(strategies, aliases, user_pins, mesh.axis_names)
    return unconstrained


def _planner(traced, mesh: MeshSpec, options: PlanOptions, cost_model: CostModel, strategies, aliases) -> Planner:
    """The :class:`Planner` of ``strategies``, with the memory model of the graph."""
    names = dict(traced.params)
    names.update(traced.buffers)
    whole = written_back_outputs(traced.gm, traced.buffer_mutations)  # returned whole, to be written back
    memory = MemoryModel(traced.gm, aliases, mesh.shape, optimizer=options.optimizer,
                         optimizer_impl=options.optimizer_implementation(), device=options.device,
                         traced_on=traced.device, outputs=options.outputs, whole_outputs=whole,
                         cost_model=cost_model, layout=Redistributor(cost_model.bind(mesh)), inputs=options.inputs)
    return Planner(traced.gm, strategies, aliases, mesh, cost_model, names, share_layers=options.share_layers,
                   memory=memory, outputs=options.outputs, whole_outputs=whole,
                   reduce_dtype=precision.reduce_dtype(options.mp_policy), optimizer=options.optimizer,
                   optimizer_impl=options.optimizer_implementation())


def _price_recipes(plan: Plan, traced, mesh, options: PlanOptions, planner, unconstrained, budget, rows) -> None:
    """Price the hand-written recipes on ``planner`` into the plan's baselines (and ``rows``)."""
    progress.stage("baselines")
    t0 = time.perf_counter()
    priced = recipes.price(traced, mesh, planner, unconstrained, solver=options.solver,
                           time_limit=options.time_limit, memory_budget=budget, costs=plan.estimate.costs,
                           every=rows is not None)
    if rows is not None:
        rows.extend(priced)
    plan.inspection.baselines = recipes.baselines(priced)
    plan.solver_stats.stage_s["baselines"] = time.perf_counter() - t0
    log.info("baselines: %d recipes priced (%.2f s)", len(priced), plan.solver_stats.stage_s["baselines"])


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


def _pin(strategies, traced, pinned: dict[str, Spec]) -> None:
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


def plan_on_rank0(traced, mesh: MeshSpec, options: PlanOptions, pinned=None) -> Plan:
    """:func:`plan_traced` on rank 0, broadcast to every rank (:func:`on_rank0`)."""
    return on_rank0(lambda: plan_traced(traced, mesh, options, pinned=pinned))


def on_rank0(solve) -> Plan:
    """``solve()`` (a :class:`Plan`) on rank 0, broadcast to every rank (every rank solves
    when there is one, or when all are simulated in this process). Call with local tensor
    mode off.

    Raises:
        whatever planning raised on rank 0, on every rank: an error of autoparallel or of
        Python's builtins with the same type and message, anything else as AutoParallelError.
    """
    if dist.get_world_size() == 1 or dist.get_backend() == "fake":
        return solve()
    payload = [None]
    if dist.get_rank() == 0:
        try:
            payload = [("plan", solve().to_json())]
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
