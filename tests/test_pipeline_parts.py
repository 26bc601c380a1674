"""The pieces of a pipelined plan that need no processes: tied parameters untied between the
pieces that read them, every captured node's stage, the record's checks, and ``step()`` on an
unpipelined plan (simulated ranks)."""

import copy

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode

import autoparallel
from autoparallel.mesh import MeshSpec
from autoparallel.passes.stages import loss_index, traced_stages
from autoparallel.pipeline_plan import PipelinePlan
from autoparallel.tracer import capture
from autoparallel.tracer.annotate import node_info
from autoparallel.tracer.untie import piece_of, untie_pieces
from models import ShardParams, batch_for, hf_model, to_meta, whole
from test_parity import assert_close

pytest.importorskip("transformers")


def _gpt2_capture(layers=6):
    torch.manual_seed(0)
    return capture(hf_model("gpt2", layers=layers), to_meta(batch_for("gpt2", 0)))


def test_the_tied_head_gets_its_own_name():
    traced = _gpt2_capture()
    assert traced.params["transformer.wte.weight"] == ["transformer.wte.weight", "lm_head.weight"]
    assert untie_pieces(traced, "transformer.h") == {"lm_head.weight": "transformer.wte.weight"}
    attrs = {n.target: n for n in traced.gm.graph.nodes if n.op == "get_attr"}
    assert traced.params["lm_head.weight"] == ["lm_head.weight"]
    assert traced.params["transformer.wte.weight"] == ["transformer.wte.weight"]
    assert {node_info(u).module_path for u in attrs["lm_head.weight"].users} == {"lm_head"}
    assert {node_info(u).module_path for u in attrs["transformer.wte.weight"].users} == {"transformer.wte"}


def test_every_node_runs_on_its_layers_stage_and_after_its_inputs():
    traced = _gpt2_capture()
    untie_pieces(traced, "transformer.h")
    pipeline = PipelinePlan(MeshSpec((2,), ("pp",)), 0, "transformer.h", (0, 2, 6), 2, "1F1B")
    stage = traced_stages(traced.gm, pipeline)
    for n in traced.gm.graph.nodes:
        layer = piece_of(node_info(n).module_path, "transformer.h") if n.op == "call_function" else None
        if layer is not None:
            assert stage[n.name] == (0 if layer < 2 else 1), n.name
        if n.op == "get_attr":  # a parameter lives with its readers
            assert {stage[u.name] for u in n.users} == {stage[n.name]}, n.name
        elif n.op != "placeholder":
            assert all(stage[a.name] <= stage[n.name] for a in n.all_input_nodes if a.op != "get_attr"), n.name
    output = next(n for n in traced.gm.graph.nodes if n.op == "output")
    assert stage[output.args[0][loss_index(traced.gm)].name] == 1
    attrs = {n.target: n.name for n in traced.gm.graph.nodes if n.op == "get_attr"}
    assert stage[attrs["transformer.wte.weight"]] == 0 and stage[attrs["lm_head.weight"]] == 1


@pytest.mark.parametrize("change, match", [
    (dict(microbatches=1), "microbatches"),
    (dict(schedule="Interleaved1F1B"), "multi-stage schedule"),
    (dict(boundaries=(0, 3, 3, 6)), "boundaries"),
    (dict(schedule="ZBVZeroBubble"), "schedule"),
])
def test_a_pipeline_out_of_range_is_refused(change, match):
    fields = dict(mesh=MeshSpec((2, 2), ("pp", "dp")), axis=0, layers="h", boundaries=(0, 3, 6), microbatches=2,
                  schedule="1F1B")
    with pytest.raises(ValueError, match=match):
        PipelinePlan(**{**fields, **change})


def test_step_runs_forward_and_backward_of_any_plan(sim_mesh):
    torch.manual_seed(0)
    ref = hf_model("gpt2").train()
    mesh = sim_mesh((2,))
    batch = batch_for("gpt2", 1)
    with LocalTensorMode(frozenset(range(2))):
        model = copy.deepcopy(ref)
        autoparallel.autoparallelize(model, to_meta(batch), device_mesh=mesh, cost_model=ShardParams("cpu"))
        loss = model.step(**batch)
    want = ref(**batch).loss
    want.backward()
    assert_close("loss", loss, want.detach())
    assert not loss.requires_grad
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_close(f"gradient of {name}", whole(p.grad), q.grad)
    with LocalTensorMode(frozenset(range(2))), torch.no_grad():  # a validation step: the forward only
        model.eval()
        model.zero_grad(set_to_none=True)
        loss = model.step(**batch)
    assert_close("loss in eval mode", loss, ref.eval()(**batch).loss.detach())
    assert all(p.grad is None for p in model.parameters())


def test_step_needs_a_loss(sim_mesh):
    mesh = sim_mesh((2,))
    with LocalTensorMode(frozenset(range(2))):
        model = torch.nn.Linear(16, 16)
        autoparallel.autoparallelize(model, (torch.empty(8, 16, device="meta"),), device_mesh=mesh)
        with pytest.raises(autoparallel.AutoParallelError, match="no 0-d floating tensor"):
            model.step(torch.randn(8, 16))


def test_a_multi_stage_schedule_needs_two_layers_per_device():
    torch.manual_seed(0)
    model = hf_model("gpt2", layers=6)
    with pytest.raises(autoparallel.AutoParallelError, match=r"8 pipeline stages \(2 per device under LoopedBFS\)"):
        autoparallel.plan(model, to_meta(batch_for("gpt2", 0)), mesh_spec=MeshSpec((4,), ("pp",)),
                          schedule="LoopedBFS", microbatches=4, cache_dir=False)
