"""The sharding ILP (Alpa, Zheng et al., OSDI 2022, arXiv 2201.12023, §4.2), solved with pulp.

Variables: a one-hot binary vector ``x_v`` per node over its strategies. Resharding
between a producer ``u`` and a consumer ``v`` depends only on the *spec* that ``u``'s
strategy gives the value and the spec that ``v``'s strategy asks for, so strategies are
grouped into spec classes on each side of an edge and the quadratic term
``x_uᵀ R x_v`` is linearized with one variable ``y[o, i]`` per pair of classes:
``Σ_i y[o, i] = Σ_{s ∈ o} x_u[s]`` and ``Σ_o y[o, i] = Σ_{s ∈ i} x_v[s]``. With one-hot
integral ``x`` these marginals force ``y`` to the product, so ``y`` can stay continuous
in [0, 1]: only node variables are binary. Pairs with no redistribution are left out, which
forbids them. Edges where one side has a single class fold into node costs.

An edge may instead give its resharding as a flow (:class:`Flow`) over the graph whose
nodes are the specs the tensor can take and whose arcs are one-step moves (a layout
conversion's all-gathers, all-to-alls, slices, reductions), priced as the pairwise costs
are: ``x_u`` supplies one unit at its spec, ``x_v`` demands it at its own, and the cheapest
flow is the cheapest path, ``cost[o][i]``. With fractional ``x`` the cheapest flow is the
transport cost between the two distributions under that shortest-path cost (a flow
decomposes into paths, Ahuja, Magnanti, Orlin, "Network Flows", 1993, §3.5), which is what
the pairwise ``y`` price too: both forms have the same LP relaxation and the same optimum,
and the flow needs one variable per move instead of one per pair of classes.

Two terms price communication that is not a plain sum over choices:

* exposed communication (:func:`~autoparallel.solver.costs.exposed_comm_time`):
  ``max(0, max_k Σ_{i≥k} r_i(x))`` over rows ``r_i`` linear in ``x`` (communication launched
  minus compute beside it), linearized with one variable ``e ≥ 0`` and suffix variables
  ``p_k = p_{k+1} + r_k(x)``, ``e ≥ p_k``: a minimization drives ``e`` down to the maximum;
* fixed charges (one latency per collective launched at all): ``z ≥ x_v[s]`` for every
  strategy that incurs it, ``z`` continuous in [0, 1] and priced once.

The LP relaxation is solved first; when every ``x`` comes out integral it is the ILP
optimum (as PyTorch's autoparallel observed on Llama models) and the integer solve is
skipped.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field

import pulp

from ..errors import InfeasiblePlanError

log = logging.getLogger(__name__)


@dataclass
class Flow:
    """An edge's resharding as a flow over a spec graph (module docstring).

    Attributes:
        u_spec / v_spec: per spec class of the producer / consumer side, its graph node.
        arcs: ``(a, b, seconds)``: a move from graph node ``a`` to ``b``; the cheapest path
            from ``u_spec[o]`` to ``v_spec[i]`` must cost the edge's ``cost[o][i]``.
    """

    u_spec: list[int]
    v_spec: list[int]
    arcs: list[tuple[int, int, float]]


@dataclass
class ILPEdge:
    """Resharding between nodes ``u`` and ``v``: ``u_class[s]`` / ``v_class[s]`` map each
    strategy to its spec class; ``cost[o][i]`` is the seconds to convert class ``o`` to
    class ``i`` (``inf`` when impossible). With ``flow``, the solver sees that flow instead
    of one variable per pair of classes."""

    u: int
    v: int
    u_class: list[int]
    v_class: list[int]
    cost: list[list[float]]
    flow: Flow | None = None


@dataclass
class FixedCharge:
    """Seconds paid once when any of some strategies is chosen (e.g. the latency of a
    collective that every strategy replicating a parameter along an axis adds to).

    Attributes:
        cost: seconds.
        strategies: node → the indices of its strategies that incur the charge.
    """

    cost: float
    strategies: dict[int, list[int]]


@dataclass
class ILPProblem:
    """Node cost vectors (seconds per strategy), edges, and names for error messages.

    ``memory_rows`` are linear memory constraints: each row gives, per node and strategy,
    the bytes that choice holds at one step of the training step; a row's sum must stay
    under ``memory_limit`` bytes. With ``minimize_memory`` the objective becomes the
    largest row (the smallest reachable peak) instead of the step time.

    ``exposed_rows`` price communication overlapped with compute: one row per launch, in
    launch order, giving per node and strategy the seconds of communication that choice
    launches there minus the seconds of compute it runs after that launch and before the
    next (an empty list: the node adds nothing); the objective adds
    :func:`exposed_time` of the chosen rows. ``fixed_charges`` add their cost once each
    when any of their strategies is chosen.
    """

    node_costs: list[list[float]]
    edges: list[ILPEdge]
    names: list[str] = field(default_factory=list)
    memory_rows: list[list[list[float]]] = field(default_factory=list)
    memory_limit: float | None = None
    minimize_memory: bool = False
    exposed_rows: list[list[list[float]]] = field(default_factory=list)
    fixed_charges: list[FixedCharge] = field(default_factory=list)


@dataclass
class ILPSolution:
    choice: list[int]
    objective: float
    stats: dict


SOLVERS = ("cbc", "highs")
_SCALE = 1e6  # the solver sees microseconds: second-scale costs sit near its 1e-7 tolerances
_MIB = 2.0 ** 20  # and memory rows in MiB


def exposed_time(problem: ILPProblem, choice: list[int]) -> float:
    """Seconds of the exposed-communication term under ``choice`` (strategy per node):
    ``max(0, max_k Σ_{i≥k} row_i)``, :func:`~autoparallel.solver.costs.exposed_comm_time`
    of the chosen rows."""
    exposed = tail = 0.0
    for row in reversed(problem.exposed_rows):
        tail += sum(costs[choice[v]] for v, costs in enumerate(row) if costs)
        exposed = max(exposed, tail)
    return exposed


def fixed_charge_time(problem: ILPProblem, choice: list[int]) -> float:
    """Seconds of the fixed charges that ``choice`` (strategy per node) incurs."""
    return sum(f.cost for f in problem.fixed_charges
               if any(choice[v] in ks for v, ks in f.strategies.items()))


def _make_solver(name: str, time_limit: float):
    if name == "cbc":
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
    if name == "highs":
        _quiet_highs_banner()
        return pulp.HiGHS(msg=False, timeLimit=time_limit)
    raise ValueError(f"unknown solver {name!r}; choose one of {SOLVERS}")


_BANNER_DONE = False


def _quiet_highs_banner() -> None:
    """HiGHS prints a banner to file descriptor 1 on the first ``highspy.Highs()`` of a process,
    before pulp can turn its output off: that first one is made here with the descriptor on
    ``/dev/null``."""
    global _BANNER_DONE
    if _BANNER_DONE:
        return
    import highspy

    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        highspy.Highs()
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)
    _BANNER_DONE = True


def solve(problem: ILPProblem, *, solver: str = "cbc", time_limit: float = 60.0) -> ILPSolution:
    """Pick one strategy per node minimizing node, resharding, exposed-communication and
    fixed-charge seconds (module docstring).

    Args:
        problem: the ILP description.
        solver: ``"cbc"`` (pulp's bundled CBC) or ``"highs"`` (needs ``highspy``).
        time_limit: seconds the solver may run; the best solution found by then is used.

    Returns:
        the chosen strategy index per node, the objective (s) and solver statistics
        (``exposed_s``: the exposed-communication term of the objective).

    Raises:
        InfeasiblePlanError: when no assignment satisfies the constraints (e.g. an edge
            whose every redistribution is impossible), naming the nodes involved.
    """
    t0 = time.perf_counter()
    lin, pair_edges = fold_edges(problem)
    lp = _Program(problem, lin, pair_edges)
    t_build = time.perf_counter() - t0
    used, optimal, lp_bound = lp.run(solver, time_limit, t0 + t_build)
    t_solve = time.perf_counter() - t0 - t_build
    choice = lp.choice(t_solve >= time_limit, time_limit)
    obj = sum(lin[v][c] for v, c in enumerate(choice))
    for e in pair_edges:
        obj += e.cost[e.u_class[choice[e.u]]][e.v_class[choice[e.v]]]
    exposed = exposed_time(problem, choice)
    obj += exposed + fixed_charge_time(problem, choice)
    gap = 0.0 if optimal or lp_bound is None or obj <= 0 else max(0.0, (obj - lp_bound) / obj)
    if not optimal and not problem.minimize_memory:
        log.warning("the sharding ILP stopped at its time limit (%.0f s): using the best plan found, within "
                    "%.2f%% of the LP lower bound; pass a larger time_limit for the optimum", time_limit, 100 * gap)
    stats = {"solver": used, "status": "Optimal" if optimal else "Time limit (best found)",
             "gap": gap, "lp_bound_s": lp_bound, "binary_vars": len(lp.xvars), "edge_vars": lp.n_cont,
             "constraints": len(lp.prob.constraints), "build_s": t_build, "solve_s": t_solve, "objective_s": obj,
             "exposed_s": exposed}
    return ILPSolution(choice, obj, stats)


def fold_edges(problem: ILPProblem) -> tuple[list[list[float]], list[ILPEdge]]:
    """Node costs with every edge that has one spec class on a side folded in, and the
    edges left (both sides vary).

    Raises:
        InfeasiblePlanError: a node without strategies, or one whose every strategy needs
            an impossible redistribution.
    """
    name = (lambda v: problem.names[v]) if problem.names else str
    for v, costs in enumerate(problem.node_costs):
        if not costs:
            raise InfeasiblePlanError(f"node {name(v)} has no strategy")
    lin = [list(c) for c in problem.node_costs]  # node costs plus folded edge costs
    blocked: dict[int, list[int]] = {}  # node -> neighbours whose folded edge is impossible somewhere
    pair_edges = []
    for e in problem.edges:
        no, ni = max(e.u_class) + 1, max(e.v_class) + 1
        if ni == 1 or no == 1:
            v, other, classes = (e.u, e.v, e.u_class) if ni == 1 else (e.v, e.u, e.v_class)
            cost = (lambda c: e.cost[c][0]) if ni == 1 else (lambda c: e.cost[0][c])
            for s, c in enumerate(classes):
                lin[v][s] += cost(c)
            if any(math.isinf(cost(c)) for c in classes):
                blocked.setdefault(v, []).append(other)
            continue
        pair_edges.append(e)
    for v in range(len(lin)):  # strategies with infinite cost are impossible
        if all(math.isinf(c) for c in lin[v]):
            others = ", ".join(name(u) for u in blocked.get(v, []))
            raise InfeasiblePlanError(
                f"every strategy of node {name(v)} needs an impossible redistribution "
                f"(to or from: {others or 'unknown'})")
    return lin, pair_edges


class _Program:
    """The pulp model of one :func:`solve`: a variable per strategy of every node with a
    choice, one per pair of spec classes of every edge left, memory rows, the objective.

    Attributes:
        x: per node, strategy index → its variable (the constant 1 for single-strategy nodes).
        xvars: the node variables, binary once the LP relaxation is not integral.
        n_cont: the number of edge variables.
    """

    def __init__(self, problem: ILPProblem, lin: list[list[float]], pair_edges: list[ILPEdge]):
        self.prob = pulp.LpProblem("sharding", pulp.LpMinimize)
        self.x: list[dict[int, object]] = []
        self.xvars: list = []
        self.n_cont = 0
        objective = self._node_variables(lin)
        for k, e in enumerate(pair_edges):
            objective += self._edge(k, e) if e.flow is None else self._flow(k, e)
        if problem.minimize_memory:
            peak = pulp.LpVariable("peak_mib", lowBound=0)
            objective = [(peak, 1.0)]
        else:
            peak = None
            objective += self._exposed(problem.exposed_rows)
            for k, charge in enumerate(problem.fixed_charges):
                objective += self._fixed_charge(k, charge)
        for r, row in enumerate(problem.memory_rows):
            self._memory_row(r, row, problem.memory_limit, peak)
        self.prob.setObjective(pulp.LpAffineExpression(objective))

    def _node_variables(self, lin: list[list[float]]) -> list[tuple]:
        """One-hot variables of every node with a choice; their objective terms."""
        objective = []
        for v, costs in enumerate(lin):
            if len(costs) == 1:
                self.x.append({0: 1})
                continue
            xs = {}
            for s, c in enumerate(costs):
                if not math.isinf(c):
                    xs[s] = pulp.LpVariable(f"x{v}_{s}", lowBound=0, upBound=1)
                    self.xvars.append(xs[s])
                    objective.append((xs[s], c * _SCALE))
            self.prob += pulp.LpConstraint(pulp.LpAffineExpression([(xv, 1) for xv in xs.values()]), 0,
                                           f"onehot{v}", 1)
            self.x.append(xs)
        return objective

    def _marginal(self, y_terms, v: int, classes: list[int], cls: int):
        """``Σ y = Σ_{s in class cls} x_v[s]``: the edge variables of one class of node ``v``."""
        terms = [(yv, 1) for yv in y_terms]
        const = 0
        for s, c in enumerate(classes):
            if c == cls and s in self.x[v]:
                xv = self.x[v][s]
                if isinstance(xv, int):
                    const += xv
                else:
                    terms.append((xv, -1))
        return pulp.LpConstraint(pulp.LpAffineExpression(terms), 0, None, const)

    def _edge(self, k: int, e: ILPEdge) -> list[tuple]:
        """Variables ``y[o, i]`` of edge ``k`` (possible class pairs only), their marginal
        constraints; their objective terms."""
        no, ni = max(e.u_class) + 1, max(e.v_class) + 1
        y, objective = {}, []
        for o in range(no):
            for i in range(ni):
                c = e.cost[o][i]
                if not math.isinf(c):
                    y[o, i] = pulp.LpVariable(f"y{k}_{o}_{i}", lowBound=0, upBound=1)
                    self.n_cont += 1
                    if c:
                        objective.append((y[o, i], c * _SCALE))
        for o in range(no):
            self.prob += self._marginal([y[o, i] for i in range(ni) if (o, i) in y], e.u, e.u_class, o), f"eu{k}_{o}"
        for i in range(ni):
            self.prob += self._marginal([y[o, i] for o in range(no) if (o, i) in y], e.v, e.v_class, i), f"ev{k}_{i}"
        return objective

    def _flow(self, k: int, e: ILPEdge) -> list[tuple]:
        """Variables ``f ≥ 0`` per arc of edge ``k``'s flow, and per graph node the conservation
        row: flow out − flow in = ``x_u`` supplied there − ``x_v`` demanded there; their
        objective terms."""
        rows: dict[int, list[tuple]] = {}
        rhs: dict[int, float] = {}
        objective = []
        for a, (i, j, c) in enumerate(e.flow.arcs):
            f = pulp.LpVariable(f"f{k}_{a}", lowBound=0)
            self.n_cont += 1
            if c:
                objective.append((f, c * _SCALE))
            rows.setdefault(i, []).append((f, 1))
            rows.setdefault(j, []).append((f, -1))
        for v, classes, node, sign in ((e.u, e.u_class, e.flow.u_spec, -1), (e.v, e.v_class, e.flow.v_spec, 1)):
            for s, c in enumerate(classes):
                xv = self.x[v].get(s)
                if xv is None:
                    continue
                n = node[c]
                if isinstance(xv, int):
                    rhs[n] = rhs.get(n, 0.0) - sign * xv
                    rows.setdefault(n, [])
                else:
                    rows.setdefault(n, []).append((xv, sign))
        for n, terms in rows.items():
            self.prob += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintEQ, f"flow{k}_{n}",
                                           rhs.get(n, 0.0))
        return objective

    def _linear(self, row: list[list[float]], scale: float) -> tuple[list[tuple], float]:
        """``Σ_v Σ_s row[v][s]·x_v[s]·scale`` as (variable terms, constant)."""
        terms, const = [], 0.0
        for v, coeffs in enumerate(row):
            for s, c in enumerate(coeffs):
                if not c or s not in self.x[v]:
                    continue
                if isinstance(self.x[v][s], int):
                    const += c * scale
                else:
                    terms.append((self.x[v][s], c * scale))
        return terms, const

    def _exposed(self, rows: list[list[list[float]]]) -> list[tuple]:
        """``e ≥ 0``, ``e ≥ p_k`` with suffix sums ``p_k = p_{k+1} + row_k(x)``; the objective term ``e``."""
        if not rows:
            return []
        e = pulp.LpVariable("exposed", lowBound=0)
        after = None
        for k in reversed(range(len(rows))):
            terms, const = self._linear(rows[k], _SCALE)
            p = pulp.LpVariable(f"suffix{k}")
            expr = [(p, 1.0)] + [(xv, -c) for xv, c in terms] + ([(after, -1.0)] if after is not None else [])
            self.prob += pulp.LpConstraint(pulp.LpAffineExpression(expr), pulp.LpConstraintEQ, f"suffix{k}", const)
            self.prob += pulp.LpConstraint(pulp.LpAffineExpression([(e, 1.0), (p, -1.0)]), pulp.LpConstraintGE,
                                           f"exposed{k}", 0)
            after = p
        return [(e, 1.0)]

    def _fixed_charge(self, k: int, charge: FixedCharge) -> list[tuple]:
        """``z ≥ x_v[s]`` for the charged strategies (``z = 1`` when one is the only choice of
        its node); the objective term ``cost·z``."""
        forced = any(isinstance(self.x[v].get(s), int) for v, ks in charge.strategies.items() for s in ks)
        z = pulp.LpVariable(f"charge{k}", lowBound=1 if forced else 0, upBound=1)
        for v, ks in charge.strategies.items():
            for s in ks:
                xv = self.x[v].get(s)
                if xv is not None and not isinstance(xv, int):
                    self.prob += pulp.LpConstraint(pulp.LpAffineExpression([(z, 1.0), (xv, -1.0)]),
                                                   pulp.LpConstraintGE, f"charge{k}_{v}_{s}", 0)
        return [(z, charge.cost * _SCALE)]

    def _memory_row(self, r: int, row: list[list[float]], limit: float | None, peak) -> None:
        """Row ``r``'s bytes (in MiB) at most ``limit``, or at most ``peak`` when minimizing it."""
        terms, const = self._linear(row, 1 / _MIB)
        if peak is not None:
            terms.append((peak, -1.0))
            self.prob += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE, f"mem{r}", -const)
        elif limit is not None:
            self.prob += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE, f"mem{r}",
                                           limit / _MIB - const)

    def run(self, solver: str, time_limit: float, built_at: float) -> tuple[str, bool, float | None]:
        """Solve the LP relaxation, then, unless it is integral (every ``x`` one-hot: then it
        is the ILP optimum), the integer problem in the time left.

        Returns:
            ``(solver used, optimal, LP lower bound in seconds or None)``.
        """
        self.status = self.prob.solve(_make_solver(solver, time_limit))
        lp_ok = pulp.LpStatus[self.status] == "Optimal"
        lp_bound = (pulp.value(self.prob.objective) or 0.0) / _SCALE if lp_ok else None
        if lp_ok and all(min(abs(xv.varValue or 0.0), abs(1 - (xv.varValue or 0.0))) < 1e-6 for xv in self.xvars):
            return f"{solver} (LP relaxation, integral)", True, lp_bound
        for xv in self.xvars:
            xv.cat = pulp.LpInteger
        remaining = max(1.0, time_limit - (time.perf_counter() - built_at))
        self.status = self.prob.solve(_make_solver(solver, remaining))
        optimal = getattr(self.prob, "sol_status", pulp.LpSolutionOptimal) == pulp.LpSolutionOptimal
        return solver, optimal, lp_bound

    def choice(self, out_of_time: bool, time_limit: float) -> list[int]:
        """The chosen strategy of every node, after :meth:`run`.

        Raises:
            InfeasiblePlanError: the solver found no solution (infeasible, or out of time).
        """
        status_name = pulp.LpStatus[self.status]
        if status_name in ("Infeasible", "Unbounded") or any(xv.varValue is None for xv in self.xvars):
            if out_of_time:
                raise InfeasiblePlanError(f"the sharding ILP found no plan within time_limit={time_limit} s; "
                                          "pass a larger time_limit")
            raise InfeasiblePlanError(
                f"the sharding ILP is {status_name.lower()}: no combination of strategies connects every "
                "producer to its consumers. Check for ops whose rules allow no common layout; run with "
                "strict=False or a smaller mesh")
        choice = []
        for xs in self.x:
            if len(xs) == 1 and isinstance(xs.get(0), int):
                choice.append(0)
                continue
            vals = {s: (xv.varValue or 0.0) for s, xv in xs.items()}
            choice.append(max(vals, key=lambda s: (vals[s], -s)))
        return choice
