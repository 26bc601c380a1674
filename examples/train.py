"""A training recipe: a demo model, autoparallelized, trained with the usual pieces.

Run (4 CPU processes, a 2 x 2 mesh; the flags are those of ``--help``, a ``--config
run.toml`` sets their defaults)::

    torchrun --standalone --nproc-per-node 4 examples/train.py --model gpt2 --layers 2 \\
        --hidden 64 --mesh 2x2 --mesh-axes dp tp --steps 20
    python -m autoparallel train --model gpt2 --layers 2 --hidden 64 --mesh 2x2 --steps 20  # the same

It reads top to bottom:

1. the :class:`autoparallel.Config` (mesh, mixed precision, memory budget, checkpointing and
   the planning options), the demo model's :class:`~autoparallel.demo.ModelConfig` and the
   recipe's :class:`~autoparallel.demo.TrainConfig`, from ``--config`` and the flags;
2. the process group (gloo on CPUs, NCCL on GPUs) and the device mesh
   (:meth:`Config.device_mesh`: ``prod(mesh)`` must be the world size);
3. the model with random weights from ``--seed`` (the same on every rank), parallelized in
   place by ``autoparallelize`` with ``inputs="local"``: every rank passes its own batch
   (``--batch`` is the global batch, ``batch / world`` sequences per rank); with pipeline
   stages (``--pipeline auto`` or a mesh axis named ``pp``) every rank passes the global
   batch instead, as a pipeline's first stage reads the inputs and its last the labels;
4. a synthetic dataset (random token sequences that count up, ``next = token + 1``: a
   pattern the model learns in a few steps), split among the ranks by a ``DistributedSampler``;
5. AdamW (built after the call: the parameters are the plan's DTensors), linear warm-up then
   cosine decay (``LambdaLR``), the gradients' global norm clipped (the model's
   ``clip_grad_norm_``: the norm of the whole gradients, over every pipeline stage);
6. the loop, ``loss = model.step(**batch)`` (forward and backward, over the microbatches of a
   pipeline), logging on rank 0; with ``--checkpoint-dir``, ``--save-at K`` saves the weights,
   the optimizer's and scheduler's states and the step with ``torch.distributed.checkpoint``
   (each rank writes its shards) and ``--resume`` continues from it: the same batches, the
   same losses as a run that never stopped.

The last line on rank 0 is ``losses: [...]`` (every step's loss, for tests and scripts).
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import autoparallel  # noqa: E402
from autoparallel.cli import TrainCmd, parse  # noqa: E402


FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
"""The optimizer's state and hyperparameters keyed by parameter name: under pipeline stages
each rank holds other parameters, and a state dict of parameter groups indexed by position
would mix them up (torchtitan checkpoints its pipelines flattened too)."""


def dataset(model_config, samples: int, seed: int) -> TensorDataset:
    """``samples`` sequences of ``seq`` tokens counting up from a random start (mod vocab)."""
    g = torch.Generator().manual_seed(seed + 1)
    starts = torch.randint(0, model_config.vocab, (samples, 1), generator=g)
    ids = (starts + torch.arange(model_config.seq)) % model_config.vocab
    return TensorDataset(ids)


def batches(loader: DataLoader, sampler: DistributedSampler, start_step: int):
    """This rank's batches from step ``start_step`` on: epoch ``e`` reshuffles with seed + e, so
    a resumed run draws what the uninterrupted run drew."""
    per_epoch = len(loader)
    epoch, skip = divmod(start_step, per_epoch)
    while True:
        sampler.set_epoch(epoch)
        for i, (ids,) in enumerate(loader):
            if i >= skip:
                yield {"input_ids": ids, "labels": ids.clone()}  # HF shifts the labels itself
        epoch, skip = epoch + 1, 0


def schedule(train):
    """Linear warm-up over ``warmup`` steps, then cosine decay to 10 % at the last step."""
    def factor(step: int) -> float:
        if step < train.warmup:
            return (step + 1) / train.warmup
        progress = (step - train.warmup) / max(1, train.steps - train.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


def main(argv=None) -> int:
    # 1. the configuration: --config FILE.toml, then the flags
    cmd = parse(sys.argv[1:] if argv is None else argv, commands={"train": TrainCmd}, prog="examples/train.py")
    # pipeline stages read the global batch on every rank (the first stage its inputs, the last its labels)
    staged = cmd.run.pipeline != "off" or "pp" in cmd.run.axis_names()
    config, model_config, train = cmd.run.replace(inputs="global" if staged else "local"), cmd.model_config, cmd.train

    # 2. processes and mesh
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    if model_config.batch % world:
        raise SystemExit(f"examples/train.py: error: --batch {model_config.batch} must be a multiple of the "
                         f"world size {world} (each rank takes batch / world sequences)")
    mesh = config.device_mesh()
    readers, reader = (1, 0) if staged else (world, rank)  # how many distinct batches a step reads, and which is ours
    local = model_config.batch // readers

    # 3. the model, parallelized in place; every rank passes its own batch
    model, _ = model_config.build("cpu", seed=train.seed)
    model.train()
    say(f"model: {model_config.model}, {model_config.layers} layers, hidden {model_config.hidden}, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters; mesh {config.mesh_text()} "
        f"{list(config.axis_names())}, {world} {backend} processes, {local} sequences per rank"
        + (" (the global batch: pipeline stages)" if staged else ""))
    meta_inputs = {k: torch.empty(local, model_config.seq, dtype=torch.long, device="meta")
                   for k in ("input_ids", "labels")}
    t0 = time.perf_counter()
    autoparallel.autoparallelize(model, meta_inputs, device_mesh=mesh, options=config.plan_options())
    say(model.plan)
    say(f"autoparallelize: {time.perf_counter() - t0:.1f} s")

    # 4. the data, split among the ranks
    data = dataset(model_config, train.samples, train.seed)
    sampler = DistributedSampler(data, num_replicas=readers, rank=reader, shuffle=True, seed=train.seed,
                                 drop_last=True)
    loader = DataLoader(data, batch_size=local, sampler=sampler, drop_last=True)
    if len(loader) == 0:
        raise SystemExit(f"examples/train.py: error: --samples {train.samples} is less than one global batch")

    # 5. optimizer, schedule; resume
    optimizer = torch.optim.AdamW(model.parameters(), lr=train.lr, weight_decay=train.weight_decay,
                                  foreach=config.optimizer_foreach)  # as planned
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule(train))
    start = 0
    if train.resume:
        model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=train.checkpoint_dir)
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=FLAT)
        start = int(state["step"])
        scheduler.last_epoch = start - 1
        scheduler.step()  # the learning rate of step `start`
        say(f"resumed from {train.checkpoint_dir} at step {start}")

    # 6. the loop
    losses = []
    device = "cuda" if backend == "nccl" else "cpu"
    t0 = time.perf_counter()
    for step, batch in zip(range(start, train.steps), batches(loader, sampler, start)):
        batch = {k: v.to(device) for k, v in batch.items()}
        loss = model.step(**batch)
        norm = model.clip_grad_norm_(train.clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % train.log_every == 0 or step + 1 == train.steps:
            say(f"step {step + 1:4d}  loss {losses[-1]:.4f}  grad norm {float(norm):.3f}  "
                f"lr {scheduler.get_last_lr()[0]:.3g}")
        if train.save_at is not None and step + 1 == train.save_at:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=FLAT)
            dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor(step + 1)},
                     checkpoint_id=train.checkpoint_dir)
            say(f"saved step {step + 1} to {train.checkpoint_dir}")
    dt = time.perf_counter() - t0
    say(f"{len(losses)} steps in {dt:.1f} s ({dt / max(1, len(losses)):.2f} s/step)")
    say(f"losses: {losses}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
