"""Step time and peak memory under a memory budget: autoparallel next to PyTorch's memory-saving recipes.

Model (issue 27's reference): GPT-2 class (Hugging Face ``GPT2LMHeadModel`` from a config, random
weights, dropout 0), 4 layers x 512 hidden, 8 heads, vocabulary 8192, global batch 8 x 128 tokens,
AdamW (``--optimizer``: foreach by default, as in :mod:`vs_torch`); on 2 and 4 processes
(``torchrun``, gloo on CPU, NCCL on GPUs), mesh (world,).

In each job DDP is built and measured first; its measured peak per device (largest rank) sets the
budgets, ``--fractions`` (default 0.4, 0.6, 0.8) times it. Then every recipe, each rank its share
of the global batch:

* ``DDP``: ``DistributedDataParallel``;
* ``DDP+ZeRO-1``: DDP with ``torch.distributed.optim.ZeroRedundancyOptimizer`` (AdamW states split
  over the ranks);
* ``FSDP2``: ``fully_shard`` on every transformer block, then the root;
* ``FSDP2 no-reshard``: the same with ``reshard_after_forward=False`` (the gathered parameters
  kept from the forward to the backward);
* ``FSDP2+AC``: every block wrapped in ``checkpoint_wrapper`` (its activations recomputed in the
  backward, ``torch.utils.checkpoint``), then ``fully_shard`` as FSDP2;
* ``FSDP2+offload``: FSDP2 with ``offload_policy=CPUOffloadPolicy()``: sharded parameters,
  gradients and optimizer states on the host, the optimizer step there;

and one ``autoparallelize(model, meta_inputs, device_mesh=mesh, memory_budget=budget)`` per budget,
every rank passing the global batch. The recipes do not depend on the budget: each is measured
once and judged against every budget. Variants are built, warmed up and measured one after the
other, then timed in interleaved rounds, as ``vs_torch.py`` does (its machinery: step time is the
median over rounds of the slowest rank's mean step; peak memory the largest rank's, on CPU
``MemTracker`` over one steady-state step, on CUDA ``torch.cuda.max_memory_allocated``).

Per budget and recipe the table prints the step, the measured peak on the device, the peak of
what it holds in host memory (``FSDP2+offload``, and ``autoparallelize`` when its plan offloads
parameters: their shards, gradients and optimizer states; on CPU, where host and device are one
memory, ``MemTracker`` counts these tensors apart, moving each gradient to the host's account as
it is accumulated: ``vs_torch.measure_peak_cpu``), whether the device peak fits the budget,
and for autoparallel its modelled peak (``plan.estimate.peak_memory_bytes``), its step over the
fastest recipe that fits ("none fits" when none does) and modelled over measured peak.

    python benchmarks/memory_bound.py                       # worlds 2 and 4: one table per world
    python benchmarks/memory_bound.py --quick               # tiny sizes, few steps (a smoke run)
    python benchmarks/memory_bound.py --worlds 2 --rounds 2 --json out.json

Targets (printed, not asserted; issue 27): autoparallel's measured peak within its budget; its
step <= 1.0x the fastest recipe that fits; its modelled peak within +-10 % of the measured one.
"""

from __future__ import annotations

import copy
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vs_torch as V  # noqa: E402  (sets the environment and imports autoparallel before transformers)

import torch  # noqa: E402

FRACTIONS = "0.4,0.6,0.8"
AUTO = "autoparallel"
MIB = 2 ** 20


def model_sizes(quick: bool) -> dict:
    """Issue 27's reference GPT-2 class model, or vs_torch's tiny one for ``--quick``."""
    if quick:
        return V.model_sizes("gpt2", True)
    return dict(layers=4, hidden=512, heads=8, vocab=8192, batch=8, seq=128)


def build_variants(args, model, batch, dev, rank, world, job):
    """DDP, then (once its peak, gathered over the ranks, has set ``job``'s budgets) the other
    recipes and autoparallel at each budget; a generator, as :func:`vs_torch.build_and_measure`
    takes it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.optim import ZeroRedundancyOptimizer

    mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp",))
    label = f"({world},)"
    local = V.rows_of(batch, rank, world)

    def recipe(name, module, **kw):
        return V.Variant(name, label, [label], module, local, mean_loss=True, **kw)

    ddp = recipe("DDP", V.ddp_module(model, dev))
    yield ddp
    job["ddp_peak_bytes"] = int(V.max_over_ranks([ddp.peak_bytes or 0], dev)[0])
    if not job["ddp_peak_bytes"]:
        raise RuntimeError(f"DDP's peak was not measured ({ddp.error}): no budget to plan for")
    job["budgets"] = {f: int(float(f) * job["ddp_peak_bytes"]) for f in args.fractions.split(",")}
    del ddp

    yield recipe("DDP+ZeRO-1", V.ddp_module(model, dev), optimizer=lambda params, foreach: ZeroRedundancyOptimizer(
        params, optimizer_class=torch.optim.AdamW, lr=V.LR, foreach=foreach))
    yield recipe("FSDP2", V.fsdp_module(model, dev, mesh))
    yield recipe("FSDP2 no-reshard", V.fsdp_module(model, dev, mesh, reshard_after_forward=False))
    yield recipe("FSDP2+AC", V.fsdp_module(model, dev, mesh, checkpoint=True))
    offload = recipe("FSDP2+offload", V.fsdp_module(model, dev, mesh, offload_policy=CPUOffloadPolicy(
        pin_memory=dev.type == "cuda")))
    offload.host_params = list(offload.module.parameters())
    yield offload
    del offload

    for fraction, budget in job["budgets"].items():
        v = V.autoparallel_variant(args, f"{AUTO} {fraction}", model, batch, mesh, label, memory_budget=budget)
        if v.module is not None:
            plan = v.module.plan
            v.est_parts["recompute_s"] = plan.estimate.recompute_s
            v.est_parts["memory_budget_bytes"] = plan.estimate.memory_budget_bytes
            v.est_parts["checkpoint_regions"] = len(plan.checkpoint.regions) if plan.checkpoint else 0
            v.est_parts["memory"] = plan.estimate.memory.to_json() if plan.estimate.memory else None
            v.host_params = [p for n, p in v.module.named_parameters() if n in set(plan.offloaded)]
        yield v


def run_model(args, model_name, dev, rank, world) -> dict:
    """One job: build and measure every variant, time them in interleaved rounds; the result."""
    model, s = V.build_model(model_name, args.quick, model_sizes(args.quick))
    batch = V.global_batch(s, dev)
    with torch.no_grad():
        ref_loss = float(copy.deepcopy(model).to(dev)(**batch).loss.item())
    job = dict(V.job_record(args, model_name, s, dev, world), ref_loss=ref_loss)
    variants = V.build_and_measure(build_variants(args, model, batch, dev, rank, world, job), args, dev)
    V.time_rounds(variants, args, dev, world)
    job["variants"] = [V.variant_record(v) for v in variants]
    return job


# --------------------------------------------------------------------------- the table

def _mib(x):
    return "" if x is None else f"{x / MIB:.1f}"


def table(results: list[dict]) -> str:
    """A block of rows per job and budget: every recipe, then autoparallel; the targets under it."""
    from tabulate import tabulate

    hdr = ["world", "budget MiB", "variant", "s/step", "device MiB", "host MiB", "fits", "modelled MiB",
           "model/meas", "vs fastest fitting", "loss0"]
    rows, checks, notes = [], [], []
    for job in results:
        recipes = [v for v in job["variants"] if not v["name"].startswith(AUTO)]
        for fraction, budget in job.get("budgets", {}).items():
            autos = [v for v in job["variants"] if v["name"] == f"{AUTO} {fraction}"]
            fitting = [v for v in recipes if v["step_s"] and v["peak_bytes"] is not None and v["peak_bytes"] <= budget]
            fastest = min(fitting, key=lambda v: v["step_s"]) if fitting else None
            where = f"world {job['world']}, budget {fraction} x DDP = {budget / MIB:.1f} MiB"
            for i, v in enumerate(recipes + autos):
                cells = [str(job["world"]), f"{fraction} x = {budget / MIB:.1f}"] if i == 0 else ["", ""]
                cells.append(v["name"])
                if v["na"] or v["step_s"] is None:
                    failed = (v["na"] or "").startswith("failed:")
                    rows.append(cells + ["n/a"] + [""] * 5 + [v["na"].split(":")[1].strip() if failed else "see notes",
                                                              ""])
                    notes.append(f"{where}: {v['name']}: {v['na'] or v['error']}")
                    continue
                dev_b, model_b = v["peak_bytes"], (v["estimate_parts"] or {}).get("peak_memory_bytes")
                fits = dev_b is not None and dev_b <= budget
                auto = v["name"].startswith(AUTO)
                ratio = ((f"{v['step_s'] / fastest['step_s']:.2f}x {fastest['name']}" if fastest else "none fits")
                         if auto else "")
                ok_loss = abs(v["loss0"] - job["ref_loss"]) <= 1e-4 * abs(job["ref_loss"]) + 1e-5
                rows.append(cells + [V.fmt_s(v["step_s"]), _mib(dev_b), _mib(v["host_peak_bytes"]),
                                     "yes" if fits else "NO", _mib(model_b),
                                     f"{model_b / dev_b:.2f}" if model_b and dev_b else "",
                                     ratio, f"{v['loss0']:.4f}" + ("" if ok_loss else " (!)")])
                if not ok_loss:
                    notes.append(f"{where}: {v['name']}: step-0 loss {v['loss0']:.6f} differs from the model's "
                                 f"{job['ref_loss']:.6f}")
                if v["error"]:
                    notes.append(f"{where}: {v['name']}: {v['error']}")
                if not auto:
                    continue
                checks.append(f"{where}: {AUTO} measured device peak {_mib(dev_b)} MiB "
                              f"({'OK' if fits else 'MISSED'}: target within the budget)")
                if fastest:
                    r = v["step_s"] / fastest["step_s"]
                    checks.append(f"{where}: {AUTO} step / fastest fitting ({fastest['name']}) = {r:.2f}x "
                                  f"({'OK' if r <= 1.0 else 'MISSED'}: target <= 1.0x)")
                else:
                    checks.append(f"{where}: no recipe fits; {AUTO} {'fits' if fits else 'does not fit either'}")
                if model_b and dev_b:
                    err = model_b / dev_b - 1
                    checks.append(f"{where}: {AUTO} modelled / measured peak {100 * err:+.0f}% "
                                  f"({'OK' if abs(err) <= 0.10 else 'MISSED'}: target within 10%)")
    r0 = results[0] if results else {}
    s = r0.get("sizes", {})
    head = "\n".join([
        f"model: gpt2 {s.get('layers')} x {s.get('hidden')}, vocabulary {s.get('vocab')}, global batch "
        f"{s.get('batch')} x {s.get('seq')}, AdamW ({r0.get('optimizer')}); device: {', '.join(sorted({str(r.get('device')) for r in results}))}"
        f"; backend {', '.join(sorted({str(r.get('backend')) for r in results}))}; cost model {r0.get('cost_model')}",
        "budget: the fraction of DDP's measured peak per device (" + "; ".join(
            f"world {r['world']}: {_mib(r.get('ddp_peak_bytes'))} MiB" for r in results) + ")",
        f"s/step: median over {r0.get('rounds')} interleaved rounds of the slowest rank's mean over {r0.get('steps')} "
        f"steps, after {r0.get('warmup')} warm-up steps; the recipes are measured once and repeated under each budget",
        f"device MiB: peak per device, largest rank, {r0.get('memory')}; host MiB: the peak of what an offloading "
        "variant holds in host memory (FSDP2+offload; autoparallel where plan.offloaded names parameters: their "
        "shards, gradients, optimizer states), counted apart on CPU, where host and device are one memory and the "
        "step pays no host-device copies; fits: device MiB <= budget; modelled: plan.estimate.peak_memory_bytes; "
        "vs fastest fitting: autoparallel's s/step over the fastest recipe that fits"])
    parts = [head, tabulate(rows, hdr, tablefmt="simple", disable_numparse=True)]
    if checks:
        parts.append("targets:\n" + "\n".join("  " + c for c in checks))
    if notes:
        parts.append("notes:\n" + "\n".join("  " + n for n in dict.fromkeys(notes)))
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- driver

def parse_args(argv=None):
    ap = V.arg_parser(__doc__.splitlines()[0], models="gpt2", worlds="2,4")
    ap.add_argument("--fractions", default=FRACTIONS, help="budgets as fractions of DDP's measured peak")
    args = V.finish_args(ap.parse_args(argv))
    if args.models != "gpt2":
        ap.error("--models: the memory-bound rows are for gpt2 only (issue 27's reference model)")
    if "1" in args.worlds.split(","):
        ap.error("--worlds: 2 or more processes (DDP sets the budgets)")
    return args


def worker_argv(args) -> list[str]:
    return V.worker_argv(args) + ["--fractions", args.fractions]


def main(argv=None) -> int:
    return V.run_script(parse_args(argv), run_model, table, worker_argv, __file__)


if __name__ == "__main__":
    sys.exit(main())
