"""Time to a ready module: where ``autoparallelize`` spends its time, cold and warm.

The demo's model (``examples/train_gpt2.py``: GPT-2, 4 layers, n_embd 256, 4 heads, vocabulary
256, global batch 8 × 64) on a 2 × 2 mesh of gloo processes, parallelized by the one line with
its defaults (the mesh profiled by every rank on first use, the plan cached)::

    torchrun --standalone --nproc-per-node 4 benchmarks/start_time.py [--runs 2]

Each run parallelizes a fresh copy of the model with one cache folder; the first run starts
from an empty folder (cold: mesh profile, device calibration and plan measured and solved),
the later ones find them cached (warm). Every run prints, on rank 0, the seconds of each stage
of the call (the slowest rank's, all-reduced with MAX):

* ``profile``: ``profile_mesh`` (collective sweep and device calibration, or the cache read);
* ``capture``: ``tracer.capture`` (torch.export and the annotated graph);
* ``plan``: ``plan_on_rank0`` (strategies, ILP, memory search; or the cache read) and its
  broadcast;
* ``emit``: lowering and the module's code generation;
* ``ready``: the whole ``autoparallelize`` call (targets: ≤ 10 s cold, ≤ 3 s warm);
* ``step 0``: the first forward and backward; ``step 1``: the second (steady state);
* ``eval``: the first call after ``model.eval()`` (a mode switch: capture and plan again,
  target ≤ 3 s); ``new call``: the first training call without ``labels`` (a new signature,
  target ≤ 3 s).

Stage times are measured by wrapping the functions :mod:`autoparallel.api` calls, so the
call itself is the library's, unchanged.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import tempfile
import time
from collections import defaultdict

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from tabulate import tabulate  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import autoparallel  # noqa: E402
from autoparallel import api  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

BATCH, SEQ, MESH = 8, 64, (2, 2)
STAGES = {"profile": "profile_mesh", "capture": "capture", "plan": "plan_on_rank0", "emit": "emit"}


def timed_stages(seconds: dict) -> None:
    """Wrap the functions api.autoparallelize calls so each adds its seconds to ``seconds``."""
    for stage, name in STAGES.items():
        fn = getattr(api, name)

        @functools.wraps(fn)
        def wrapper(*args, _fn=fn, _stage=stage, **kwargs):
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                seconds[_stage] += time.perf_counter() - t0

        setattr(api, name, wrapper)


def clock(seconds: dict, stage: str, fn):
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    seconds[stage] += time.perf_counter() - t0
    return out


def one_run(base, mesh, cache_dir, seconds) -> None:
    model = copy.deepcopy(base).train()
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "labels": ids}
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batch.items()}
    clock(seconds, "ready", lambda: autoparallel.autoparallelize(model, meta, device_mesh=mesh, cache_dir=cache_dir))
    for step in range(2):
        clock(seconds, f"step {step}", lambda: model(**batch).loss.backward())
    model.eval()
    with torch.no_grad():
        clock(seconds, "eval", lambda: model(**batch))
    model.train()
    clock(seconds, "new call", lambda: model(input_ids=ids).logits.sum().backward())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=2, help="runs on one cache folder: the first cold, then warm")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", MESH, mesh_dim_names=("dp", "tp"))
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=256, n_positions=128, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    base = GPT2LMHeadModel(cfg)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = [tmp]
        dist.broadcast_object_list(folder, src=0)  # one cache folder (rank 0's) for every rank
        seconds = defaultdict(float)
        timed_stages(seconds)
        for run in range(args.runs):
            seconds.clear()
            one_run(base, mesh, folder[0], seconds)
            names = sorted(seconds)
            worst = torch.tensor([seconds[k] for k in names], dtype=torch.float64)
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the slowest rank's
            rows.append(("cold" if run == 0 else f"warm {run}", dict(zip(names, worst.tolist()))))
        dist.barrier()
    if dist.get_rank() == 0:
        cols = list(STAGES) + ["ready", "step 0", "step 1", "eval", "new call"]
        print(tabulate([[name] + [f"{worst.get(c, 0.0):.2f}" for c in cols] for name, worst in rows],
                       headers=["run (s)"] + cols))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
