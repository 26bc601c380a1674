"""Tier 3: the model kept in place, through real c10d on 2 gloo ranks, one spawn for every check:
AdamW built after the call trains it as on one device, generate gives the single-device tokens,
save_pretrained writes files from_pretrained loads into an equal plain model, input gradients and
no_sync accumulation equal the single-device ones, .half() is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from gloo_ranks import spawn

pytest.importorskip("transformers")

WORLD = 2


def _close(what, got, want, atol=1e-5):
    from torch.distributed.tensor import DTensor

    got = got.full_tensor() if isinstance(got, DTensor) else got
    torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda m: f"rank {dist.get_rank()} {what}: {m}")


def _parallel(ref, autoparallel, models, mesh, **kwargs):
    model = copy.deepcopy(ref)
    out = autoparallel.autoparallelize(model, models.to_meta(models.batch_for("gpt2", 0)), device_mesh=mesh,
                                       cost_model=models.ShardParams("cpu"), cache_dir=False, **kwargs)
    assert out is model and type(model).__name__ == "AutoParallelGPT2LMHeadModel"
    return model


def _train_with_adamw(ref, model, models):
    ref = copy.deepcopy(ref)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(2):
        batch = models.batch_for("gpt2", step + 1)
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            loss = m(**batch).loss
            loss.backward()
            o.step()
            if m is ref:
                want = loss.detach()
        _close(f"AdamW step {step} loss", loss.detach(), want)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        # Adam divides by the gradient's scale: a near-zero gradient's rounding moves a weight by up to lr
        _close(f"{name} after 2 AdamW steps", p.detach(), q.detach(), atol=1e-4)


def _generate(ref, model):
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    ref, model = copy.deepcopy(ref).eval(), model.eval()
    kw = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0)
    assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
    model.train()


def _save_and_load(ref, model, folder):
    import transformers as T

    model.save_pretrained(folder)  # every rank gathers, rank 0 writes
    dist.barrier()
    loaded = T.GPT2LMHeadModel.from_pretrained(folder)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters()):
        _close(f"{name} loaded by from_pretrained", p.detach(), q.detach())
    assert type(loaded) is T.GPT2LMHeadModel


def _input_gradients(ref, model, models):
    batch = models.batch_for("gpt2", 5)
    embeds = torch.randn(8, 16, 64, generator=torch.Generator().manual_seed(5))
    want, got = embeds.clone().requires_grad_(), embeds.clone().requires_grad_()
    copy.deepcopy(ref)(inputs_embeds=want, labels=batch["labels"]).loss.backward()
    model(inputs_embeds=got, labels=batch["labels"]).loss.backward()
    _close("inputs_embeds.grad", got.grad, want.grad)


def _no_sync(ref, autoparallel, models, mesh):
    ref = copy.deepcopy(ref)
    model = _parallel(ref, autoparallel, models, mesh, parallelism="data")
    batches = [models.batch_for("gpt2", s) for s in (6, 7, 8)]
    for b in batches:
        ref(**b).loss.backward()
    with model.no_sync():
        model(**batches[0]).loss.backward()
        model(**batches[1]).loss.backward()
    model(**batches[2]).loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(f"accumulated grad of {name}", p.grad, q.grad)


def _checks(rank, folder):
    import autoparallel
    import models

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    ref = models.hf_model("gpt2").train()
    model = _parallel(ref, autoparallel, models, mesh)
    _train_with_adamw(ref, model, models)
    model = _parallel(ref, autoparallel, models, mesh)  # untrained again
    _generate(ref, model)
    _save_and_load(ref, model, folder)
    _input_gradients(ref, model, models)
    with pytest.raises(autoparallel.AutoParallelError, match="mp_policy"):
        model.half()
    _no_sync(ref, autoparallel, models, mesh)


@pytest.mark.multiprocess
def test_the_model_in_place_on_gloo_ranks(tmp_path):
    spawn(_checks, WORLD, str(tmp_path / "saved"), timeout_s=300)
