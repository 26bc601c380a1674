"""Tier 1: the planner prices gradient all-reduces that the runtime overlaps with the backward
as exposed time (docs/design.md, "Exposed communication")."""

import pytest
import torch

import autoparallel
from autoparallel.mesh import MeshSpec
from autoparallel.placement import R
from autoparallel.solver import CostModel, ILPProblem, solve
from autoparallel.solver.costs import exposed_comm_time
from autoparallel.solver.ilp import FixedCharge
from models import MLP, without_dtensor_overhead


class Overlapped(CostModel):
    """A cost model pricing gradient reduction by its exposed time (off by default)."""

    overlap_grad_reduction = True


class SlowLink(Overlapped):
    """Collectives priced by their bytes alone at 1 GB/s (no latency, no ring factor)."""

    def collective_time(self, kind, axis, nbytes):
        return nbytes * 1e-9

    def grad_reduction_time(self, axis, nbytes):
        return nbytes * 1e-9


class BlockingSlowLink(SlowLink):
    overlap_grad_reduction = False


def _mlp_plan(cost_model, batch=8, mesh=(2,), **kw):
    with torch.device("meta"):
        model = MLP()
    x = torch.empty(batch, 256, device="meta")
    return autoparallel.plan(model, {"x": x, "y": x}, mesh_shape=mesh, cache_dir=False, cost_model=cost_model, **kw)


def test_overlappable_bucket_priced_below_a_blocking_one():
    cm = Overlapped("a100").bind(MeshSpec((4,)))
    blocking = cm.grad_reduction_time(0, 25 * 2**20)  # one 25 MiB bucket
    assert blocking > 0
    assert exposed_comm_time([(blocking, 2 * blocking)]) == 0.0  # hidden behind twice its time of compute
    assert exposed_comm_time([(blocking, blocking / 4)]) == pytest.approx(0.75 * blocking)
    assert exposed_comm_time([(blocking, 0.0)]) == blocking  # nothing beside it: as blocking
    # two buckets: the first hides behind the compute after it, the last launched has none
    assert exposed_comm_time([(blocking, blocking), (blocking, 0.0)]) == blocking
    # a link still busy with the first when the second launches: the queue carries over
    assert exposed_comm_time([(blocking, blocking / 2), (blocking, blocking)]) == pytest.approx(blocking / 2)
    assert exposed_comm_time([]) == 0.0


def test_plan_prices_exposed_gradient_reduction():
    plan = _mlp_plan(Overlapped("cpu"), batch=256, parallelism="data")
    est = plan.estimate
    assert 0 < est.exposed_grad_comm_s < est.grad_comm_s
    assert est.step_time_s == pytest.approx(est.compute_s + est.comm_s)
    blocking = _mlp_plan(BlockingSlowLink("cpu"), batch=256, parallelism="data").estimate
    overlapped = _mlp_plan(SlowLink("cpu"), batch=256, parallelism="data").estimate
    assert blocking.exposed_grad_comm_s == pytest.approx(blocking.grad_comm_s)
    assert overlapped.grad_comm_s == pytest.approx(blocking.grad_comm_s)
    assert overlapped.exposed_grad_comm_s < blocking.exposed_grad_comm_s
    # the first layer's gradient launches after the last backward op that depends on it: exposed in full
    first = 256 * 256 * 4 + 256 * 4
    assert overlapped.exposed_grad_comm_s >= first * 1e-9 * (1 - 1e-9)


@pytest.mark.parametrize("cost_model, mesh, parallelism", [
    (Overlapped("cpu"), (2,), "data"), (Overlapped("a100"), (2,), "data"), (Overlapped("cpu"), (2, 2), "auto"),
    (CostModel("cpu"), (2, 2), "auto"),
    (SlowLink("cpu"), (2,), "auto")])
def test_objective_equals_estimated_step_time(cost_model, mesh, parallelism):
    plan = _mlp_plan(cost_model, batch=128, mesh=mesh, parallelism=parallelism)
    assert plan.solver_stats.objective_s == pytest.approx(plan.estimate.step_time_s, rel=1e-9)
    assert plan.solver_stats.exposed_s <= plan.estimate.exposed_grad_comm_s + 1e-15


def test_overlap_makes_data_parallelism_win():
    # MLP, batch 192 on 2 devices, 1 GB/s: all-reducing the 1 MiB of gradients after the
    # backward costs more than tensor parallelism's activation all-reduces; launched during
    # the backward, only the first layer's gradient is left exposed, and data parallelism wins.
    # (A device without DTensor's dispatch overhead, which alone would make the replicated plan
    # win: a sharded parameter makes the optimizer step run on DTensors.)
    cpu = without_dtensor_overhead("cpu")
    overlapped = _mlp_plan(SlowLink(cpu), batch=192)
    blocking = _mlp_plan(BlockingSlowLink(cpu), batch=192)
    assert all(all(p == R for p in s) for s in overlapped.param_placements.values())
    assert any(any(p != R for p in s) for s in blocking.param_placements.values())
    assert overlapped.estimate.step_time_s < blocking.estimate.step_time_s


def test_plan_json_round_trip_keeps_the_estimate():
    plan = _mlp_plan(SlowLink("cpu"), batch=192)
    again = autoparallel.Plan.from_json(plan.to_json())
    assert again.to_json() == plan.to_json()
    assert again.estimate.exposed_grad_comm_s == plan.estimate.exposed_grad_comm_s
    assert again.estimate.grad_comm_s == plan.estimate.grad_comm_s


def test_ilp_exposed_rows_and_fixed_charges():
    # launch 0: node 1's strategy 1 launches 3 s of communication, node 0's strategy 0 runs
    # 2 s of compute after it; launch 1: node 0's strategy 1 launches 3 s; 1 s charged once
    # when any strategy 1 is chosen
    rows = [[[-2.0, 0.0], [0.0, 3.0]], [[0.0, 3.0], []]]
    problem = ILPProblem([[1.0, 0.0], [2.5, 0.0]], [], ["a", "b"], exposed_rows=rows,
                         fixed_charges=[FixedCharge(1.0, {0: [1], 1: [1]})])
    sol = solve(problem)
    # (0, 0): 3.5; (0, 1): 1 + max(0, 3 - 2) + 1 = 3; (1, 0): 2.5 + 3 + 1; (1, 1): 0 + 6 + 1
    assert sol.choice == [0, 1] and sol.objective == pytest.approx(3.0)
    assert sol.stats["exposed_s"] == pytest.approx(1.0)
