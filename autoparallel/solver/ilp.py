"""The sharding ILP (Alpa, Zheng et al., OSDI 2022, arXiv 2201.12023, §4.2), solved with pulp.

Variables: a one-hot binary vector ``x_v`` per node over its strategies. Resharding
between a producer ``u`` and a consumer ``v`` depends only on the *spec* that ``u``'s
strategy gives the value and the spec that ``v``'s strategy asks for, so strategies are
grouped into spec classes on each side of an edge and the quadratic term
``x_uᵀ R x_v`` is linearized with one variable ``y[o, i]`` per pair of classes:
``Σ_i y[o, i] = Σ_{s ∈ o} x_u[s]`` and ``Σ_o y[o, i] = Σ_{s ∈ i} x_v[s]``. With one-hot
integral ``x`` these marginals force ``y`` to the product, so ``y`` can stay continuous
in [0, 1]: only node variables are binary. Pairs with no conversion are left out, which
forbids them. Edges where one side has a single class fold into node costs.

The LP relaxation is solved first; when every ``x`` comes out integral it is the ILP
optimum (as PyTorch's autoparallel observed on Llama models) and the integer solve is
skipped.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import pulp

from ..errors import InfeasiblePlanError

log = logging.getLogger(__name__)


@dataclass
class ILPEdge:
    """Resharding between nodes ``u`` and ``v``: ``u_class[s]`` / ``v_class[s]`` map each
    strategy to its spec class; ``cost[o][i]`` is the seconds to convert class ``o`` to
    class ``i`` (``inf`` when impossible)."""

    u: int
    v: int
    u_class: list[int]
    v_class: list[int]
    cost: list[list[float]]


@dataclass
class ILPProblem:
    """Node cost vectors (seconds per strategy), edges, and names for error messages.

    ``memory_rows`` are linear memory constraints: each row gives, per node and strategy,
    the bytes that choice holds at one step of the training step; a row's sum must stay
    under ``memory_limit`` bytes. With ``minimize_memory`` the objective becomes the
    largest row (the smallest reachable peak) instead of the step time.
    """

    node_costs: list[list[float]]
    edges: list[ILPEdge]
    names: list[str] = field(default_factory=list)
    memory_rows: list[list[list[float]]] = field(default_factory=list)
    memory_limit: float | None = None
    minimize_memory: bool = False


@dataclass
class ILPSolution:
    choice: list[int]
    objective: float
    stats: dict


SOLVERS = ("cbc", "highs")
_SCALE = 1e6  # the solver sees microseconds: second-scale costs sit near its 1e-7 tolerances
_MIB = 2.0 ** 20  # and memory rows in MiB


def _make_solver(name: str, time_limit: float):
    if name == "cbc":
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit)
    if name == "highs":
        return pulp.HiGHS(msg=False, timeLimit=time_limit)
    raise ValueError(f"unknown solver {name!r}; choose one of {SOLVERS}")


def solve(problem: ILPProblem, *, solver: str = "cbc", time_limit: float = 60.0) -> ILPSolution:
    """Pick one strategy per node minimizing node plus resharding seconds.

    Args:
        problem: the ILP description.
        solver: ``"cbc"`` (pulp's bundled CBC) or ``"highs"`` (needs ``highspy``).
        time_limit: seconds the solver may run; the best solution found by then is used.

    Returns:
        the chosen strategy index per node, the objective (s) and solver statistics.

    Raises:
        InfeasiblePlanError: when no assignment satisfies the constraints (e.g. an edge
            whose every conversion is impossible), naming the nodes involved.
    """
    t0 = time.perf_counter()
    n = len(problem.node_costs)
    for v, costs in enumerate(problem.node_costs):
        if not costs:
            raise InfeasiblePlanError(f"node {problem.names[v] if problem.names else v} has no strategy")
    lin = [list(c) for c in problem.node_costs]  # node costs plus folded edge costs
    blocked: dict[int, list[int]] = {}  # node -> neighbours whose folded edge is impossible somewhere
    pair_edges = []
    for e in problem.edges:
        no, ni = max(e.u_class) + 1, max(e.v_class) + 1
        if ni == 1:
            for s, o in enumerate(e.u_class):
                lin[e.u][s] += e.cost[o][0]
            if any(math.isinf(e.cost[o][0]) for o in e.u_class):
                blocked.setdefault(e.u, []).append(e.v)
            continue
        if no == 1:
            for s, i in enumerate(e.v_class):
                lin[e.v][s] += e.cost[0][i]
            if any(math.isinf(e.cost[0][i]) for i in e.v_class):
                blocked.setdefault(e.v, []).append(e.u)
            continue
        pair_edges.append(e)
    # strategies with infinite cost are impossible
    name = (lambda v: problem.names[v]) if problem.names else str
    for v in range(n):
        if all(math.isinf(c) for c in lin[v]):
            others = ", ".join(name(u) for u in blocked.get(v, []))
            raise InfeasiblePlanError(
                f"every strategy of node {name(v)} needs an impossible layout conversion "
                f"(to or from: {others or 'unknown'})")
    prob = pulp.LpProblem("sharding", pulp.LpMinimize)
    x: list[dict[int, object]] = []
    objective: list[tuple] = []
    xvars = []
    for v in range(n):
        costs = lin[v]
        if len(costs) == 1:
            x.append({0: 1})
            continue
        xs = {}
        for s, c in enumerate(costs):
            if not math.isinf(c):
                xs[s] = pulp.LpVariable(f"x{v}_{s}", lowBound=0, upBound=1)
                xvars.append(xs[s])
                objective.append((xs[s], c * _SCALE))
        prob += pulp.LpConstraint(pulp.LpAffineExpression([(xv, 1) for xv in xs.values()]), 0, f"onehot{v}", 1)
        x.append(xs)

    def marginal(y_terms, v, classes, cls):
        terms = [(yv, 1) for yv in y_terms]
        const = 0
        for s, c in enumerate(classes):
            if c == cls and s in x[v]:
                xv = x[v][s]
                if isinstance(xv, int):
                    const += xv
                else:
                    terms.append((xv, -1))
        return pulp.LpConstraint(pulp.LpAffineExpression(terms), 0, None, const)

    n_cont = 0
    for k, e in enumerate(pair_edges):
        no, ni = max(e.u_class) + 1, max(e.v_class) + 1
        y = {}
        for o in range(no):
            for i in range(ni):
                c = e.cost[o][i]
                if not math.isinf(c):
                    y[o, i] = pulp.LpVariable(f"y{k}_{o}_{i}", lowBound=0, upBound=1)
                    n_cont += 1
                    if c:
                        objective.append((y[o, i], c * _SCALE))
        for o in range(no):
            prob += marginal([y[o, i] for i in range(ni) if (o, i) in y], e.u, e.u_class, o), f"eu{k}_{o}"
        for i in range(ni):
            prob += marginal([y[o, i] for o in range(no) if (o, i) in y], e.v, e.v_class, i), f"ev{k}_{i}"
    if problem.minimize_memory:
        peak = pulp.LpVariable("peak_mib", lowBound=0)
        objective = [(peak, 1.0)]
    for r, row in enumerate(problem.memory_rows):
        terms, const = [], 0.0
        for v, sizes in enumerate(row):
            for s_, b in enumerate(sizes):
                if not b or s_ not in x[v]:
                    continue
                if isinstance(x[v][s_], int):
                    const += b / _MIB
                else:
                    terms.append((x[v][s_], b / _MIB))
        if problem.minimize_memory:
            terms.append((peak, -1.0))
            prob += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE, f"mem{r}", -const)
        elif problem.memory_limit is not None:
            prob += pulp.LpConstraint(pulp.LpAffineExpression(terms), pulp.LpConstraintLE, f"mem{r}",
                                      problem.memory_limit / _MIB - const)
    prob.setObjective(pulp.LpAffineExpression(objective))
    t_build = time.perf_counter() - t0
    # The LP relaxation is often integral (every x one-hot): then it is the ILP optimum.
    status = prob.solve(_make_solver(solver, time_limit))
    lp_ok = pulp.LpStatus[status] == "Optimal"
    lp_bound = (pulp.value(prob.objective) or 0.0) / _SCALE if lp_ok else None
    integral = lp_ok and all(min(abs(xv.varValue or 0.0), abs(1 - (xv.varValue or 0.0))) < 1e-6 for xv in xvars)
    used = f"{solver} (LP relaxation, integral)"
    optimal = integral
    if not integral:
        for xv in xvars:
            xv.cat = pulp.LpInteger
        remaining = max(1.0, time_limit - (time.perf_counter() - t0 - t_build))
        status = prob.solve(_make_solver(solver, remaining))
        used = solver
        optimal = getattr(prob, "sol_status", pulp.LpSolutionOptimal) == pulp.LpSolutionOptimal
    n_bin = len(xvars)
    t_solve = time.perf_counter() - t0 - t_build
    status_name = pulp.LpStatus[status]
    if status_name in ("Infeasible", "Unbounded") or any(xv.varValue is None for xv in xvars):
        if t_solve >= time_limit:
            raise InfeasiblePlanError(f"the sharding ILP found no plan within time_limit={time_limit} s; "
                                      "pass a larger time_limit")
        raise InfeasiblePlanError(
            f"the sharding ILP is {status_name.lower()}: no combination of strategies connects every "
            "producer to its consumers. Check for ops whose rules allow no common layout; run with "
            "strict=False or a smaller mesh")
    choice = []
    for v in range(n):
        if len(lin[v]) == 1:
            choice.append(0)
            continue
        vals = {s: (xv.varValue or 0.0) for s, xv in x[v].items()}
        choice.append(max(vals, key=lambda s: (vals[s], -s)))
    obj = sum(lin[v][choice[v]] for v in range(n))
    for e in pair_edges:
        obj += e.cost[e.u_class[choice[e.u]]][e.v_class[choice[e.v]]]
    gap = 0.0 if optimal or lp_bound is None or obj <= 0 else max(0.0, (obj - lp_bound) / obj)
    if not optimal and not problem.minimize_memory:
        log.warning("the sharding ILP stopped at its time limit (%.0f s): using the best plan found, within "
                    "%.2f%% of the LP lower bound; pass a larger time_limit for the optimum", time_limit, 100 * gap)
    stats = {"solver": used, "status": "Optimal" if optimal else "Time limit (best found)",
             "gap": gap, "lp_bound_s": lp_bound, "binary_vars": n_bin, "edge_vars": n_cont,
             "constraints": len(prob.constraints), "build_s": t_build, "solve_s": t_solve, "objective_s": obj}
    return ILPSolution(choice, obj, stats)
