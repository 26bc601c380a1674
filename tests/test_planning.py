"""Tier 1: planning on meta tensors, no process group."""

import json
import math

import pytest
import torch
from torch.distributed.tensor import Shard

import autoparallel
from autoparallel.mesh import MeshSpec
from autoparallel.placement import P, R, spec_str
from autoparallel.solver import CostModel, ILPEdge, ILPProblem, Redistributor, solve
from autoparallel.strategies import enumerate_strategies
from autoparallel.strategies.rules import linear_rule, matmul_rule
from models import MLP, ShardParams, batch_for, hf_model, to_meta

S0, S1, S2 = Shard(0), Shard(1), Shard(2)


def _specs(strategies, in_nd, out_nd):
    return {(tuple(spec_str(s, n) for s, n in zip(st.inputs, in_nd)), spec_str(st.outputs[0], out_nd))
            for st in strategies}


class _Node:  # the rules only read target/args of the node
    def __init__(self, target, args=(), kwargs=None):
        self.target, self.args, self.kwargs = target, args, kwargs or {}


def test_mm_strategies_1d():
    dm = matmul_rule(_Node(torch.ops.aten.mm.default), [(8, 16), (16, 32)], [(8, 32)])
    got = _specs(enumerate_strategies(dm, (4,)), (2, 2), 2)
    assert got == {
        (("R R", "R R"), "R R"),
        (("S0 R", "R R"), "S0 R"),  # rows: data parallel
        (("R R", "R S0"), "R S0"),  # columns: column parallel
        (("R S0", "S0 R"), "R R P0"),  # contraction: partial sums
    }


def test_mm_strategies_2d_respect_divisibility():
    dm = matmul_rule(_Node(torch.ops.aten.mm.default), [(6, 16), (16, 32)], [(6, 32)])
    got = _specs(enumerate_strategies(dm, (2, 4)), (2, 2), 2)
    assert (("S0 R", "R S1"), "S0 S1") in got  # m over axis 0, n over axis 1
    assert (("R S01", "S01 R"), "R R P01") in got  # k over both axes
    assert (("S1 R", "R R"), "S1 R") not in got  # 6 rows do not split over 4 devices
    assert (("S01 R", "R R"), "S01 R") not in got
    assert all(st.split == math.prod((2, 4)[a] for a, p in enumerate(st.outputs[0]) if p != R) or
               any(p == P for p in st.outputs[0]) for st in enumerate_strategies(dm, (2, 4)))


def test_linear_with_bias_row_parallel_needs_partial_bias():
    dm = linear_rule(_Node(torch.ops.aten.linear.default), [(8, 16), (32, 16), (32,)], [(8, 32)])
    got = _specs(enumerate_strategies(dm, (2,)), (2, 2, 1), 2)
    assert (("R S0", "R S0", "R P0"), "R R P0") in got  # the bias is added once: Partial
    assert (("R R", "S0 R", "S0"), "R S0") in got


def test_redistribution_paths_and_costs():
    mesh = MeshSpec((2, 4), alpha=1e-5, beta=1e-9)
    cm = CostModel().bind(mesh)
    lc = Redistributor(cm)
    shape, item = (8, 64, 32), 4
    nbytes = 8 * 64 * 32 * 4
    # replicate -> sharded: local slices, no communication
    cost, moves = lc.redistribute(shape, item, True, (R, R), (S0, S1), True)
    assert [m.kind for m in moves] == ["slice", "slice"] and cost < 1e-8
    # partial -> replicated on a 1-D mesh: one all-reduce, forward and backward
    lc1 = Redistributor(CostModel().bind(MeshSpec((4,), alpha=1e-5, beta=1e-9)))
    cost, moves = lc1.redistribute(shape, item, True, (P,), (R,), True)
    assert [(m.kind, m.axis) for m in moves] == [("all_reduce", 0)]
    assert cost == pytest.approx(2 * (1e-5 + 2 * 3 / 4 * nbytes * 1e-9))
    cost_nograd, _ = lc1.redistribute(shape, item, True, (P,), (R,), False)  # no gradient: forward only
    assert cost_nograd == pytest.approx(cost / 2)
    # on 2×4 the search may use the other axis to shrink the all-reduce; never worse than direct
    cost, moves = lc.redistribute(shape, item, True, (R, P), (R, R), True)
    direct = 2 * (1e-5 + 2 * 3 / 4 * nbytes * 1e-9)
    assert cost <= direct and ("all_reduce", 1) in [(m.kind, m.axis) for m in moves]
    # S01 -> R: gather the inner axis first (the only legal order)
    cost, moves = lc.redistribute(shape, item, True, (S0, S0), (R, R), False)
    assert [(m.kind, m.axis) for m in moves] == [("all_gather", 1), ("all_gather", 0)]
    expect = (1e-5 + 3 / 4 * nbytes / 2 * 1e-9) + (1e-5 + 1 / 2 * nbytes * 1e-9)
    assert cost == pytest.approx(expect)
    # shard dim 1 -> shard dim 0 on one axis: an all-to-all beats gather + slice
    cost, moves = lc.redistribute(shape, item, True, (S1, R), (S0, R), False)
    assert [m.kind for m in moves] == ["all_to_all"]
    # partial -> sharded: reduce-scatter
    cost, moves = lc.redistribute(shape, item, True, (P, R), (S2, R), False)
    assert [m.kind for m in moves] == ["reduce_scatter"]
    # integer tensors are never partial
    assert math.isinf(lc.redistribute(shape, 8, False, (R, R), (P, R), False)[0])


def test_ilp_toy_graph_known_optimum():
    # a -> b -> c with two strategies each; edge costs make "switching" expensive
    costs = [[1.0, 3.0], [2.0, 1.0], [1.0, 1.5]]
    switch = [[0.0, 5.0], [5.0, 0.0]]
    edges = [ILPEdge(0, 1, [0, 1], [0, 1], switch), ILPEdge(1, 2, [0, 1], [0, 1], switch)]
    sol = solve(ILPProblem(costs, edges, ["a", "b", "c"]))
    # all-0: 1 + 2 + 1 = 4; all-1: 3 + 1 + 1.5 = 5.5; any switch pays 5
    assert sol.choice == [0, 0, 0] and sol.objective == pytest.approx(4.0)
    # cheaper switching: a=0, then b=c=1: 1 + 0.5 + 1 + 1.5 = 4.0 < 4.5? make it strictly better
    edges[0].cost = [[0.0, 0.25], [0.25, 0.0]]
    sol = solve(ILPProblem([[1.0, 3.0], [2.5, 1.0], [1.0, 1.5]], edges, ["a", "b", "c"]), solver="highs")
    assert sol.choice == [0, 1, 1] and sol.objective == pytest.approx(1 + 0.25 + 1 + 1.5)


def test_ilp_infeasible_names_the_node():
    inf = float("inf")
    with pytest.raises(autoparallel.InfeasiblePlanError, match="node a .*to or from: b"):
        solve(ILPProblem([[0.0], [0.0]], [ILPEdge(0, 1, [0], [0], [[inf]])], ["a", "b"]))


def _mlp_plan(hidden, batch):
    with torch.device("meta"):
        model = MLP(hidden=hidden, layers=6, bias=False)
    inputs = {"x": torch.empty(batch, hidden, device="meta"), "y": torch.empty(batch, hidden, device="meta")}
    return autoparallel.plan(model, inputs, mesh_shape=(4,), cost_model=CostModel("cpu"))


def test_known_optimal_megatron_mlp():
    """Wide MLP, small batch, 4 devices: column-parallel then row-parallel, alternating
    (Megatron-LM, arXiv 1909.08053 §3): nn.Linear weights [out, in] split Shard(0), Shard(1)."""
    plan = _mlp_plan(hidden=512, batch=32)
    got = [plan.param_placements[f"layers.{i}.weight"] for i in range(6)]
    assert got == [(S0,), (S1,)] * 3
    kinds = [c["kind"] for c in plan.collectives]
    # one all-reduce per column/row pair, except the last: its pending sum is reduce-scattered
    # over the batch (half the bytes of an all-reduce) into the batch-split loss, whose scalar
    # is then all-reduced
    assert kinds == ["all_reduce"] * 2 + ["reduce_scatter", "all_reduce"]
    assert plan.collectives[-1]["bytes"] == 4


def test_known_optimal_data_parallel_mlp():
    plan = _mlp_plan(hidden=32, batch=256)
    assert all(p == (R,) for p in plan.param_placements.values())
    for n in plan.nodes.values():
        if n.op == "linear.default":
            assert n.input_specs[0] == (S0,), n  # the batch is split


def test_plan_table_json_and_collectives():
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model = hf_model("gpt2")
    plan = autoparallel.plan(model, to_meta(batch_for("gpt2", 0)), mesh_shape=(2, 2))
    again = autoparallel.Plan.from_json(plan.to_json())
    assert again == plan and again.to_json() == plan.to_json()
    json.loads(plan.to_json())
    table = plan.table()
    assert "parameters (placement)" in table and "transformer.h.0.attn" in table
    assert "input specs → output spec" in plan.table(by="node")
    assert set(plan.param_placements) >= {"transformer.wte.weight", "lm_head.weight"}  # tied: both names
    assert plan.param_placements["transformer.wte.weight"] == plan.param_placements["lm_head.weight"]
    for c in plan.collectives:
        assert c["kind"] in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
        assert c["bytes"] > 0 and c["node"] and all(a in (0, 1) for a in c["mesh_axes"])
    est = plan.estimate
    assert est.step_time_s > 0 and est.peak_memory_bytes > 0
    assert est.step_time_s == pytest.approx(est.compute_s + est.comm_s)
    stats = plan.solver_stats
    assert stats.status == "Optimal" and stats.binary_vars > 0


@pytest.mark.slow  # 4-15 s: in the full tier (make test), not the everyday one
def test_data_parallel_is_never_cheaper_than_the_search():
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model = hf_model("llama")
    inputs = to_meta(batch_for("llama", 0))
    auto = autoparallel.plan(model, inputs, mesh_shape=(2, 2))
    dp = autoparallel.plan(model, inputs, mesh_shape=(2, 2), parallelism="data")
    assert all(all(p == R for p in s) for s in dp.param_placements.values())
    assert auto.estimate.step_time_s <= dp.estimate.step_time_s * (1 + 1e-9)


@pytest.mark.parametrize("solver", ["highs", "cbc"])
def test_lp_relaxation_fractional_falls_back_to_integer_solve(solver):
    # three nodes pairwise penalized for agreeing: the LP relaxation (all halves) costs 0,
    # any integral choice makes one pair agree
    agree = [[1.0, 0.0], [0.0, 1.0]]
    edges = [ILPEdge(0, 1, [0, 1], [0, 1], agree), ILPEdge(1, 2, [0, 1], [0, 1], agree),
             ILPEdge(0, 2, [0, 1], [0, 1], agree)]
    sol = solve(ILPProblem([[0.0, 0.0]] * 3, edges, ["a", "b", "c"]), solver=solver)
    assert sol.objective == pytest.approx(1.0)
    assert sol.stats["solver"] == solver and sol.stats["status"] == "Optimal" and sol.stats["gap"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("cost", [CostModel, ShardParams])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_block_sharing_loses_nothing(name, cost):
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model = hf_model(name, layers=3)  # layer 2 shares the variables of layer 0
    inputs = {k: torch.empty(32, 32, dtype=torch.long, device="meta") for k in ("input_ids", "labels")}
    kw = dict(mesh_shape=(2, 2), cache_dir=False, cost_model=cost("cpu"))
    shared = autoparallel.plan(model, inputs, **kw)
    full = autoparallel.plan(model, inputs, share_layers=False, **kw)
    assert shared.solver_stats.shared_nodes > 0 and full.solver_stats.shared_nodes == 0
    assert shared.solver_stats.binary_vars < full.solver_stats.binary_vars
    # sharing restricts the choice, so it can only cost more; with gradient reduction priced by its
    # exposure (which depends on a layer's position in the backward) it may cost a little more
    assert full.estimate.step_time_s <= shared.estimate.step_time_s * (1 + 1e-9)
    assert shared.estimate.step_time_s == pytest.approx(full.estimate.step_time_s, rel=1e-3)


def test_plan_cache_roundtrip(tmp_path):
    with torch.device("meta"):
        model = MLP(hidden=64, layers=2)
    inputs = {"x": torch.empty(8, 64, device="meta"), "y": torch.empty(8, 64, device="meta")}
    first = autoparallel.plan(model, inputs, mesh_shape=(2,), cache_dir=tmp_path)
    assert first.solver_stats.cache == "miss" and len(list(tmp_path.glob("*.json"))) == 1
    second = autoparallel.plan(model, inputs, mesh_shape=(2,), cache_dir=tmp_path)
    assert second.solver_stats.cache == "hit"
    assert second.param_placements == first.param_placements and second.estimate == first.estimate
    other = autoparallel.plan(model, inputs, mesh_shape=(4,), cache_dir=tmp_path)  # another mesh: solved
    assert other.solver_stats.cache == "miss" and len(list(tmp_path.glob("*.json"))) == 2
    off = autoparallel.plan(model, inputs, mesh_shape=(2,), cache_dir=False)
    assert off.solver_stats.cache == "off"


def test_same_inputs_same_plan():
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model = hf_model("gpt2")
    inputs = to_meta(batch_for("gpt2", 0))
    a = autoparallel.plan(model, inputs, mesh_shape=(2, 2), cache_dir=False)
    b = autoparallel.plan(model, inputs, mesh_shape=(2, 2), cache_dir=False)
    assert [n.to_json() for n in a.nodes.values()] == [n.to_json() for n in b.nodes.values()]
