"""Train a small GPT-2 on 4 CPU processes with one line of autoparallel.

Run:

    HF_HUB_OFFLINE=1 torchrun --standalone --nproc-per-node 4 examples/train_gpt2.py

What it does, on a 2 x 2 mesh ("dp", "tp") of gloo processes:

* builds the Hugging Face GPT-2 architecture from a config (4 layers, n_embd 256,
  4 heads, byte-level vocabulary of 256, context 128, no dropout) with a fixed seed, so
  every rank starts from the same random weights (nothing is downloaded);
* trains it on real text, tokenized as raw bytes (0..255). The text is the source code
  of a few modules of the Python standard library (``textwrap.py``, ``argparse.py``,
  ...), read at run time from the interpreter's own installation: it is available
  offline on every machine that runs Python, it is under the PSF license, and so no
  data file needs to be shipped with the example;
* draws global batches of 8 x 64 tokens with a seeded generator, so every rank draws
  the same batches (the parallel module takes the global batch on every rank);
* measures the mesh's costs (``autoparallel.profile_mesh``, cached after the first run),
  plans and applies the parallelization with
  ``autoparallel.autoparallelize(model, meta_inputs, device_mesh=mesh, cost_model=..., baselines=True)``,
  and prints the plan's summary once (``print(model.plan)``), with the plan's step beside
  DDP's and the hand-written recipes' (FSDP, Megatron TP, FSDP + TP), each priced by the same
  cost model (``model.plan.table()`` lists every module, ``autoparallel.compare`` prices
  every recipe in full);
* trains 20 steps with AdamW (gradients clipped to norm 1), printing the loss of every fifth
  step, and checks that the loss of step 0 equals the loss of the single-device model on the
  same batch (exits with a non-zero status if it does not).

Only rank 0 prints.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()  # the wall time printed after training counts from here

import copy  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import autoparallel  # noqa: E402  (first: makes the installed torchvision importable, see README)
from autoparallel import units  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

SEED = 0
BATCH, SEQ = 8, 64          # global batch: 8 sequences of 64 byte tokens
STEPS = 20
LR = 1e-3
MESH_SHAPE = (2, 2)
STDLIB_FILES = ("textwrap.py", "argparse.py", "string.py", "fractions.py", "heapq.py", "bisect.py")


def load_tokens() -> torch.Tensor:
    """Byte-level tokens of a few standard-library source files (PSF license, read offline)."""
    root = os.path.dirname(os.__file__)
    data = b""
    for name in STDLIB_FILES:
        path = os.path.join(root, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                data += f.read() + b"\n\n"
    if len(data) < 10 * SEQ:
        raise RuntimeError(f"found too little text under {root} to train on")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)


def batches(tokens: torch.Tensor, steps: int):
    """Deterministic batches: the same seeded generator on every rank gives the same draws."""
    g = torch.Generator().manual_seed(SEED + 1)
    for _ in range(steps):
        starts = torch.randint(0, tokens.numel() - SEQ, (BATCH,), generator=g)
        input_ids = torch.stack([tokens[s:s + SEQ] for s in starts.tolist()])
        yield {"input_ids": input_ids, "labels": input_ids.clone()}  # HF shifts the labels itself


def build_config() -> GPT2Config:
    return GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=256, n_positions=128,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                      use_cache=False, bos_token_id=0, eos_token_id=0)


def main() -> int:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("dp", "tp"))

    def say(*args):
        if rank == 0:
            print(*args, flush=True)

    config = build_config()
    torch.manual_seed(SEED)
    model = GPT2LMHeadModel(config)   # same seed -> same weights on every rank
    model.train()

    tokens = load_tokens()
    data = list(batches(tokens, STEPS))
    say(f"text: {tokens.numel():,} byte tokens from the stdlib sources {', '.join(STDLIB_FILES)}")
    say(f"model: GPT-2, {config.n_layer} layers, n_embd {config.n_embd}, {config.n_head} heads, "
        f"{sum(p.numel() for p in model.parameters()):,} parameters; world {dist.get_world_size()}, "
        f"mesh {MESH_SHAPE} (dp, tp)")

    # The single-device reference for the parity check, before any training.
    ref_loss = None
    if rank == 0:
        ref = copy.deepcopy(model)
        ref_loss = ref(**data[0]).loss.detach()
        del ref

    meta_inputs = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in data[0].items()}

    cost_model = autoparallel.CostModel.from_profile(autoparallel.profile_mesh(mesh))  # every rank measures
    mesh_spec = cost_model.profile.mesh_spec(("dp", "tp"))

    t0 = time.perf_counter()
    # baselines=True: DDP and the hand-written recipes priced on the same capture, for the summary
    autoparallel.autoparallelize(model, meta_inputs, device_mesh=mesh, cost_model=cost_model, mesh_spec=mesh_spec,
                                 baselines=True)
    t_plan = time.perf_counter() - t0  # the model is now parallel, in place: same class, same methods
    say(model.plan)
    say(f"autoparallelize took {units.seconds(t_plan)}")

    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # built after the call
    losses = []
    t0 = time.perf_counter()
    for step, batch in enumerate(data):
        out = model(**batch)
        loss = out.loss
        loss.backward()
        # DTensor gradients work with the usual utilities: the norm is over the full gradients
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 5 == 0 or step == STEPS - 1:
            say(f"step {step:2d}  loss {losses[-1]:.4f}")
    t_train = time.perf_counter() - t0
    say(f"training: {STEPS} steps in {units.seconds(t_train)} ({units.seconds(t_train / STEPS)} per step); "
        f"wall time {units.seconds(time.perf_counter() - T_START)}")

    ok = True
    if rank == 0:
        got = torch.tensor(losses[0])
        ok = torch.allclose(got, ref_loss.to(got.dtype), rtol=1e-4, atol=1e-5)
        verdict = "OK" if ok else "FAILED"
        print(f"step 0 loss {losses[0]:.6f} == single-device loss {ref_loss.item():.6f}: {verdict}", flush=True)
    flag = torch.tensor([0 if ok else 1])
    dist.broadcast(flag, src=0)

    dist.destroy_process_group()
    return int(flag.item())


if __name__ == "__main__":
    sys.exit(main())
