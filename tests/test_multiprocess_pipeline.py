"""Tier 3: pipelined plans on real gloo processes, run by torch.distributed.pipelining. Each case
trains one step with ``model.step()`` and SGD: the loss, every gradient and every parameter after
the step equal the single-device model's (each rank checks the parameters its stages hold), for
GPT-2 (embedding tied to the head, held by the first and last stage) and Llama, every schedule,
on (pp=2) x (dp=2) and pp=4, with parameters replicated or sharded within the stage and layers
recomputed within it (in every stage, in the one stage the budget needs it in, or in one of
the two stages a device runs and holds together), the zero-bubble schedule's weight backwards
apart from its input backwards (gradients reduced after the step);
``clip_grad_norm_`` clips by the whole model's norm; ``torch.distributed.checkpoint`` saves
and loads every stage's parameters; and ``step()`` without gradients in eval mode evaluates as
one device in eval mode does (with dropout too)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from autoparallel.pipeline_plan import SCHEDULES
from gloo_ranks import spawn

pytest.importorskip("transformers")
pytestmark = pytest.mark.multiprocess

LAYERS = 6


def _whole(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _close(what, got, want):
    torch.testing.assert_close(_whole(got), want, rtol=1e-4, atol=1e-5,
                               msg=lambda m: f"rank {dist.get_rank()} {what}: {m}")


def _case(mesh, name, schedule, microbatches, shard, save_to=None, budget_share=None, stage_checkpointing=None,
          layers=LAYERS, evaluate=False, **options):
    import autoparallel
    import models

    torch.manual_seed(0)
    ref = models.hf_model(name, layers=layers).train()
    model = copy.deepcopy(ref)
    batch = models.batch_for(name, 1)
    cost = models.ShardParams("cpu") if shard else autoparallel.CostModel()
    if budget_share is not None:  # of the unbudgeted plan's fullest stage
        spec = autoparallel.MeshSpec(tuple(mesh.shape), mesh.mesh_dim_names)
        free = autoparallel.plan(model, models.to_meta(batch), mesh_spec=spec, cost_model=cost, cache_dir=False,
                                 schedule=schedule, microbatches=microbatches)
        options["memory_budget"] = int(budget_share * max(free.pipeline.stage_peak_bytes))
    model = autoparallel.autoparallelize(model, models.to_meta(batch), device_mesh=mesh, cost_model=cost,
                                         cache_dir=False, schedule=schedule, microbatches=microbatches, **options)
    pipeline = model.plan.pipeline
    assert (pipeline.schedule, pipeline.microbatches) == (schedule, microbatches)
    if stage_checkpointing == "mixed":
        assert "off" in pipeline.checkpointing and set(pipeline.checkpointing) != {"off"}, pipeline
    elif stage_checkpointing is not None:
        assert pipeline.checkpointing == stage_checkpointing, pipeline
    if options.get("checkpointing") == "full":
        assert model.plan.checkpoint and "checkpoint" in model.graph_module.code
    pp_rank = mesh.get_local_rank(pipeline.axis)
    if pipeline.stages == pipeline.pp:  # one stage per rank: its graph is the module's
        assert ("checkpoint" in model.graph_module.code) == (pipeline.checkpointing[pp_rank] != "off")
    with pytest.raises(autoparallel.AutoParallelError, match=r"model\.step"):
        model(**batch)
    with pytest.raises(autoparallel.InputMismatchError, match="planned for"):
        model.step(**{k: v[:2] for k, v in batch.items()})
    held_layers = {int(n.split(".")[2]) for n, _ in model.named_parameters() if ".h." in n or ".layers." in n}
    mine = {layer for s in pipeline.stages_of_rank(pp_rank)
            for layer in range(pipeline.boundaries[s], pipeline.boundaries[s + 1])}
    assert held_layers == mine, f"{case_name(name, schedule)}: rank holds layers {held_layers}, its stages {mine}"

    what = case_name(name, schedule)
    if evaluate:
        _evaluate(model, ref, batch, what)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    loss = model.step(**batch)
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    _close(f"{what} loss", loss, ref_loss.detach())
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for n, p in model.named_parameters():
        _close(f"{what} gradient of {n}", p.grad, ref_params[n].grad)
    norm = model.clip_grad_norm_(0.5)  # the whole model's norm, every stage's parameters, the tied one once
    _close(f"{what} gradient norm", norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
    for n, p in model.named_parameters():
        _close(f"{what} clipped gradient of {n}", p.grad, ref_params[n].grad)
    opt.step()
    ref_opt.step()
    for n, p in model.named_parameters():
        _close(f"{what} {n} after one SGD step", p.detach(), ref_params[n].detach())
    if save_to is not None:
        _save_and_load(model, save_to, ref_params, what)


def _evaluate(model, ref, batch, what):
    """``step()`` without gradients in eval mode: the forward only, its graphs captured for
    this mode on first use; the loss is the single-device model's in eval mode."""
    model.eval(), ref.eval()
    with torch.no_grad():
        want = ref(**batch).loss
        _close(f"{what} loss in eval mode under no_grad", model.step(**batch), want)
    with torch.inference_mode():
        _close(f"{what} loss in eval mode under inference_mode", model.step(**batch), want)
    assert all(p.grad is None for p in model.parameters()), f"{what}: evaluating left gradients"
    model.train(), ref.train()


def _dropout(rank):
    """GPT-2 with dropout, planned in training mode: evaluated in eval mode as one device is (a
    graph with other nodes: the attention without dropout returns another layout), and trained
    with a dropout probability changed after planning (another graph again) as one device is."""
    import autoparallel
    import models

    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    ref = models.hf_model("gpt2", layers=LAYERS).train()
    for m in ref.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.3
    batch = models.batch_for("gpt2", 1)
    model = autoparallel.autoparallelize(copy.deepcopy(ref), models.to_meta(batch), device_mesh=mesh,
                                         cost_model=autoparallel.CostModel(), cache_dir=False, schedule="1F1B",
                                         microbatches=4)
    _evaluate(model, ref, batch, "gpt2 with dropout")
    assert torch.isfinite(model.step(**batch))  # training mode again: the graphs it was built with
    for m in (*model.modules(), *ref.modules()):
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for p in model.parameters():
        p.grad = None
    _close("gpt2 with dropout set to 0 after planning: loss", model.step(**batch), ref(**batch).loss.detach())
    ref(**batch).loss.backward()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    for n, p in model.named_parameters():
        _close(f"gpt2 with dropout set to 0 after planning: gradient of {n}", p.grad, ref_params[n].grad)


def _save_and_load(model, folder, ref_params, what):
    """torch.distributed.checkpoint writes every stage's parameters and loads them back in place."""
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), checkpoint_id=folder)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=folder)
    for n, p in model.named_parameters():
        _close(f"{what} {n} loaded by torch.distributed.checkpoint", p.detach(), ref_params[n].detach())


def case_name(name, schedule):
    return f"{name} {schedule}"


def _pp_dp(rank, folder):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    # a budget below the first stage's peak: it recomputes, the last stage does not
    _case(mesh, "gpt2", "1F1B", 2, shard=False, save_to=f"{folder}/replicated", budget_share=0.85,
          stage_checkpointing=("full", "off"))
    _case(mesh, "gpt2", "GPipe", 4, shard=True, save_to=f"{folder}/sharded", checkpointing="full")
    # two stages per device, which together overflow the budget: one recomputes, another not
    _case(mesh, "llama", "Interleaved1F1B", 2, shard=False, budget_share=0.8, stage_checkpointing="mixed")
    _case(mesh, "llama", "LoopedBFS", 4, shard=True)
    _case(mesh, "gpt2", "Interleaved1F1B", 2, shard=True, evaluate=True)
    _case(mesh, "gpt2", "LoopedBFS", 4, shard=False)  # runs a stage's backwards last microbatch first
    _case(mesh, "llama", "1F1B", 2, shard=True)
    _case(mesh, "llama", "GPipe", 4, shard=False)
    # the weights' backward apart from the inputs': the replicated gradients reduced after the step
    _case(mesh, "gpt2", "InterleavedZeroBubble", 2, shard=False)
    _case(mesh, "llama", "InterleavedZeroBubble", 2, shard=True)


def _pp4(rank):
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("pp",))
    for name in ("gpt2", "llama"):
        for schedule in SCHEDULES:  # 8 layers: two stages on each of the 4 devices under the multi-stage ones
            _case(mesh, name, schedule, 4, shard=False, layers=8, evaluate=schedule == "1F1B")


def test_pipeline_parity_pp2_dp2(tmp_path):
    spawn(_pp_dp, 4, str(tmp_path), timeout_s=300)


def test_pipeline_parity_pp4():
    spawn(_pp4, 4, timeout_s=300)


def test_pipeline_evaluates_with_dropout():
    spawn(_dropout, 4, timeout_s=300)


def _auto(rank):
    import autoparallel
    import models

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dim0",))
    batch = models.batch_for("gpt2", 1)
    for beta, staged in ((1e-7, True), (1e-12, False)):  # a slow link: stages pay; a fast one: they do not
        torch.manual_seed(0)
        ref = models.hf_model("gpt2", layers=LAYERS).train()
        spec = autoparallel.MeshSpec((2,), ("dim0",), alpha=1e-3, beta=beta)
        model = autoparallel.autoparallelize(copy.deepcopy(ref), models.to_meta(batch), device_mesh=mesh,
                                             mesh_spec=spec, cost_model=autoparallel.CostModel(), cache_dir=False,
                                             pipeline="auto")
        assert (model.plan.pipeline is not None) == staged
        _close(f"pipeline='auto', beta {beta}: loss", model.step(**batch), ref(**batch).loss.detach())


def test_pipeline_auto_stages_a_slow_axis_only():
    spawn(_auto, 2, timeout_s=300)
