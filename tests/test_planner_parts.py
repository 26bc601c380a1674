"""The planner's parts on their own: pricing (solver/pricing.py), the ILP (solver/problem.py),
decoding (solver/decode.py) and the memory search (solver/memory_search.py)."""

import re

import pytest
import torch

from autoparallel.errors import InfeasiblePlanError
from autoparallel.mesh import MeshSpec
from autoparallel.placement import R, Shard
from autoparallel.solver.costs import CostModel
from autoparallel.solver.decode import choice_of, make_plan
from autoparallel.solver.ilp import ILPSolution
from autoparallel.solver.memory import MemoryModel
from autoparallel.solver.memory_search import MemorySearch
from autoparallel.solver.planner import Planner
from autoparallel.solver.remat import chain_stages
from autoparallel.strategies import StrategyGenerator
from autoparallel.tracer import capture
from models import MLP, batch_for, to_meta

MESH = MeshSpec((2,))
BATCH, HIDDEN = 64, 256


def _planner(layers=2, share_layers=True, memory=False, batch=BATCH):
    with torch.device("meta"):
        model = MLP(hidden=HIDDEN, layers=layers)
    traced = capture(model, to_meta(batch_for("mlp", 0, batch=batch)))
    gen = StrategyGenerator(MESH.shape)
    strategies = gen.generate(traced.gm)
    mm = MemoryModel(traced.gm, gen.aliases, MESH.shape, traced_on=traced.device) if memory else None
    return Planner(traced.gm, strategies, gen.aliases, MESH, CostModel("cpu"), dict(traced.params),
                   share_layers=share_layers, memory=mm)


def _first(planner, target):
    return next(n for n in planner.nodes if n.target is target)


def test_pricing_a_linear_node():
    """The linear's output bytes follow its placement, a split strategy computes less than the
    replicated one, and the weight's price is its optimizer update plus its gradient all-reduce."""
    planner = _planner()
    pricing = planner.pricing
    linear = _first(planner, torch.ops.aten.linear.default)
    by_out = {s.outputs[0]: s for s in planner.strategies[linear] if s.inputs[1] == (R,)}
    whole, split = by_out[(R,)], by_out[(Shard(0),)]
    c_whole, comm_whole, m_whole = pricing.node_cost(linear, whole)
    c_split, _, m_split = pricing.node_cost(linear, split)
    assert m_whole == BATCH * HIDDEN * 4 and m_split == m_whole // 2
    assert 0 < c_split < c_whole and comm_whole == 0
    assert pricing.node_cost(linear, whole, backward=False)[0] < c_whole
    weight = linear.args[1]
    repl = next(s for s in planner.strategies[weight] if s.outputs[0] == (R,))
    launched, after = pricing.grad_reduction(weight, repl)
    assert launched > 0 and after == 0
    assert pricing.node_cost(weight, repl)[:2] == (pricing.optimizer_time(weight, repl), launched)


def test_group_count_with_and_without_layer_sharing():
    shared = _planner(layers=4).build_problem()
    alone = _planner(layers=4, share_layers=False).build_problem()
    assert shared.stats["groups"] == alone.stats["groups"]
    assert alone.stats["shared_nodes"] == 0 and alone.stats["ilp_groups"] == alone.stats["groups"]
    assert shared.stats["shared_nodes"] > 0 and shared.stats["ilp_groups"] < alone.stats["ilp_groups"]
    for built in (shared, alone):
        assert len(built.ilp.node_costs) == built.stats["ilp_groups"] + 1  # and the graph output


def test_decode_of_a_trivial_solution():
    """Every group at its first strategy: the roots take their first strategy, followers the
    one their map gives, and the plan of that choice prices each node as pricing does."""
    planner = _planner()
    built = planner.build_problem()
    sol = ILPSolution([0] * len(built.ilp.node_costs), 0.0, {})
    choice = choice_of(built, sol)
    assert list(choice) == planner.nodes
    for n, s in choice.items():
        assert s is planner.strategies[n][built.fmap[n][0]]
    plan = make_plan(planner.pricing, choice, built.edges, planner.param_names, None)
    linear = _first(planner, torch.ops.aten.linear.default)
    assert plan.nodes[linear.name].compute_s == planner.pricing.node_cost(linear, choice[linear])[0]
    assert plan.estimate.peak_memory_bytes is None
    assert plan.estimate.step_time_s == pytest.approx(plan.estimate.compute_s + plan.estimate.comm_s)


def test_memory_search_states_the_smallest_reachable_peak():
    """Under a 1-byte budget stage 1 finds nothing and stage 2 raises with the smallest peak it
    reached, a budget the planner then meets."""
    planner = _planner(layers=8, memory=True, batch=4096)
    built = planner.build_problem()
    search = MemorySearch(built, planner.memory, solver="cbc", time_limit=20, max_rounds=12)
    assert search.stage1(1) is None
    stages = chain_stages(planner.memory.nodes)
    with pytest.raises(InfeasiblePlanError, match=r"smallest peak .* \((\d+) bytes\)") as err:
        search.two_stage(stages, 1, lambda c: planner.make_plan(c, built.edges),
                         lambda n, s: planner.pricing.node_cost(n, s, backward=False)[0])
    reachable = int(re.search(r"\((\d+) bytes\)", str(err.value)).group(1))
    assert 0 < reachable
    plan = planner.solve(memory_budget=reachable, inspect=False)
    assert plan.estimate.peak_memory_bytes <= reachable
    assert "smallest peak" in search.budget_message(1)


def test_stage1_stops_at_once_below_every_plans_bytes(monkeypatch):
    """A budget under the fastest plan's peak step's floor (each group's fewest bytes there,
    summed) ends stage 1 after the one solve: no penalty could fit it. Above the floor the
    search still runs its penalized solves."""
    planner = _planner(layers=4, memory=True, batch=4096)
    built = planner.build_problem()
    search = MemorySearch(built, planner.memory, solver="cbc", time_limit=20, max_rounds=12)
    choice = search.stage1(None)[0]
    step = planner.memory.estimate(choice).peak_step
    floor = sum(min(r) for r in search.memory_row(step) if r)
    assert 0 < floor < planner.memory.estimate(choice).peak_bytes
    solves = []
    real = MemorySearch._penalized
    monkeypatch.setattr(MemorySearch, "_penalized", lambda self, *a: solves.append(1) or real(self, *a))
    assert search.stage1(int(floor) - 1) is None and not solves
    search.stage1(int(floor) + 1)
    assert solves
