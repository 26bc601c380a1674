"""The search for the fastest plan under a memory budget (bytes per device).

Stage 1 solves the sharding ILP, and while the plan's modelled peak is over the budget prices
the memory at the steps where plans peak into the objective (Lagrangian relaxation: Fisher,
Management Science 1981). Stage 2, when no sharding alone fits, hands stage-1 plans of
decreasing memory allowance to Rotor's recomputation schedule (:mod:`autoparallel.solver.rotor`,
:mod:`autoparallel.solver.remat`). A budget nothing meets raises
:class:`~autoparallel.errors.InfeasiblePlanError` with the smallest peak reached.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch.fx as fx

from .. import units
from ..errors import InfeasiblePlanError
from ..plan import Plan
from ..strategies import Strategy
from .decode import choice_of
from .ilp import ILPSolution, solve
from .memory import MemoryModel
from .problem import GroupedProblem
from .remat import build_chain, checkpoint_plan
from .rotor import InfeasibleBudget, checkpoint_every_stage, selective_every_stage, solve as rotor_solve

log = logging.getLogger(__name__)


DUALITY_GAP = 0.01
"""Stage 1 stops once its fastest fitting plan is within this share of the Lagrangian lower
bound (the best dual value so far): no plan within the budget can be faster by more. A 2-layer
GPT-2 on (2, 2) with ZeRO twins under 0.9 of its fastest peak: 5 solves instead of 11, the same
plan."""


STALL_RAISES = 3
STALL_PROGRESS = 0.05


def _stalled(peaks: list[int], budget: int) -> bool:
    """Whether the last :data:`STALL_RAISES` raises of the price (×4 each, so ×64 in all) came
    less than :data:`STALL_PROGRESS` of the way from the best peak before them to ``budget``:
    then no plan is taken to fit. The priced rows are linear lower bounds, which the solver can
    keep lowering while the modelled peak stays put: Llama-3-8B on 8 × 8 at 20 GiB, whose plans
    only recomputation fits, peaked at 50.4-51.7 GiB over nine solves from 0.07 to 4.5e3 s/GiB."""
    if len(peaks) <= STALL_RAISES:
        return False
    before = min(peaks[:-STALL_RAISES])
    return min(peaks[-STALL_RAISES:]) > before - STALL_PROGRESS * (before - budget)


class MemorySearch:
    """Plans of one problem under memory budgets.

    Args:
        built: the sharding ILP (:func:`~autoparallel.solver.problem.build_problem`).
        memory: the step's :class:`~autoparallel.solver.memory.MemoryModel`, or ``None``
            (then every budget is met by the fastest plan).
        solver: the ILP solver's name; time_limit: seconds per solve; max_rounds: solves of
            stage 1 at most.
    """

    def __init__(self, built: GroupedProblem, memory: MemoryModel | None, *, solver: str, time_limit: float,
                 max_rounds: int):
        self.built, self.memory = built, memory
        self.solver, self.time_limit, self.max_rounds = solver, time_limit, max_rounds
        self.fastest = None  # (choice, solution, 1) of the fastest plan, once stage 1 has solved it

    def stage1(self, budget: int | None):
        """``(choice, solution, solves)`` of the fastest plan found within ``budget`` bytes, or
        ``None`` when none is found.

        The fastest plan first; when its modelled peak is over ``budget``, Lagrangian
        relaxation of the memory rows (Fisher, "The Lagrangian relaxation method for solving
        integer programming problems", Management Science 1981, §2): the bytes held at the steps
        where plans peaked are priced at ``lam`` seconds per byte in the objective, first at
        the step time of the fastest plan per byte it is over budget, then ×4 until a plan
        fits (none, when ×4 lowers the bytes priced by less than 0.1 % of them without a new
        peak step priced: Llama-3-8B on 8 × 8 at 20 GiB, which only recomputation fits, ran all
        12 solves per search at ×4 up to 7e4 s/GiB, the last four the same plan; or when the
        peak stalls: :func:`_stalled`), then bisected (geometric mean; quartered while none is known not to fit) until the
        largest price that does not fit is within 1.2× of the smallest that does, or after
        ``max_rounds`` solves; none when the bytes held at the fastest plan's peak step, each
        group's smallest summed (a lower bound on every plan's bytes there), are over the
        budget (DeepSeek-V3 on 64 × 8: 11 solves, 55 s, each peaking near 200 GiB of a 72 GiB
        budget before); the fastest fitting plan (by its unpenalized seconds) wins, and
        one as fast as the fastest plan (kept as :attr:`fastest`) or within
        :data:`DUALITY_GAP` of the best Lagrangian bound so far ends the search. Each solve keeps the
        unconstrained problem's shape (the penalty is a cost per group strategy), whose LP
        relaxation solves integral in about a second at Llama-3-8B scale; hard memory rows
        made CBC branch until its time limit (60 s per row added). A Lagrangian plan may be
        slower than the optimum within the budget by the duality gap.
        """
        problem = self.built.ilp
        sol = solve(problem, solver=self.solver, time_limit=self.time_limit)
        choice = choice_of(self.built, sol)
        if not problem.memory_rows:
            self.fastest = (choice, sol, 1)
        if budget is None or self.memory is None:
            return choice, sol, 1
        est = self.memory.estimate(choice)
        if est.peak_bytes <= budget:
            return choice, sol, 1
        rows = {est.peak_step: self.memory_row(est.peak_step)}
        floor = sum(min(r) for r in rows[est.peak_step] if r)
        if floor > budget:
            log.info("memory budget: every plan holds at least %s at step %d, over the budget: no sharding alone fits",
                     units.nbytes(floor), est.peak_step)
            return None
        problem.memory_rows = list(rows.values())  # for the min-peak solve and solver_stats
        # first price: giving up the whole step time saves the excess over the budget
        lo, hi, lam, best = 0.0, None, max(sol.objective, 1e-9) / (est.peak_bytes - budget), None
        last, fastest, bound = math.inf, sol.objective, -math.inf
        peaks = []  # modelled peaks of the solves over budget, while none fits
        for rounds in range(2, self.max_rounds + 1):
            sol, priced = self._penalized(rows, lam)
            if sol.stats.get("status") == "Optimal":  # the Lagrangian dual's value at lam
                bound = max(bound, sol.objective + lam * (priced - len(rows) * budget))
            choice = choice_of(self.built, sol)
            est = self.memory.estimate(choice)
            log.info("memory budget: solve %d at %.3g s/GiB: peak %s, step %s (%.2f s)", rounds, lam * 2**30,
                     units.nbytes(est.peak_bytes), units.seconds(sol.objective), sol.stats["build_s"] + sol.stats["solve_s"])
            if est.peak_bytes <= budget:
                hi = lam
                if best is None or sol.objective < best[1].objective:
                    best = (choice, sol, rounds)
                if sol.objective <= fastest * (1 + 1e-9) or best[1].objective <= bound * (1 + DUALITY_GAP):
                    break  # as fast as the fastest plan (the optimum), or as the dual bound allows
            new_row = est.peak_bytes > budget and est.peak_step not in rows
            if est.peak_bytes > budget:
                lo = lam
                if new_row:
                    rows[est.peak_step] = self.memory_row(est.peak_step)
                    problem.memory_rows = list(rows.values())
            if hi is None and not new_row and priced >= last - 1e-3 * abs(last):
                break  # a higher price no longer lowers the priced bytes: none fits
            if hi is None:
                peaks.append(est.peak_bytes)
                if _stalled(peaks, budget):
                    break
            last = priced if not new_row else math.inf
            if hi is None:
                lam *= 4
            elif hi <= 1.2 * lo:
                break
            else:
                lam = math.sqrt(lo * hi) if lo else hi / 4
        return best

    def _penalized(self, rows: dict[int, list[list[float]]], lam: float) -> tuple[ILPSolution, float]:
        """The solution of the problem with the bytes of ``rows`` priced at ``lam`` seconds per
        byte, its objective (seconds) without that penalty, and the bytes priced (summed over
        ``rows``, the rows' linear bounds)."""
        problem = self.built.ilp
        base = problem.node_costs
        problem.node_costs = [[c + lam * sum(r[g][k] for r in rows.values() if r[g]) for k, c in enumerate(cs)]
                              for g, cs in enumerate(base)]
        try:
            sol = solve(problem, solver=self.solver, time_limit=self.time_limit)
        finally:
            problem.node_costs = base
        priced = sum(r[g][k] for r in rows.values() for g, k in enumerate(sol.choice) if r[g])
        penalty = lam * priced
        sol.objective -= penalty
        sol.stats["objective_s"] -= penalty
        return sol, priced

    def two_stage(self, stages, budget: int, plan_of: Callable[[dict], Plan],
                  forward_s: Callable[[fx.Node, Strategy], float]):
        """Stage 2: Rotor on stage-1 plans of decreasing allowance (the fastest plan, then
        allowances of 3/4, 1/2 and 1/4 of the way from its peak down to ``budget`` and of 7/8,
        3/4, ..., 1/4 of its peak, those not below ``budget``, the former only where 1 % of
        the peak or more from any of the latter); the first whose recomputation
        schedule fits wins. The smallest reachable peak an infeasible budget reports is over the
        latter, which do not depend on ``budget``: planning again at that peak meets the plan
        that reached it (its allowance is at least that peak).

        Args:
            stages: the chain's stages (:func:`~autoparallel.solver.remat.chain_stages`).
            plan_of: the Plan of a choice (:func:`~autoparallel.solver.decode.make_plan`).
            forward_s: seconds of a node's forward under a strategy.

        Returns:
            ``((choice, solution, rounds), plan, (plan.checkpoint, modelled peak bytes))``.
        """
        self.built.ilp.memory_rows.clear()
        free = self.fastest if self.fastest is not None else self.stage1(None)
        top = self.memory.estimate(free[0]).peak_bytes
        reachable = []
        fixed_fractions = {int(f * top) for f in (0.875, 0.75, 0.625, 0.5, 0.375, 0.25) if f * top >= budget}
        # one within 1 % of the peak of a fixed fraction is a search already run (a budget far
        # below the peak: 3 of 9 searches, each up to max_rounds solves, only to fail)
        toward_budget = {a for a in (int(budget + f * (top - budget)) for f in (0.75, 0.5, 0.25))
                         if all(abs(a - b) > 0.01 * top for b in fixed_fractions)}
        for allowance in [None] + sorted(fixed_fractions | toward_budget, reverse=True):
            found = free if allowance is None else self.stage1(allowance)
            if found is None:
                break
            fitted = self.recompute(found, stages, budget, plan_of, forward_s)
            if isinstance(fitted, tuple):
                return fitted
            if allowance is None or allowance in fixed_fractions:
                reachable.append((fitted, found[0]))
        best, choice = min(reachable, key=lambda r: r[0]) if reachable else (top, free[0])
        best = int(math.ceil(best))
        raise InfeasiblePlanError(
            f"no plan fits memory_budget={units.nbytes(budget)} per device, even recomputing activations: the "
            f"smallest peak the planner reaches is about {units.nbytes(best)} ({best} bytes); without "
            f"recomputation {self.memory.dominant(choice)}. Raise the budget, use more devices or a smaller batch")

    def recompute(self, found, stages, budget: int, plan_of: Callable[[dict], Plan],
                  forward_s: Callable[[fx.Node, Strategy], float]):
        """Rotor's recomputation schedule (with selective stages) of the stage-1 plan ``found``
        within ``budget``: ``(found, plan, (plan.checkpoint, modelled peak bytes))``, or, when
        no schedule fits, the smallest peak one reaches on that plan (bytes)."""
        choice = found[0]
        plan = plan_of(choice)
        fwd = {n.name: forward_s(n, choice[n]) for n in stages if n in choice}
        chain, fixed = build_chain(self.memory, choice, plan, fwd, stages)
        try:
            schedule = rotor_solve(chain, budget - fixed)
        except InfeasibleBudget as e:
            try:  # the smallest peak exactly may not fit once the DP rounds sizes up to slots
                rotor_solve(chain, e.min_budget)
                return fixed + e.min_budget
            except InfeasibleBudget as rounded:
                return fixed + rounded.min_budget
        log.info("activation checkpointing: %d regions, %s recomputed, peak %s", len(schedule.regions),
                 units.seconds(schedule.recompute_time), units.nbytes(fixed + schedule.peak_bytes))
        return found, plan, (checkpoint_plan(chain, schedule, stages), fixed + int(schedule.peak_bytes))

    def every_stage(self, stages, found, budget: int | None, plan_of: Callable[[dict], Plan],
                    forward_s: Callable[[fx.Node, Strategy], float], policy: str = "full"):
        """Every stage of the chain recomputed (``checkpointing="full"`` or ``"selective"``):
        each its own region (:func:`~autoparallel.solver.rotor.checkpoint_every_stage`) or run
        selectively (:func:`~autoparallel.solver.rotor.selective_every_stage`), on ``found`` (the
        stage-1 plan within ``budget``) or, when none fits without recomputation, the fastest plan.

        Returns:
            as :meth:`two_stage`.

        Raises:
            InfeasiblePlanError: the modelled peak with every stage recomputed is over ``budget``.
        """
        if found is None:
            self.built.ilp.memory_rows.clear()
            found = self.stage1(None)
        choice = found[0]
        plan = plan_of(choice)
        fwd = {n.name: forward_s(n, choice[n]) for n in stages if n in choice}
        chain, fixed = build_chain(self.memory, choice, plan, fwd, stages)
        schedule = (selective_every_stage if policy == "selective" else checkpoint_every_stage)(chain)
        peak = fixed + int(schedule.peak_bytes)
        if budget is not None and peak > budget:
            raise InfeasiblePlanError(
                f"no plan fits memory_budget={units.nbytes(budget)} per device with checkpointing={policy!r}: "
                f"recomputing every stage the peak is about {units.nbytes(peak)} ({peak} bytes). Raise the "
                "budget, use more devices or a smaller batch" + ("" if policy == "full" else
                                                                   ", or try checkpointing='auto' or 'full'"))
        log.info("activation checkpointing (%s): %d regions, %s recomputed", policy, len(schedule.regions),
                 units.seconds(schedule.recompute_time))
        return found, plan, (checkpoint_plan(chain, schedule, stages), peak)

    def memory_row(self, t: int) -> list[list[float]]:
        """Bytes held at step ``t``, per ILP group and group strategy (linear:
        :meth:`~autoparallel.solver.memory.MemoryModel.row`)."""
        built = self.built
        row: list[list[float]] = [[] for _ in range(len(built.ilp.node_costs))]
        for owner, size in self.memory.row(t):
            g = built.group_of(owner)
            if not row[g]:
                row[g] = [0.0] * len(built.fmap[owner])
            for k, si in enumerate(built.fmap[owner]):
                row[g][k] += size(built.strategies[owner][si])
        return row

    def budget_message(self, budget: int) -> str:
        """Why ``budget`` bytes cannot be met, with the smallest reachable peak (a min-peak solve)."""
        problem = self.built.ilp
        problem.minimize_memory = True
        try:
            sol = solve(problem, solver=self.solver, time_limit=min(self.time_limit, 10.0))
            choice = choice_of(self.built, sol)
            best = self.memory.estimate(choice).peak_bytes
        finally:
            problem.minimize_memory = False
        return (f"no plan fits memory_budget={units.nbytes(budget)} per device: the smallest peak the planner "
                f"reaches on this mesh is about {units.nbytes(best)} ({best} bytes); {self.memory.dominant(choice)}. "
                "Raise the budget, use more devices or a smaller batch")

