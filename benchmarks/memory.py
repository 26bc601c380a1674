"""Modelled peak memory of one training step next to the measured peak, per device.

For a GPT-2-class and a Llama-class model (Hugging Face architectures, random weights,
dropout 0, the loss computed inside: labels passed), on one device and on simulated (4,) and
(2, 2) meshes (every rank in this process, gloo-free fake process group), under three plans:
``dp`` (``parallelism="data"``: parameters replicated), ``fsdp`` (``parallelism="fsdp"``:
parameters sharded, all-gathered for use) and ``tp`` (:class:`TensorParallel` prices: the
planner splits every parameter it can and computes on the shards). Printed: the plan's
``estimate.memory`` next to the peak that
``torch.distributed._tools.mem_tracker.MemTracker`` records over one steady-state AdamW
step (optimizer states present, gradients set to None before the step). Under simulated
ranks the tracker sees every rank's tensors; their total is divided by the mesh size.

    python benchmarks/memory.py [--rows gpt2,llama] [--meshes 1,4,2x2] [--plans dp,fsdp,tp]
        [--no-checkpoint]

Target (issue 14): every row within 10 % of the measurement.

With ``--processes``, the rows at realistic sequence lengths in real processes instead (issue
27, part 4): one ``torchrun`` job per world size (gloo on CPU; ``vs_torch.py``'s machinery),
GPT-2 class and Llama class models (2 layers x 256 hidden, 4 heads, Llama 2 key-value heads
and MLP 688, vocabulary 8192, batch 4 x ``--seqs`` tokens) and a ViT (2 layers x 256 hidden,
4 heads, MLP 1024, 16 x 16 patches of a 512-row image as wide as ``--seqs`` patches need,
batch 4, 10 classes), on meshes (2,), (4,) and (2, 2), under the ``dp``, ``fsdp`` and ``tp``
plans above and ``ckpt`` (``checkpointing="full"``: every stage recomputed), the cost model
the ``cpu`` preset. Each rank passes the global batch and holds the module's outputs through
the step; measured: ``MemTracker`` over one steady-state step (``vs_torch.measure_peak_cpu``),
the largest rank.

    python benchmarks/memory.py --processes [--models gpt2,llama,vit] [--worlds 2,4]
        [--seqs 1024,2048] [--meshes 2,4,2x2] [--plans dp,fsdp,tp,ckpt] [--json out.json]

Then activation checkpointing on the GPT-2-class model, one device: the budget leaves
parameters, gradients and optimizer states whole and half of the activation memory the
plan without checkpointing peaks at. Printed: the regions chosen, the modelled and the
measured recompute overhead (target ≤ 20 % of the step), the measured peak against the
budget, and the same for checkpointing every stage (sub-block). Step times are the median of 5
steps on this CPU.
"""

import argparse
import copy
import math
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import autoparallel  # noqa: E402  (before transformers' model classes: see README, torchvision)
from autoparallel.codegen.emit import emit  # noqa: E402
import transformers as T  # noqa: E402
from torch.distributed._local_tensor import LocalTensorMode  # noqa: E402
from torch.distributed._tools.mem_tracker import MemTracker  # noqa: E402
from torch.distributed.tensor import Shard, init_device_mesh  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402



def gpt2():
    cfg = T.GPT2Config(n_layer=6, n_embd=384, n_head=6, vocab_size=8192, n_positions=256, resid_pdrop=0,
                       embd_pdrop=0, attn_pdrop=0, use_cache=False)
    ids = torch.randint(0, 8192, (8, 256))
    return T.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def llama():
    cfg = T.LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                        num_key_value_heads=2, vocab_size=8192, max_position_embeddings=256, use_cache=False)
    ids = torch.randint(0, 8192, (8, 256))
    return T.LlamaForCausalLM(cfg), {"input_ids": ids, "labels": ids}


ROWS = {"gpt2": gpt2, "llama": llama}


class TensorParallel(autoparallel.CostModel):
    """Gradient reduction at a second and every collective but all-reduce a thousand times its
    price: the planner splits every parameter it can and computes with it split (Megatron's
    column- and row-parallel layers) rather than gathering it."""

    def grad_reduction_time(self, axis, nbytes):
        return 1.0

    def collective_time(self, kind, axis, nbytes):
        return super().collective_time(kind, axis, nbytes) * (1 if kind == "all_reduce" else 1000)


PLANS = {"dp": ("data", autoparallel.CostModel), "fsdp": ("fsdp", autoparallel.CostModel),
         "tp": ("auto", TensorParallel)}


def _meta(batch):
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batch.items()}


def _measure(model, batch, ranks=None) -> int:
    """Peak bytes (summed over simulated ranks) of a steady-state AdamW step of ``model``."""
    opt = torch.optim.AdamW(model.parameters())

    def step():
        out = model(**batch)  # held through the backward, as a loop that reads out.logits holds it: the
        out.loss.backward()   # memory model counts the returned values live to the end of the step

    step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, opt, *batch.values())
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _mesh(mesh_shape):
    world = 1
    for s in mesh_shape:
        world *= s
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    return init_device_mesh("cpu", mesh_shape), frozenset(range(world))


def run(name, mesh_shape, plan_kind):
    torch.manual_seed(0)
    model, batch = ROWS[name]()
    mesh, ranks = _mesh(mesh_shape)
    parallelism, cost = PLANS[plan_kind]
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, _meta(batch), device_mesh=mesh, cost_model=cost("cpu"),
                                              parallelism=parallelism, cache_dir=False, memory_budget="unlimited")
        measured = _measure(pmodel, batch) / len(ranks)
    dist.destroy_process_group()
    return pmodel.plan, measured


def sharded_fraction(plan) -> float:
    """Fraction of the parameters' elements that some mesh axis splits."""
    split = total = 0
    for node in plan.nodes.values():
        if node.op == "get_attr" and node.out_shapes:
            n = math.prod(node.out_shapes[0])
            total += n
            split += n if any(isinstance(p, Shard) for p in node.output_specs[0]) else 0
    return split / max(total, 1)


def _step_seconds(module, batch, steps=5) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        module(**batch).loss.backward()
        times.append(time.perf_counter() - t0)
        for p in module.parameters():
            p.grad = None
    return statistics.median(times)


def checkpointing():
    """Checkpointing at half the activation memory, next to checkpointing every stage."""
    torch.manual_seed(0)
    model, batch = gpt2()
    cost = autoparallel.CostModel("cpu")
    free = autoparallel.plan(model, _meta(batch), mesh_shape=(1,), cost_model=cost, cache_dir=False)
    b = free.estimate.memory.breakdown
    acts = b.activations + b.temporaries
    budget = int(free.estimate.peak_memory_bytes - acts / 2)
    mib = 2 ** 20
    print(f"\ncheckpointing, gpt2 on one device: no-checkpoint peak {free.estimate.peak_memory_bytes / mib:.1f} MiB "
          f"(activations and temporaries {acts / mib:.1f} MiB), budget {budget / mib:.1f} MiB")
    traced = autoparallel.tracer.ColoTracer().trace(model, _meta(batch))
    mesh, ranks = _mesh((1,))
    with LocalTensorMode(ranks):
        plain = autoparallel.autoparallelize(copy.deepcopy(model), _meta(batch), device_mesh=mesh, cost_model=cost,
                                             cache_dir=False)
        ck = autoparallel.autoparallelize(copy.deepcopy(model), _meta(batch), device_mesh=mesh, cost_model=cost,
                                          cache_dir=False, memory_budget=budget)
        every_plan = copy.deepcopy(ck.plan)
        every_plan.checkpoint.regions = every_plan.checkpoint.every_stage.regions
        every = emit(copy.deepcopy(model), traced, every_plan, mesh)
        base = _step_seconds(plain, batch)
        rows = [("Rotor schedule", ck, ck.plan.checkpoint.recompute_s),
                ("every stage", every, ck.plan.checkpoint.every_stage.recompute_s)]
        step_model = free.estimate.step_time_s
        print(f"  regions chosen: {[(r.start, r.stop) for r in ck.plan.checkpoint.regions]}")
        for label, module, recompute in rows:
            t = _step_seconds(module, batch)
            peak = _measure(module, batch)
            print(f"  {label}: modelled recompute {100 * recompute / step_model:.1f}% of the step | measured step "
                  f"{1e3 * t:.0f} ms vs {1e3 * base:.0f} ms without checkpointing ({100 * (t / base - 1):+.1f}%) | "
                  f"measured peak {peak / mib:.1f} MiB ({'under' if peak <= budget else 'OVER'} the budget)")
    dist.destroy_process_group()


# --------------------------------------------------------------------------- real processes

SEQS = "1024,2048"
PROCESS_PLANS = "dp,fsdp,tp,ckpt"


def process_model(name: str, seq: int):
    """The ``--processes`` row's model (seeded alike on every rank) and its global batch."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vs_torch as V

    if name == "vit":
        cfg = T.ViTConfig(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024,
                          image_size=(512, 16 * seq // 32), patch_size=16, num_labels=10, hidden_dropout_prob=0,
                          attention_probs_dropout_prob=0)
        torch.manual_seed(V.SEED)
        g = torch.Generator().manual_seed(V.SEED + 1)
        batch = {"pixel_values": torch.randn(4, 3, *cfg.image_size, generator=g),
                 "labels": torch.randint(0, 10, (4,), generator=g)}
        return T.ViTForImageClassification(cfg).train(), batch
    sizes = dict(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=688, vocab=8192, batch=4, seq=seq)
    model, s = V.build_model(name, False, sizes)
    return model, V.global_batch(s, torch.device("cpu"))


def process_variants(args, name, seq, meshes, rows):
    """The autoparallel modules of one model and sequence length on ``meshes`` (label → device
    mesh), one per plan (a generator, as ``vs_torch.build_and_measure`` takes it); each measured
    variant's estimate goes to ``rows`` and its module is dropped before the next is built."""
    import vs_torch as V

    model, batch = process_model(name, seq)
    for label, mesh in meshes.items():
        for kind in args.plans.split(","):
            parallelism, cost = PLANS.get(kind, ("auto", autoparallel.CostModel))
            options = dict(checkpointing="full") if kind == "ckpt" else dict(memory_budget="unlimited")
            v = V.autoparallel_variant(args, kind, model, batch, mesh, label, parallelism=parallelism,
                                       cost_model=cost("cpu"), **options)
            v.hold_outputs = True
            yield v
            row = dict(model=name, seq=seq, mesh=v.mesh, plan=kind, measured=v.peak_bytes, error=v.error or v.na)
            if v.module is not None:
                est = v.module.plan.estimate.memory  # the breakdown is without recomputation
                row.update(modelled=v.module.plan.estimate.peak_memory_bytes, breakdown=dict(est.breakdown.items()), phase=est.phase,
                           split=sharded_fraction(v.module.plan))
            rows.append(row)
            v.module = v.optimizer = None


def run_processes(args, name, dev, rank, world) -> dict:
    """One model's rows on this world size (a ``vs_torch.run_worker`` job): peaks gathered over
    the ranks (the largest)."""
    import vs_torch as V

    shapes = [(2,)] if world == 2 else [(4,), (2, 2)]
    meshes = {label: init_device_mesh("cpu", shape) for shape in shapes
              if (label := "x".join(map(str, shape))) in args.meshes.split(",")}
    rows = []
    for seq in (int(x) for x in args.seqs.split(",")):
        V.build_and_measure(process_variants(args, name, seq, meshes, rows), args, dev)
    peaks = V.max_over_ranks([r["measured"] or 0 for r in rows], dev)
    for r, p in zip(rows, peaks):
        r["measured"] = int(p) or None
    return dict(model=name, world=world, warmup=args.warmup, threads=torch.get_num_threads(), rows=rows)


def process_table(results: list[dict]) -> str:
    """Modelled next to measured per device, one row per model, sequence, mesh and plan."""
    mib = 2 ** 20
    lines = [f"{'model':6} {'seq':>5} {'mesh':5} {'plan':5} {'split':>6} {'modelled':>9} {'measured':>9} {'error':>7}"
             "  breakdown at the modelled peak (MiB)"]
    for job in results:
        for r in job["rows"]:
            head = f"{r['model']:6} {r['seq']:5} {r['mesh']:5} {r['plan']:5}"
            if r.get("modelled") is None or not r["measured"]:
                lines.append(f"{head} n/a: {r['error']}")
                continue
            err = r["modelled"] / r["measured"] - 1
            parts = ", ".join(f"{k} {v / mib:.1f}" for k, v in r["breakdown"].items() if v)
            lines.append(f"{head} {r['split']:6.0%} {r['modelled'] / mib:5.1f} MiB {r['measured'] / mib:5.1f} MiB "
                         f"{100 * err:+6.1f}%  {'OK ' if abs(err) <= 0.1 else 'MISSED'} ({parts}; {r['phase']})")
    return "\n".join(lines)


def process_main(argv) -> int:
    """``--processes``: :func:`vs_torch.run_script` with this script's jobs and table."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import vs_torch as V

    ap = V.arg_parser(__doc__.splitlines()[0], models="gpt2,llama,vit", worlds="2,4")
    ap.add_argument("--processes", action="store_true")
    ap.add_argument("--seqs", default=SEQS, help="sequence lengths (tokens; a ViT's patches)")
    ap.add_argument("--meshes", default="2,4,2x2", help="meshes of the world sizes: 2 | 4, 2x2")
    ap.add_argument("--plans", default=PROCESS_PLANS, help="comma-separated: dp, fsdp, tp, ckpt")
    args = ap.parse_args(argv)
    args.warmup = args.warmup or 2
    args.rounds = args.steps = 0

    def passthrough(a):
        return V.worker_argv(a) + ["--processes", "--seqs", a.seqs, "--meshes", a.meshes, "--plans", a.plans]

    return V.run_script(args, run_processes, process_table, passthrough, __file__)


def main():
    if "--processes" in sys.argv:
        sys.exit(process_main(sys.argv[1:]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="gpt2,llama")
    ap.add_argument("--meshes", default="1,4,2x2")
    ap.add_argument("--plans", default="dp,fsdp,tp")
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the checkpointing rows")
    args = ap.parse_args()
    T.logging.set_verbosity_error()
    mib = 2 ** 20
    print(f"{'model':6} {'mesh':5} {'plan':5} {'split':>6} {'estimated':>10} {'measured':>9} {'error':>7}  breakdown at the "
          "modelled peak (MiB)")
    for name in args.rows.split(","):
        for m in args.meshes.split(","):
            shape = tuple(int(x) for x in m.split("x"))
            for kind in args.plans.split(",") if math.prod(shape) > 1 else ["dp"]:
                plan, measured = run(name, shape, kind)
                est = plan.estimate.memory
                err = est.peak_bytes / measured - 1
                parts = ", ".join(f"{k} {v / mib:.1f}" for k, v in est.breakdown.items() if v)
                print(f"{name:6} {m:5} {kind:5} {sharded_fraction(plan):6.0%} {est.peak_bytes / mib:8.1f} MiB "
                      f"{measured / mib:6.1f} MiB {100 * err:+6.1f}%  {'OK ' if abs(err) <= 0.1 else 'MISSED'} "
                      f"({parts}; {est.phase})")
    if not args.no_checkpoint:
        checkpointing()


if __name__ == "__main__":
    main()
