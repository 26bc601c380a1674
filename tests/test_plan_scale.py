"""Planning at 3-D scale: all-pairs redistribution costs and resharding edges as flows
(docs/design.md, "Planning at 3-D scale")."""

import math

import numpy as np
import pytest
import torch

import autoparallel
from autoparallel.mesh import MeshSpec
from autoparallel.placement import P, R
from autoparallel.solver import CostModel, ILPEdge, ILPProblem, Redistributor, solve
from autoparallel.solver.ilp import Flow
from autoparallel.solver.planner import Planner
from models import hf_model


@pytest.mark.parametrize("requires_grad", [False, True])
def test_distances_are_the_cheapest_paths(requires_grad):
    layout = Redistributor(CostModel("h100").bind(MeshSpec((2, 2, 2))))
    shape = (4, 6)
    g, d, move_s = layout.distances(shape, 4, True, requires_grad)
    assert g.specs[0] == (R, R, R) and len(g.specs) == len(set(g.specs)) > 40
    dijkstra = np.array([[layout.paths_from(shape, 4, True, src, requires_grad)[dst][0] for dst in g.specs]
                         for src in g.specs])
    np.testing.assert_allclose(d, dijkstra, rtol=1e-12)
    assert len(move_s) == len(g.arcs) and (move_s > 0).all() and (move_s >= d[tuple(zip(*((i, j) for i, j, _ in g.arcs)))]).all()
    for src in g.specs[::7]:
        for dst in g.specs[::5]:
            assert layout.cost(shape, 4, True, src, dst, requires_grad) == d[g.index[src], g.index[dst]]
    # an integer tensor has no Partial specs: the graph leaves them out
    g_int, _, _ = layout.distances(shape, 8, False, False)
    assert {s for s in g.specs if P not in s} == set(g_int.specs)


def test_flow_edge_prices_the_cheapest_path():
    # two nodes with three strategies each, a tensor that goes a -> b -> c in the spec graph:
    # the flow must take the two-move path where the pairwise form prices it directly
    arcs = [(0, 1, 1.0), (1, 2, 1.0), (0, 2, 5.0), (2, 0, 0.5)]
    cost = [[0.0, 1.0, 2.0], [math.inf, 0.0, 1.0], [0.5, 1.5, 0.0]]
    pair = ILPProblem([[0.0, 10.0, 10.0], [10.0, 10.0, 0.0]], [ILPEdge(0, 1, [0, 1, 2], [0, 1, 2], cost)])
    flow = ILPProblem([[0.0, 10.0, 10.0], [10.0, 10.0, 0.0]],
                      [ILPEdge(0, 1, [0, 1, 2], [0, 1, 2], cost, Flow([0, 1, 2], [0, 1, 2], arcs))])
    a, b = solve(pair), solve(flow)
    assert a.choice == b.choice == [0, 2]
    assert a.objective == b.objective == pytest.approx(2.0)
    assert b.stats["edge_vars"] == len(arcs)


@pytest.mark.slow
def test_flow_edges_keep_the_optimum(monkeypatch):
    """On a (2, 2) mesh the planner gives the attention tensors' edges as flows; the ILP with every
    edge pairwise instead has the same optimum, with more variables."""
    pytest.importorskip("transformers")
    planners = []
    original = Planner.solve

    def keep(self, **kw):
        planners.append(self)
        return original(self, **kw)

    monkeypatch.setattr(Planner, "solve", keep)
    with torch.device("meta"):
        model = hf_model("llama", layers=2)
    inputs = {k: torch.empty(8, 32, dtype=torch.long, device="meta") for k in ("input_ids", "labels")}
    plan = autoparallel.plan(model, inputs, mesh_shape=(2, 2), cache_dir=False)
    built = planners[0].build_problem()
    flows = [e for e in built.ilp.edges if e.flow is not None]
    assert flows, "no edge was given as a flow"
    with_flows = solve(built.ilp)
    for e in flows:
        e.flow = None
    pairwise = solve(built.ilp)
    assert with_flows.objective == pytest.approx(pairwise.objective, rel=1e-9)
    assert with_flows.objective == pytest.approx(plan.solver_stats.objective_s, rel=1e-9)
    assert with_flows.stats["edge_vars"] < pairwise.stats["edge_vars"]
