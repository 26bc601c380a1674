"""Outputs cost what they are: ``outputs="sharded"`` (default) returns a value the plan keeps
split as a DTensor in its placements (a language model's logits), ``"replicated"`` every value
whole; the plan prices, and validation checks, exactly the redistribution returned."""

import copy
import json

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate

import autoparallel
from autoparallel.errors import PlanMismatchError
from autoparallel.plan import Plan
from autoparallel.tracer import ColoTracer
from autoparallel.validate import validate_plan
from models import CheapComm, batch_for, build_model, to_meta, whole
from test_parity import assert_close

pytest.importorskip("transformers")

CASES = [((2,), "cheap-comm"), ((2, 2), "cheap-comm")]
COSTS = {"cpu": lambda: autoparallel.CostModel("cpu"), "cheap-comm": lambda: CheapComm("cpu")}


def _run(mesh_shape, cost, sim_mesh, outputs=None):
    """GPT-2 on a simulated mesh and on one device, one forward and backward each (the loss
    backward, plus the logits' own term so their returned gradient is exercised): the module's
    outputs, the reference's, and both models."""
    ref = build_model("gpt2")
    model = copy.deepcopy(ref)
    batch = batch_for("gpt2", 0)
    ranks = frozenset(range(sim_mesh(mesh_shape).size()))
    mesh = sim_mesh(mesh_shape)
    kw = {} if outputs is None else {"outputs": outputs}
    want = ref(**batch)
    (want.loss + want.logits.square().mean()).backward()
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, to_meta(batch), device_mesh=mesh, cost_model=COSTS[cost](), **kw)
        got = pmodel(**batch)
        logits = got.logits.full_tensor() if isinstance(got.logits, DTensor) else got.logits
        (got.loss + logits.square().mean()).backward()
        grads = {n: whole(p.grad) for n, p in pmodel.named_parameters()}
    return pmodel, got, logits, want, ref, grads


def test_split_output_errors_name_the_remedies(sim_mesh):
    """A split output mixed with a plain tensor, or read as Python values, fails inside DTensor;
    the error names .full_tensor() and outputs="replicated", through ops on the output too."""
    model, batch, mesh = build_model("gpt2"), batch_for("gpt2", 0), sim_mesh((2,))
    with LocalTensorMode(frozenset(range(2))):
        pmodel = autoparallel.autoparallelize(model, to_meta(batch), device_mesh=mesh, cost_model=CheapComm("cpu"))
        logits = pmodel(**batch).logits
        assert isinstance(logits, DTensor) and logits.placements != (Replicate(),)
        flat = logits.flatten(0, 1)  # an op's result keeps the hint
        for use in (lambda: torch.nn.functional.cross_entropy(flat, batch["labels"].flatten()),
                    lambda: logits.tolist()):
            with pytest.raises(RuntimeError, match=r'(?s)full_tensor\(\).*outputs="replicated"'):
                use()
        torch.testing.assert_close(flat.full_tensor(), logits.full_tensor().flatten(0, 1))


@pytest.mark.parametrize("mesh_shape,cost", CASES, ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else c)
def test_sharded_outputs(mesh_shape, cost, sim_mesh):
    pmodel, got, logits, want, ref, grads = _run(mesh_shape, cost, sim_mesh)
    assert pmodel.plan.outputs == "sharded"
    assert not isinstance(got.loss, DTensor)
    assert_close("loss", got.loss.detach(), want.loss.detach())
    assert isinstance(got.logits, DTensor) and tuple(got.logits.shape) == tuple(want.logits.shape)
    assert any(p != Replicate() for p in got.logits.placements)
    assert_close("logits", logits.detach(), want.logits.detach())
    for name, p in ref.named_parameters():
        assert_close(f"grad of {name}", grads[name], p.grad)
    assert all(c.shape == () for c in pmodel.plan.redistributions if c.dst == "output")  # the loss only
    assert not _collective_returned(pmodel, 1)  # the logits are returned as computed


def test_replicated_outputs(sim_mesh):
    pmodel, got, logits, want, ref, grads = _run((2,), "cheap-comm", sim_mesh, outputs="replicated")
    assert pmodel.plan.outputs == "replicated"
    assert not isinstance(got.logits, DTensor) and not isinstance(got.loss, DTensor)
    assert_close("logits", logits.detach(), want.logits.detach())
    for name, p in ref.named_parameters():
        assert_close(f"grad of {name}", grads[name], p.grad)
    assert _collective_returned(pmodel, 1)  # the logits are gathered


def _collective_returned(pmodel, k) -> bool:
    """Whether output ``k`` of the per-device graph comes out of a collective (a gather may be
    followed by a reshape that joins its pieces)."""
    out = next(n for n in pmodel.graph_module.graph.nodes if n.op == "output")
    x = out.args[0][k]
    seen = 0
    while isinstance(x, torch.fx.Node) and x.op == "call_function" and seen < 6:
        if x.target is torch.ops._c10d_functional.wait_tensor.default:
            return True
        x, seen = x.args[0], seen + 1
    return False


def _plans(mesh_shape=(2,)):
    model = build_model("gpt2")
    meta = to_meta(batch_for("gpt2", 0))
    plans = {o: autoparallel.plan(model, meta, mesh_shape=mesh_shape, cost_model=autoparallel.CostModel("cpu"),
                                  cache_dir=False, outputs=o) for o in ("sharded", "replicated")}
    return plans, ColoTracer().trace(model, meta)


def test_estimate_and_validation():
    plans, traced = _plans()
    sharded, replicated = plans["sharded"], plans["replicated"]
    assert sharded.estimate.step_time_s <= replicated.estimate.step_time_s
    assert sharded.estimate.peak_memory_bytes <= replicated.estimate.peak_memory_bytes
    assert not any(c.dst == "output" for c in sharded.redistributions if c.shape[-1] == 128)  # logits
    for p in plans.values():
        validate_plan(Plan.from_json(p.to_json()), traced)
    # a saved plan without the field returns everything whole, as it was made to
    old = json.loads(replicated.to_json())
    del old["outputs"]
    assert Plan.from_json(json.dumps(old)).outputs == "replicated"
    validate_plan(Plan.from_json(json.dumps(old)), traced)
    # each plan's output redistributions follow its own mode only
    for plan, other in ((sharded, "replicated"), (replicated, "sharded")):
        d = json.loads(plan.to_json())
        d["outputs"] = other
        with pytest.raises(PlanMismatchError, match="input 0 of output|input 1 of output|redistributions"):
            validate_plan(Plan.from_json(json.dumps(d)), traced)
    with pytest.raises(ValueError, match="outputs"):
        Plan.from_json(json.dumps(dict(json.loads(sharded.to_json()), outputs="whole")))


def test_outputs_argument_checked():
    with pytest.raises(ValueError, match="outputs must be 'sharded' or 'replicated'"):
        autoparallel.plan(build_model("mlp"), to_meta(batch_for("mlp", 0)), mesh_shape=(2,), outputs="whole")
