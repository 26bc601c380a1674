"""The typed records of a plan (:mod:`autoparallel.results`): JSON round trip, the reading of
plans saved before them, and reprs that fit on a screen."""

import json
import pathlib

import pytest
import torch

import autoparallel
from autoparallel.plan import Plan
from autoparallel.results import Estimate, Inspection, MemoryBreakdown, SolverStats
from autoparallel.solver.memory import KINDS

from models import MLP

OLD = pathlib.Path(__file__).parent / "golden" / "plan_0_8_1.json"
"""A plan written by the code before the records (plan cache 0.8.1): an 8-layer MLP on 2 devices
with a budget that needs recomputation, a constraint and the baselines."""


@pytest.fixture(scope="module")
def mlp_plan():
    with torch.device("meta"):
        model = MLP(hidden=64, layers=2)
    x = torch.empty(256, 64, device="meta")
    return autoparallel.plan(model, (x, x.clone()), mesh_shape=(2,), cost_model=autoparallel.CostModel("cpu"),
                             cache_dir=False, memory_budget="1GiB")


def test_round_trip_is_exact(mlp_plan):
    again = Plan.from_json(mlp_plan.to_json())
    assert again == mlp_plan and again.to_json() == mlp_plan.to_json()
    assert isinstance(again.estimate, Estimate) and isinstance(again.solver_stats, SolverStats)
    assert again.estimate == mlp_plan.estimate and again.inspection == mlp_plan.inspection
    assert again.estimate.memory_budget_bytes == 2**30 and again.estimate.costs == "preset cpu"
    assert set(again.solver_stats.stage_s) >= {"trace", "strategies", "memory", "costs", "stage1", "inspect"}


def test_reprs_fit_on_a_screen(mlp_plan):
    for record in (mlp_plan.estimate, mlp_plan.inspection):
        lines = repr(record).splitlines()
        assert len(lines) <= 6 and all(len(line) <= 200 for line in lines), repr(record)
    assert "DDP" not in repr(mlp_plan.estimate)  # the baselines are inspection data


def test_breakdown_kinds_are_the_memory_models():
    assert KINDS == tuple(k for k, _ in MemoryBreakdown().items())


def test_a_plan_saved_before_the_records_loads():
    text = OLD.read_text()
    old = json.loads(text)
    plan = Plan.from_json(text)
    est, stats = old["estimate"], old["solver_stats"]
    for k in ("step_time_s", "compute_s", "comm_s", "optimizer_s", "grad_comm_s", "exposed_grad_comm_s",
              "peak_memory_bytes", "memory_budget_bytes", "costs"):
        assert getattr(plan.estimate, k) == est[k], k
    assert plan.estimate.recompute_s == plan.checkpoint.recompute_s > 0
    assert plan.estimate.step_time_s == pytest.approx(plan.estimate.compute_s + plan.estimate.comm_s
                                                      + plan.estimate.recompute_s)
    mem = plan.estimate.memory
    assert (mem.peak_bytes, mem.peak_step, mem.steps, mem.phase) == tuple(
        est["memory"][k] for k in ("peak_bytes", "peak_step", "steps", "phase"))
    assert dict(mem.breakdown.items()) == {"inputs": 0, **est["memory"]["breakdown"]}  # a kind added since
    for k in ("objective_s", "binary_vars", "shared_nodes", "cache", "status", "solve_s"):
        assert getattr(plan.solver_stats, k) == stats[k], k
    assert plan.solver_stats.stage_s["baselines"] == stats["baselines_s"]
    insp = plan.inspection
    assert insp.baselines == est["baselines"] and insp.memory_timeline == est["memory_timeline"]
    assert insp.alternatives == stats["alternatives"] and insp.state_nodes == stats["state_nodes"]
    assert insp.placement_constraints == {"layers.3.bias": "R"}
    assert Plan.from_json(plan.to_json()) == plan  # written again in today's layout
    text = str(plan)
    assert "priced by preset cpu" in text and "constraints: layers.3.bias R" in text
    assert "recomputation" in text and "vs this plan's step, same cost model: DDP" in text
    assert "chosen" in plan.explain("layers.0.weight")


def test_records_reject_unknown_and_mistyped_fields(mlp_plan):
    d = json.loads(mlp_plan.to_json())
    for where, key, value, message in (("estimate", "ghost_s", 1.0, "unknown field"),
                                       ("estimate", "step_time_s", "fast", "step_time_s must be"),
                                       ("solver_stats", "nodes", -1, "nodes must be"),
                                       ("inspection", "fallback_ops", {}, "fallback_ops must be")):
        bad = json.loads(json.dumps(d))
        bad[where][key] = value
        with pytest.raises(ValueError, match=message):
            Plan.from_json(json.dumps(bad))


def test_a_hand_made_plan_has_empty_records():
    p = Plan(autoparallel.MeshSpec((1,)), {}, [], {})
    assert p.estimate == Estimate() and p.inspection == Inspection() and Plan.from_json(p.to_json()) == p
