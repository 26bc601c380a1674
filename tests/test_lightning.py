"""The Lightning strategy (autoparallel.lightning): a LightningModule whose MLP the plan shards
trains on 2 gloo processes as on one device, step by step (loss, gradient clipping by norm,
SGD with momentum), validates, saves a checkpoint of either kind and resumes from it (the whole
one onto another plan) with the losses the single-device run continues with, and accumulates
gradients over micro-batches; Lightning's own multiprocessing launcher runs it too and hands the
trained weights back to the main process; pipeline stages (a "pp" axis) train through
``self.model.step(...)`` as on one device, clipped by the norm over both stages, and validate
through it (the forward only, in eval mode).
``import autoparallel`` does not import lightning."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import autoparallel  # noqa: F401  before lightning: spawned ranks import this file first, and lightning
# imports torchvision (through torchmetrics), which needs autoparallel's shim on CPU torch
from gloo_ranks import spawn

L = pytest.importorskip("lightning")

WORLD = 2
HIDDEN = 64
LOCAL_BATCH = 4  # one rank's batch: the global batch is 8
STEPS_PER_EPOCH = 3
CLIP = 0.05  # below every step's gradient norm: each step is clipped
LR, MOMENTUM = 0.1, 0.9
STEPPED_LR = 1.0  # clipped to CLIP, each step moves every stage's weights well past the tolerance


def _data(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HIDDEN, generator=g), torch.randn(n, HIDDEN, generator=g)


def _loader(seed, n):
    # Lightning replaces the sampler of a training loader by a shuffling DistributedSampler
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*_data(seed, n)), batch_size=LOCAL_BATCH)


def _global_batches(seed, n, epoch):
    """The batches the 2 ranks pass together in ``epoch``, as the single device sees them: per
    step, rank 0's batch then rank 1's (the order ``inputs="local"`` concatenates them in), each
    rank's samples drawn by the DistributedSampler Lightning gives it (shuffled, seed 0)."""
    from torch.utils.data import DistributedSampler

    x, y = _data(seed, n)
    per_rank = []
    for r in range(WORLD):
        sampler = DistributedSampler(range(n), num_replicas=WORLD, rank=r, shuffle=True, seed=0)
        sampler.set_epoch(epoch)
        index = torch.tensor(list(sampler))
        per_rank.append(list(zip(x[index].split(LOCAL_BATCH), y[index].split(LOCAL_BATCH))))
    return [(torch.cat([p[s][0] for p in per_rank]), torch.cat([p[s][1] for p in per_rank]))
            for s in range(len(per_rank[0]))]


def _mlp(seed):
    import models

    torch.manual_seed(seed)
    return models.MLP(hidden=HIDDEN, layers=3)


class Regression(L.LightningModule):
    """An MLP that returns its own loss, ``self.model(x, y)``: the submodule the strategy
    parallelizes by default."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = self.model(*batch)
        self.losses.append(loss.detach().item())
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(*batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)


def _reference(epochs):
    """The single-device run: the losses of every step, the model after each epoch, and each
    step's gradient norm before clipping."""
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses, norms, models_after = [], [], []
    for epoch in range(epochs):
        for x, y in _global_batches(1, WORLD * LOCAL_BATCH * STEPS_PER_EPOCH, epoch):
            opt.zero_grad()
            loss = model(x, y)
            loss.backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            opt.step()
            losses.append(loss.item())
        models_after.append(copy.deepcopy(model))
    return losses, norms, models_after


def _accumulated_reference():
    """The single-device model after one SGD step on the gradient of epoch 0's batches
    accumulated, as ``accumulate_grad_batches`` takes it (each loss divided by their number)."""
    model = _mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    for x, y in _global_batches(1, WORLD * LOCAL_BATCH * STEPS_PER_EPOCH, 0):
        (model(x, y) / STEPS_PER_EPOCH).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    return model


def _strategy(**kwargs):
    import models

    from autoparallel.lightning import AutoParallelStrategy

    meta = (torch.empty(LOCAL_BATCH, HIDDEN, device="meta"), torch.empty(LOCAL_BATCH, HIDDEN, device="meta"))
    # ShardParams: gradient reduction priced high, so the plan shards the MLP's weights
    return AutoParallelStrategy(meta, cost_model=models.ShardParams("cpu"), cache_dir=False, **kwargs)


def _trainer(strategy, epochs, **kwargs):
    return L.Trainer(strategy=strategy, devices=WORLD, accelerator="cpu", max_epochs=epochs, gradient_clip_val=CLIP,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, **kwargs)


def _close(what, got, want, atol=1e-5):
    from torch.distributed.tensor import DTensor

    got = got.full_tensor() if isinstance(got, DTensor) else got
    torch.testing.assert_close(got, want, rtol=1e-4, atol=atol, msg=lambda m: f"rank {dist.get_rank()} {what}: {m}")


def _losses(what, got, want):
    if dist.get_rank() == 0:
        print(f"{what}: strategy {['%.6f' % v for v in got]}\n{' ' * len(what)}  1 device {['%.6f' % v for v in want]}")
    _close(what, torch.tensor(got), torch.tensor(want))


def _checks(rank, folder):
    from torch.distributed.tensor import DTensor, Shard

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))  # as torchrun: processes exist
    want, norms, after = _reference(epochs=2)
    assert min(norms) > CLIP, norms  # every step is clipped: clipping is tested

    lm = Regression(_mlp(0))
    trainer = _trainer(_strategy(), epochs=1)
    trainer.fit(lm, _loader(1, WORLD * LOCAL_BATCH * STEPS_PER_EPOCH))
    assert type(lm.model).__name__ == "AutoParallelMLP" and lm.model.holds_dtensors
    assert any(isinstance(p, DTensor) and Shard(0) in p.placements for p in lm.model.parameters()), lm.model.plan
    _losses("epoch 1 losses", lm.losses, want[:STEPS_PER_EPOCH])
    for (name, p), q in zip(lm.model.named_parameters(), after[0].parameters()):
        _close(f"{name} after epoch 1", p.detach(), q.detach())

    x, y = _data(2, WORLD * LOCAL_BATCH)
    (metrics,) = trainer.validate(lm, _loader(2, WORLD * LOCAL_BATCH), verbose=False)
    _close("val_loss", torch.tensor(metrics["val_loss"]), after[0](x, y).detach())
    lm.train()

    sharded, whole = os.path.join(folder, "sharded.ckpt"), os.path.join(folder, "whole.ckpt")
    trainer.save_checkpoint(sharded)  # a folder of torch.distributed.checkpoint shards (the default)
    trainer.strategy._save_distributed_checkpoint = False  # the same state as one file of whole tensors
    trainer.save_checkpoint(whole)
    dist.barrier()
    assert os.path.isdir(sharded) and os.path.isfile(whole)
    plain = Regression(_mlp(1))  # an ordinary checkpoint: a plain LightningModule loads it
    plain.load_state_dict(torch.load(whole, map_location="cpu", weights_only=False)["state_dict"])
    for (name, p), q in zip(plain.model.named_parameters(), after[0].parameters()):
        _close(f"{name} loaded on one device", p.detach(), q.detach())

    # the whole checkpoint resumes onto another plan: data parallelism, plain tensors
    for kind, path, options in (("sharded", sharded, {}), ("whole", whole, {"parallelism": "data"})):
        resumed = Regression(_mlp(1))  # other weights: the checkpoint's must replace them
        _trainer(_strategy(save_distributed_checkpoint=kind == "sharded", **options), epochs=2).fit(
            resumed, _loader(1, WORLD * LOCAL_BATCH * STEPS_PER_EPOCH), ckpt_path=path)
        assert resumed.model.holds_dtensors == (kind == "sharded")
        _losses(f"epoch 2 losses resumed from the {kind} checkpoint", resumed.losses, want[STEPS_PER_EPOCH:])
        for (name, p), q in zip(resumed.model.named_parameters(), after[1].parameters()):
            _close(f"{name} after epoch 2 resumed from the {kind} checkpoint", p.detach(), q.detach())

    accumulated = Regression(_mlp(0))  # the strategy's block_backward_sync: the modules' no_sync
    _trainer(_strategy(), epochs=1, accumulate_grad_batches=STEPS_PER_EPOCH).fit(
        accumulated, _loader(1, WORLD * LOCAL_BATCH * STEPS_PER_EPOCH))
    for (name, p), q in zip(accumulated.model.named_parameters(), _accumulated_reference().parameters()):
        _close(f"{name} after a step on {STEPS_PER_EPOCH} accumulated batches", p.detach(), q.detach())


@pytest.mark.multiprocess
def test_fit_validate_clip_checkpoint_resume_on_gloo_ranks(tmp_path):
    spawn(_checks, WORLD, str(tmp_path), timeout_s=300)


class Stepped(Regression):
    """The training step that runs every plan, pipelined or not: ``self.model.step(...)``
    (forward and backward), its loss returned for Lightning's hooks and logging."""

    def training_step(self, batch, batch_idx):
        loss = self.model.step(*batch)
        self.losses.append(loss.item())
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model.step(*batch)  # without gradients (Lightning's inference mode): the forward only
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=STEPPED_LR, momentum=MOMENTUM)


def _deep_mlp():
    import models

    torch.manual_seed(0)
    return models.MLP(hidden=HIDDEN, layers=6)  # pipeline stages cut a list of at least 6 alike layers


def _pipeline_checks(rank):
    """A mesh axis named "pp": the MLP's layers in 2 stages, one per rank, 1F1B over 2
    microbatches; every rank reads the global batch (the sampler over one replica)."""
    from lightning.pytorch.utilities.exceptions import MisconfigurationException
    from torch.utils.data import DistributedSampler

    from autoparallel.lightning import AutoParallelStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))
    n, batch = WORLD * LOCAL_BATCH * STEPS_PER_EPOCH, WORLD * LOCAL_BATCH
    x, y = _data(1, n)
    ref = _deep_mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=STEPPED_LR, momentum=MOMENTUM)
    order = torch.tensor(list(DistributedSampler(range(n), num_replicas=1, rank=0, shuffle=True, seed=0)))
    want = []
    for index in order.split(batch):
        opt.zero_grad()
        loss = ref(x[index], y[index])
        loss.backward()
        assert torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP) > CLIP  # clipped: the norm is tested
        opt.step()
        want.append(loss.item())

    meta = (torch.empty(batch, HIDDEN, device="meta"), torch.empty(batch, HIDDEN, device="meta"))
    def strategy():
        return AutoParallelStrategy(meta, mesh_dim_names=("pp",), microbatches=2, schedule="1F1B", cache_dir=False)

    vx, vy = _data(2, 2 * batch)
    with torch.no_grad():
        want_val = [ref.eval()(vx[i:i + batch], vy[i:i + batch]).item() for i in range(0, 2 * batch, batch)]

    lm = Stepped(_deep_mlp())
    lm.val_losses = []
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
    val_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(vx, vy), batch_size=batch)
    _trainer(strategy(), epochs=1).fit(lm, loader, val_loader)  # validates after the epoch, in eval mode
    pipeline = lm.model.plan.pipeline
    assert pipeline is not None and pipeline.stages == WORLD, lm.model.plan
    _losses("pipelined losses", lm.losses, want)
    _losses("pipelined validation losses", lm.val_losses, want_val)
    ref_params = dict(ref.named_parameters())
    held = dict(lm.model.named_parameters())
    assert held and all(f"layers.{layer}." in name for name in held
                        for layer in [int(name.split(".")[1])]
                        if pipeline.stage_of_layer(layer) == rank), sorted(held)
    initial = dict(_deep_mlp().named_parameters())
    for name, p in held.items():  # each rank its own stage's
        _close(f"{name} after a pipelined epoch", p.detach(), ref_params[name].detach())
    moved = sum(float((p.detach() - initial[name]).norm()) for name, p in held.items())
    assert moved > 1e-2, f"this stage's weights moved by {moved:.3g}: no training"

    with pytest.raises(MisconfigurationException, match="accumulate_grad_batches"):
        _trainer(strategy(), epochs=1, accumulate_grad_batches=2).fit(Stepped(_deep_mlp()), loader)


@pytest.mark.multiprocess
def test_pipeline_stages_train_through_step_on_gloo_ranks():
    spawn(_pipeline_checks, WORLD, timeout_s=300)


@pytest.mark.multiprocess
def test_multiprocessing_launcher_returns_the_trained_weights_whole():
    """``start_method="fork"`` (``"spawn"`` is the same launcher, Lightning's
    ``_MultiProcessingLauncher``, whose children re-import torch and lightning: 25 s more here):
    the launcher starts the processes and the process group; after ``fit`` the main process's
    LightningModule (never parallelized) holds the trained weights."""
    _, _, after = _reference(epochs=1)
    lm = Regression(_mlp(0))
    _trainer(_strategy(start_method="fork"), epochs=1).fit(lm, _loader(1, WORLD * LOCAL_BATCH * STEPS_PER_EPOCH))
    assert type(lm.model).__name__ == "MLP"
    for (name, p), q in zip(lm.model.named_parameters(), after[0].parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_import_autoparallel_does_not_import_lightning():
    code = "import sys, autoparallel; assert not any(m.split('.')[0] in ('lightning', 'pytorch_lightning') for m in sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))
