"""The planner: prices a traced graph's strategies (:mod:`.pricing`), builds the sharding ILP
(:mod:`.problem`), searches for the fastest plan under the memory budget (:mod:`.memory_search`)
and decodes it into the :class:`~autoparallel.plan.Plan` (:mod:`.decode`), with what its views
read (:mod:`.inspect`)."""

from __future__ import annotations

import copy
import time
from dataclasses import replace

import torch
import torch.fx as fx

from ..mesh import MeshSpec
from ..errors import InfeasiblePlanError
from ..plan import Plan
from ..results import Inspection, SolverStats
from ..graph import layer_of, layers_of
from ..strategies import Strategy
from ..strategies.offload import with_offload
from ..strategies.zero import with_zero
from .shared_layers import layer_templates
from .costs import CostModel
from .decode import make_plan
from .inspect import alternatives, memory_timeline, state_reads
from .memory import DEFAULT_OPTIMIZER, MemoryModel
from .memory_search import MemorySearch
from .pricing import Pricing
from .problem import GroupedProblem, build_problem
from .remat import chain_stages


class Planner:
    """Prices every strategy and resharding edge of a graph and solves for the plan.

    Its prices are :attr:`pricing` (a :class:`~autoparallel.solver.pricing.Pricing`, shared
    with its :meth:`restricted` copies).

    Args:
        gm: the traced graph (annotated by the tracer).
        strategies: node → strategies (from the strategy generator).
        aliases: getitem node → (producer, output index).
        mesh: the MeshSpec.
        cost_model: a :class:`CostModel` (bound to ``mesh`` here).
        param_names: graph target → all names of that parameter/buffer.
        share_layers: give identical repeated layers one set of ILP variables
            (:mod:`autoparallel.solver.shared_layers`).
        memory: the step's :class:`~autoparallel.solver.memory.MemoryModel` (peak memory
            estimate and budget rows); ``None`` to leave memory out.
        outputs / whole_outputs / reduce_dtype / optimizer / optimizer_impl: what is priced, as
            :class:`~autoparallel.solver.pricing.Pricing` takes them.
    """

    def __init__(self, gm, strategies, aliases, mesh: MeshSpec, cost_model: CostModel, param_names,
                 share_layers: bool = True, memory: MemoryModel | None = None, outputs: str = "replicated",
                 whole_outputs: frozenset[int] = frozenset(), reduce_dtype: torch.dtype | None = None,
                 optimizer: str = DEFAULT_OPTIMIZER, optimizer_impl: str = "for-loop"):
        self.gm = gm
        self.strategies = strategies
        self.aliases = aliases
        self.param_names = param_names
        self.nodes = list(strategies)
        self.pricing = Pricing(gm, self.nodes, aliases, mesh, cost_model, outputs=outputs,
                               whole_outputs=whole_outputs, reduce_dtype=reduce_dtype, optimizer=optimizer,
                               optimizer_impl=optimizer_impl)
        self._layer = {n: layer_of(n) for n in self.nodes}
        self.share_layers = share_layers
        self.template = layer_templates(self.nodes, strategies) if share_layers else {n: n for n in self.nodes}
        self.memory = memory

    checkpoint_per_layer: bool = False
    """Under ``checkpointing="full"`` or ``"selective"``, one region per repeated layer (as
    torchtitan's per-block activation checkpointing; what its hand-written pipeline recipe
    prices, :func:`~autoparallel.solver.stages.recipe_row`) instead of one per sub-layer
    (:func:`~autoparallel.solver.remat.chain_stages`)."""

    def restricted(self, strategies) -> "Planner":
        """A planner of the same graph, cost model, memory model and options over
        ``strategies``: the same nodes, each with a subset of its strategies here (e.g. a copy
        that :func:`autoparallel.constraints.restrict` narrowed) or a superset
        (:meth:`with_state_sharding`). It shares this planner's
        :attr:`pricing` and its memoized redistribution paths, so it prices no path twice
        (:mod:`autoparallel.recipes` prices hand-written recipes beside the plan so).

        Raises:
            ValueError: ``strategies`` over other nodes than this planner's.
        """
        if list(strategies) != self.nodes:
            raise ValueError("a restricted planner needs strategies for exactly the planner's nodes, in its order")
        other = copy.copy(self)
        other.strategies = strategies
        if self.share_layers and not self._same_count_classes(strategies):
            other.template = layer_templates(self.nodes, strategies)
        return other

    def with_state_sharding(self, zero: bool, offload: bool) -> "Planner":
        """A planner of the same graph whose trainable parameters may also, with ``zero``, shard
        their optimizer states over the axes that replicate them (ZeRO stage 1,
        :func:`~autoparallel.strategies.zero.with_zero`) and, with ``offload``, be held in host
        memory (:func:`~autoparallel.strategies.offload.with_offload`)."""
        strategies, mesh_shape = self.strategies, self.pricing.mesh.shape
        strategies = with_zero(strategies, mesh_shape) if zero else strategies
        return self.restricted(with_offload(strategies, mesh_shape) if offload else strategies)

    def _same_count_classes(self, strategies) -> bool:
        """Whether ``strategies`` sort the repeated layers of each list into the same classes
        of equal per-node strategy counts as this planner's. :func:`layer_templates` then
        gives the same templates: its signature of a layer is the layer's structure, which
        does not change, and these counts; and computing it again walks every node's
        arguments (0.5 s at Llama-3-8B scale)."""
        for by_index in layers_of(self.nodes).values():
            mine: dict[tuple, int] = {}
            theirs: dict[tuple, int] = {}
            for idx in sorted(by_index):
                a = tuple(len(self.strategies.get(n, ())) for n in by_index[idx])
                b = tuple(len(strategies.get(n, ())) for n in by_index[idx])
                if mine.setdefault(a, len(mine)) != theirs.setdefault(b, len(theirs)):
                    return False
        return True

    def solve(self, *, solver: str = "cbc", time_limit: float = 60.0, memory_budget: int | None = None,
              checkpointing: str = "auto", max_rounds: int = 12, inspect: bool = True,
              built: GroupedProblem | None = None) -> Plan:
        """Solve for the fastest plan whose modelled peak memory fits ``memory_budget`` bytes.

        Stage 1: the fastest plan; when its modelled peak is over budget, the memory at the
        steps where plans peak is priced into the objective (Lagrangian relaxation, at most
        ``max_rounds`` solves: :meth:`~.memory_search.MemorySearch.stage1`) until the fastest
        fitting plan is found. Under ``checkpointing="auto"``, when the fastest plan is over budget
        and a sharding that fits costs more than recomputing on the fastest plan, that recomputation
        wins (:meth:`_faster_with_recompute`); when no sharding alone fits, stage 2
        (:mod:`.remat`) picks activations to recompute on the plan of stage 1, re-solving stage 1 with a
        tighter allowance a bounded number of times until the recomputation schedule fits; ``"off"``
        raises instead; ``"full"`` recomputes every stage of the chain on the stage-1 plan (the fastest
        fitting one, else the fastest), ``"selective"`` runs every stage selectively (matmul and
        attention outputs kept), each raising when even that is over budget
        (:meth:`~.memory_search.MemorySearch.every_stage`). Under ``"auto"`` stage 2 chooses per
        stage among storing, selective and full recomputation. ``inspect``
        records what the summary, explain and plot read (``plan.inspection``: :meth:`_inspectable`;
        about a tenth of the planning time at Llama-3-8B scale); a plan priced only for its estimate skips it.
        ``built``: this planner's :meth:`build_problem`, when the caller already built it.
        ``plan.solver_stats.stage_s`` holds the seconds of each part: ``costs`` (pricing, building
        the problem), ``stage1`` (every stage-1 solve, model building included), ``remat``
        (stage 2), ``inspect``.

        Raises:
            InfeasiblePlanError: when no plan fits the budget; the message gives the
                smallest peak the planner can reach.
        """
        t0 = time.perf_counter()
        built = built or self.build_problem()
        t_costs = time.perf_counter() - t0
        search = MemorySearch(built, self.memory, solver=solver, time_limit=time_limit, max_rounds=max_rounds)
        t1 = time.perf_counter()
        found = search.stage1(memory_budget)
        t_stage1 = time.perf_counter() - t1
        checkpoint = plan = None
        pinned = checkpointing in ("full", "selective") and self.memory is not None
        every_stages = chain_stages(self.memory.nodes, per_layer=self.checkpoint_per_layer) if pinned else {}
        if every_stages:
            found, plan, checkpoint = search.every_stage(every_stages, found, memory_budget,
                                                         lambda c: self.make_plan(c, built.edges), self._forward_s,
                                                         checkpointing)
        elif found is None:
            stages = chain_stages(self.memory.nodes) if checkpointing == "auto" else {}
            if not stages:
                raise InfeasiblePlanError(search.budget_message(memory_budget))
            found, plan, checkpoint = search.two_stage(stages, memory_budget, lambda c: self.make_plan(c, built.edges),
                                                       self._forward_s)
        elif found[2] > 1 and checkpointing == "auto":
            found, plan, checkpoint = self._faster_with_recompute(search, found, memory_budget, built)
        t_remat = time.perf_counter() - t1 - t_stage1
        choice, sol, rounds = found
        plan = plan or self.make_plan(choice, built.edges)
        if memory_budget is not None:
            plan.estimate = replace(plan.estimate, memory_budget_bytes=int(memory_budget))
        if checkpoint is not None:
            plan.checkpoint, peak = checkpoint
            recompute = plan.checkpoint.recompute_s
            plan.estimate = replace(plan.estimate, step_time_s=plan.estimate.step_time_s + recompute,
                                    recompute_s=recompute, peak_memory_bytes=peak)
        plan.solver_stats = SolverStats(**sol.stats, nodes=len(self.nodes), edges=len(built.ilp.edges),
                                        strategies=sum(len(s) for s in self.strategies.values()),
                                        memory_rows=len(built.ilp.memory_rows), memory_rounds=rounds, **built.stats,
                                        stage_s={"costs": t_costs, "stage1": t_stage1, "remat": t_remat})
        if inspect:
            self._inspectable(plan, choice, built.edges)
        return plan

    def _faster_with_recompute(self, search: MemorySearch, found, budget: int, built: GroupedProblem):
        """``found`` (a stage-1 plan that fits ``budget`` by sharding more than the fastest plan)
        or, when faster, the fastest plan with Rotor's recomputation within ``budget``
        (:meth:`~.memory_search.MemorySearch.recompute`): a little recomputation often costs
        less than the collectives of the sharding that avoids it. ``(found, plan, checkpoint)``
        as :meth:`~.memory_search.MemorySearch.two_stage` returns them (``checkpoint`` ``None``
        for ``found``)."""
        plan = self.make_plan(found[0], built.edges)
        stages = chain_stages(self.memory.nodes)
        if not stages or search.fastest is None:
            return found, plan, None
        alt = search.recompute(search.fastest, stages, budget, lambda c: self.make_plan(c, built.edges),
                               self._forward_s)
        if isinstance(alt, tuple) and alt[1].estimate.step_time_s + alt[2][0].recompute_s < plan.estimate.step_time_s:
            return alt
        return found, plan, None

    def _inspectable(self, plan: Plan, choice, edges) -> None:
        """Record what the plan's summary, explain and plot read (:mod:`autoparallel.solver.inspect`):
        parameter names per node and what they are read through, each node's alternatives, the
        memory timeline."""
        t0 = time.perf_counter()
        state = {n.name: list(self.param_names[n.target]) for n in self._state_nodes()}
        timeline = memory_timeline(self.memory, choice) if self.memory is not None else None
        alts = alternatives(self.pricing, self.strategies, self.template, choice, edges)
        plan.inspection = Inspection(state_nodes=state, state_reads=state_reads(self.gm, state),
                                     alternatives=alts, memory_timeline=timeline)
        plan.solver_stats.stage_s["inspect"] = time.perf_counter() - t0


    def build_problem(self) -> GroupedProblem:
        """The sharding ILP of this planner's strategies (:func:`~.problem.build_problem`)."""
        return build_problem(self.pricing, self.strategies, self.template, self._layer, self._state_nodes())

    def make_plan(self, choice: dict[fx.Node, Strategy], edges=None) -> Plan:
        """The Plan of a given strategy choice (``edges``: the edges to redistribute on, default
        all: :func:`~.decode.make_plan`)."""
        edges = list(self.pricing.edges()) if edges is None else edges
        return make_plan(self.pricing, choice, edges, self.param_names, self.memory)

    def _forward_s(self, node: fx.Node, s: Strategy) -> float:
        """Seconds of ``node``'s forward under ``s``."""
        return self.pricing.node_cost(node, s, backward=False)[0]

    def _state_nodes(self) -> list[fx.Node]:
        """The ``get_attr`` nodes of parameters and buffers."""
        return [n for n in self.nodes if n.op == "get_attr" and n.target in self.param_names]
