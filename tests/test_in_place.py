"""The model stays the user's model: autoparallelize parallelizes it in place (its class, submodules,
attributes and methods kept), optimizers built after the call train it, input gradients are the
single-device ones, generate runs, no_sync accumulates as DDP's, conversions are refused."""

import copy

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode

import autoparallel
from models import MLP, ShardParams, batch_for, hf_model, placements_of, to_meta, whole
from test_parity import assert_close

RANKS2 = frozenset(range(2))


def _gpt2(sim_mesh, shape=(2,), **kwargs):
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    ref = hf_model("gpt2").train()
    mesh = sim_mesh(shape)
    with LocalTensorMode(frozenset(range(mesh.size()))):
        model = copy.deepcopy(ref)
        out = autoparallel.autoparallelize(model, to_meta(batch_for("gpt2", 0)), device_mesh=mesh,
                                           cost_model=ShardParams("cpu"), **kwargs)
    assert out is model
    return ref, model


def test_the_model_keeps_its_class_submodules_and_methods(sim_mesh):
    import transformers as T

    ref, model = _gpt2(sim_mesh)
    assert isinstance(model, T.GPT2LMHeadModel) and isinstance(model, autoparallel.ParallelModule)
    assert type(model).__name__ == "AutoParallelGPT2LMHeadModel"
    assert type(model.transformer.h[0]) is type(ref.transformer.h[0])  # real submodules, subscriptable
    assert model.config.n_layer == 2 and model.get_input_embeddings() is model.transformer.wte
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert any(placements_of(p) for p in model.parameters())  # ShardParams splits parameters
    with pytest.raises(autoparallel.AutoParallelError, match="already parallelized"):
        autoparallel.plan(model, to_meta(batch_for("gpt2", 0)), mesh_shape=(2,))


def test_an_optimizer_built_after_trains_one_built_before_raises(sim_mesh):
    torch.manual_seed(0)
    ref = MLP()
    model = copy.deepcopy(ref)
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    mesh = sim_mesh((2,))
    with LocalTensorMode(RANKS2):
        autoparallel.autoparallelize(model, to_meta(batch_for("mlp", 0)), device_mesh=mesh,
                                     cost_model=ShardParams("cpu"))
        # eps well above the gradients' rounding (about 1e-8 here): AdamW's update of an element whose
        # gradient is near 0 is lr * g / (|g| + eps), which the rounding of g would decide
        opt = torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, eps=1e-3)
    for step in range(3):
        batch = batch_for("mlp", step)
        ref_opt.zero_grad()
        want = ref(**batch)
        want.backward()
        ref_opt.step()
        with LocalTensorMode(RANKS2):
            opt.zero_grad()
            got = model(**batch)
            got.backward()
            opt.step()
        assert_close(f"loss {step}", got.detach(), want.detach())
    for name, p in model.named_parameters():
        assert_close(f"{name} after 3 AdamW steps", whole(p.detach()), dict(ref.named_parameters())[name].detach())
    with pytest.raises(autoparallel.AutoParallelError, match="before autoparallelize replaced"):
        early.step()


def test_input_gradients_are_the_single_device_ones(sim_mesh):
    """inputs_embeds that require grad (soft prompts), and a Linear upstream of the model."""
    ref, model = _gpt2(sim_mesh, shape=(2, 2))
    batch = batch_for("gpt2", 1)
    torch.manual_seed(1)
    upstream = torch.nn.Linear(64, 64)
    embeds = torch.randn(8, 16, 64)
    ranks = frozenset(range(4))
    want_in = embeds.clone().requires_grad_()
    ref(inputs_embeds=upstream(want_in), labels=batch["labels"]).loss.backward()
    want_up = {n: p.grad.clone() for n, p in upstream.named_parameters()}
    upstream.zero_grad()
    with LocalTensorMode(ranks):
        got_in = embeds.clone().requires_grad_()
        model(inputs_embeds=upstream(got_in), labels=batch["labels"]).loss.backward()
        assert_close("inputs_embeds.grad", got_in.grad, want_in.grad)
        for n, p in upstream.named_parameters():
            assert_close(f"upstream {n}.grad", p.grad, want_up[n])
    assert len(model.plans) == 2  # the new keywords were planned on first use


def test_generate_returns_the_single_device_tokens(sim_mesh):
    ref, model = _gpt2(sim_mesh)
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    ref.eval()
    want = ref.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    model.eval()
    with LocalTensorMode(RANKS2):
        got = model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    assert_close("generated tokens", got, want)


def test_a_call_export_cannot_capture_runs_eagerly_with_exact_gradients(sim_mesh):
    """use_cache=True in training returns a cache object torch.export cannot capture: the call
    runs the model's own forward on whole parameters, with a warning, and its loss and every
    gradient are the single-device ones."""
    ref, model = _gpt2(sim_mesh)
    batch = batch_for("gpt2", 6)
    ref(**batch, use_cache=True).loss.backward()
    with LocalTensorMode(RANKS2), pytest.warns(UserWarning, match="cannot be captured"):
        got = model(**batch, use_cache=True).loss
        got.backward()
        assert_close("loss", got.detach(), ref(**batch, use_cache=True).loss.detach())
        for name, p in model.named_parameters():
            assert_close(f"grad of {name}", whole(p.grad), dict(ref.named_parameters())[name].grad)
    assert len(model._ap.eager.refused) == 1


def test_attribute_changes_are_captured_again(sim_mesh):
    """A plain attribute the captured graph depends on (a LayerNorm's eps), set after
    the call: the next call is captured again and computes what the model now does."""
    ref, model = _gpt2(sim_mesh)
    batch = batch_for("gpt2", 2)
    with LocalTensorMode(RANKS2):
        first = model(**batch).loss.detach()
    assert_close("loss", first, ref(**batch).loss.detach())
    for m in (ref, model):
        m.transformer.h[0].ln_1.eps = 0.5
    with LocalTensorMode(RANKS2):
        again = model(**batch).loss.detach()
    want = ref(**batch).loss.detach()
    assert not torch.allclose(want, first)
    assert_close("loss after the attribute change", again, want)
    assert len(model._ap.variants) == 2


def test_no_sync_accumulates_as_ddp(sim_mesh):
    torch.manual_seed(0)
    ref = MLP()
    mesh = sim_mesh((2,))
    with LocalTensorMode(RANKS2):
        model = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(batch_for("mlp", 0)), device_mesh=mesh,
                                             parallelism="data")
    batches = [batch_for("mlp", s) for s in (1, 2, 3)]
    for b in batches:
        ref(**b).backward()
    with LocalTensorMode(RANKS2):
        with model.no_sync():
            model(**batches[0]).backward()
            model(**batches[1]).backward()
        model(**batches[2]).backward()
        for name, p in model.named_parameters():
            assert_close(f"accumulated grad of {name}", whole(p.grad), dict(ref.named_parameters())[name].grad)


def test_conversions_point_at_mp_policy(sim_mesh):
    _, model = _gpt2(sim_mesh)
    with pytest.raises(autoparallel.AutoParallelError, match="mp_policy=MixedPrecisionPolicy"):
        model.half()
    with pytest.raises(autoparallel.AutoParallelError, match="mp_policy"):
        model.to(torch.bfloat16)
    assert model.to("cpu") is model and model.float() is model  # no change: allowed


def test_submodule_hooks_fire_with_exact_gradients(sim_mesh):
    """A forward hook on a submodule fires: the call runs the model's own forward on whole
    parameters (with a warning under grad, where it is slow), its loss and every gradient the
    single-device ones."""
    ref, model = _gpt2(sim_mesh)
    seen = []
    model.transformer.h[1].register_forward_hook(lambda m, i, o: seen.append(type(m).__name__))
    batch = batch_for("gpt2", 4)
    ref(**batch).loss.backward()
    with LocalTensorMode(RANKS2):
        with torch.no_grad():
            got = model(**batch).loss
        with pytest.warns(UserWarning, match="transformer.h.1"):
            model(**batch).loss.backward()
        for name, p in model.named_parameters():
            assert_close(f"grad of {name}", whole(p.grad), dict(ref.named_parameters())[name].grad)
    assert seen == ["GPT2Block"] * 2
    assert_close("eager loss", got, ref(**batch).loss.detach())
