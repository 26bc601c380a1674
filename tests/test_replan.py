"""Re-planning when a call's input shapes differ from the planned ones (``replan=True``)."""

import copy

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode

import autoparallel
from autoparallel.options import PlanOptions
from autoparallel.solver.pipeline import plan_traced
from models import MLP, ShardParams, batch_for, hf_model, placements_of, to_meta, whole
from test_parity import assert_close, loss_of


def check_step(pmodel, ref, batch, ranks, what):
    """One forward and backward of both models on ``batch``: loss and every gradient equal."""
    for p in ref.parameters():
        p.grad = None
    want = loss_of(ref(**batch))
    want.backward()
    ref_params = dict(ref.named_parameters())
    with LocalTensorMode(ranks):
        for p in pmodel.parameters():
            p.grad = None
        got = loss_of(pmodel(**batch))
        got.backward()
        assert_close(f"{what} loss", got.detach(), want.detach())
        for name, p in pmodel.named_parameters():
            assert_close(f"{what} grad of {name} {placements_of(p)}", whole(p.grad), ref_params[name].grad)


@pytest.mark.slow
def test_gpt2_replans_smaller_batch_and_sequence(sim_mesh):
    pytest.importorskip("transformers")
    mesh = sim_mesh((2, 2))
    ranks = frozenset(range(4))
    torch.manual_seed(0)
    ref = hf_model("gpt2").train()
    with LocalTensorMode(ranks):
        # parameters split by the planner, so that pinning them is what makes the re-plan valid
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(batch_for("gpt2", 0)), device_mesh=mesh,
                                              cost_model=ShardParams("cpu"), replan=True)
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    first = pmodel.plan
    assert any(not all(p == autoparallel.placement.R for p in s) for s in first.param_placements.values())
    params = {n: p for n, p in pmodel.named_parameters()}
    small = batch_for("gpt2", 1, batch=4, seq=8)

    check_step(pmodel, ref, small, ranks, "batch 4, seq 8")
    assert len(pmodel.plans) == 2 and pmodel.plan is first  # the planned shapes stay the first plan
    new_plan = pmodel.plans[True, tuple(((4, 8), torch.int64) for _ in range(2))]
    assert new_plan is not first and new_plan.param_placements == first.param_placements
    assert new_plan.nodes["input_ids"].out_shapes == [(4, 8)]
    assert {n: p for n, p in pmodel.named_parameters()} == params  # the same objects: nothing moved

    with LocalTensorMode(ranks):
        opt.step()
    ref_opt.step()
    check_step(pmodel, ref, batch_for("gpt2", 2), ranks, "back at batch 8 after a step")
    check_step(pmodel, ref, batch_for("gpt2", 3, batch=4, seq=8), ranks, "batch 4 again")
    assert len(pmodel.plans) == 2 and pmodel._ap.recapture.captures == 1  # the cached graph was reused


def test_without_replan_the_error_names_input_shapes_and_the_option(sim_mesh):
    mesh = sim_mesh((2,))
    batch = batch_for("mlp", 0)
    with LocalTensorMode(frozenset(range(2))):
        pmodel = autoparallel.autoparallelize(MLP(), to_meta(batch), device_mesh=mesh, replan=False)
        with pytest.raises(autoparallel.InputMismatchError) as info:
            pmodel(x=batch["x"][:4], y=batch["y"][:4])
    msg = str(info.value)
    assert "argument x has shape (4, 256)" in msg and "(4, 256)" in msg and "(8, 256)" in msg and "replan=True" in msg


def test_replan_keeps_placements_and_caches_by_signature(sim_mesh, monkeypatch):
    mesh = sim_mesh((2,))
    ranks = frozenset(range(2))
    torch.manual_seed(0)
    ref = MLP()
    captures = []
    trace = autoparallel.tracer.ColoTracer.trace

    def counting(self, model, meta_inputs):
        captures.append(model)
        return trace(self, model, meta_inputs)

    monkeypatch.setattr(autoparallel.tracer.ColoTracer, "trace", counting)
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(batch_for("mlp", 0)), device_mesh=mesh,
                                              cost_model=ShardParams("cpu"))
    assert len(captures) == 1
    skeleton = pmodel._ap.recapture.skeleton
    assert all(t.device.type == "meta" for t in list(skeleton.parameters()) + list(skeleton.buffers()))
    for batch in (4, 4, 8, 2, 4, 8):
        check_step(pmodel, ref, batch_for("mlp", batch, batch=batch), ranks, f"batch {batch}")
    assert len(captures) == 3 and captures[1] is captures[2] is skeleton  # batches 4 and 2, once each
    assert [sig[0][0] for _, sig in pmodel.plans] == [(8, 256), (4, 256), (2, 256)]
    for p in pmodel.plans.values():
        assert p.param_placements == pmodel.plan.param_placements
    pmodel._ap.recapture.replan = False
    with LocalTensorMode(ranks), pytest.raises(autoparallel.InputMismatchError, match="keyword arguments"):
        pmodel(x=torch.randn(4, 256))  # without replan, a call with other keywords is refused


def test_a_pin_no_strategy_keeps_names_the_parameter():
    traced = autoparallel.tracer.ColoTracer().trace(MLP(), to_meta(batch_for("mlp", 0)))
    S = torch.distributed.tensor.Shard

    def plan(pinned):
        return plan_traced(traced, autoparallel.MeshSpec((2,)), PlanOptions(time_limit=10, cache_dir=False),
                           pinned=pinned)

    pinned = {name: (S(0),) for name in traced.params}
    assert plan(pinned).param_placements == pinned  # kept, whatever the costs prefer
    with pytest.raises(autoparallel.AutoParallelError, match=r"parameter layers\.2\.bias \(256,\) cannot keep"):
        plan(dict(pinned, **{"layers.2.bias": (S(1),)}))  # a 1-D tensor has no dim 1
    del pinned["layers.2.bias"]
    with pytest.raises(autoparallel.AutoParallelError, match=r"parameter layers\.2\.bias has no placement"):
        plan(pinned)
