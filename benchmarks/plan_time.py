"""Time to plan real model shapes on the meta device, whole pipeline, split by stage.

Rows (targets on a 2-core machine):

* GPT-2 small: 12 layers, batch 8 × 1024, 2×4 mesh — < 10 s
* GPT-2 XL: 48 layers, batch 8 × 1024, 2×4 mesh — < 30 s and ≤ 2× the 12-layer time
* Llama-3-8B dims: 32 layers, GQA 32/8 heads, vocab 128256, batch 64 × 2048, 8×8 mesh — < 30 s
* Llama-3-70B dims: 80 layers, hidden 8192, GQA 64/8 heads, intermediate 28672, vocab 128256,
  batch 128 × 2048, 16×8 mesh — < 60 s
* Llama-3-8B dims on a (4, 4, 4) mesh, batch 64 × 2048 — < 30 s
* Mixtral-8x7B dims: 32 layers, hidden 4096, intermediate 14336, GQA 32/8 heads, 8 experts top-2,
  vocab 32000, batch 64 × 4096, 8×8 mesh — < 60 s
* DeepSeek-V3 dims: 61 layers (the first 3 dense), hidden 7168, MLA, 256 routed experts + 1
  shared, top-8, vocab 129280, batch 512 × 4096, 64×8 mesh — < 120 s
* The two mixture-of-experts rows also print the plan's exposed communication as a share of its
  step and the hand-written FSDP + EP recipe (:mod:`autoparallel.recipes`: torchtitan's layout)
  planned with the same options and cost model: its step, its peak, and the step ratio (target
  ≤ 1.0×); the recipe's seconds are not counted in the plan time
* Pipeline stages (issue 28), batch 128 × 8192 (one sequence per data-parallel rank) on 16 nodes of
  8 H100s (a 16×8 mesh whose first axis crosses nodes at 400 Gb/s per GPU, the second NVLink):
  ``llama3-70b-pp`` (Llama-3-70B) and ``llama3-405b-pp`` (126 layers × 16384, 128/8 heads, MLP
  53248) with the cross-node axis named ``"pp"`` — < 60 s each; ``-pp-auto`` the same on unnamed
  axes under ``pipeline="auto"`` (stages over either axis, or none) — < 120 s. Each prints the
  hand-written PP × FSDP × TP recipe beside the plan (``compare()``: torchtitan's even split,
  1F1B, the plan's microbatches, per-layer activation checkpointing when it does not fit
  otherwise), the step ratio (target ≤ 1.0×) and whether both fit 80 GiB; the recipe's seconds
  are not counted in the plan time.

The Llama, Mixtral and DeepSeek rows plan as a user of H100s would: the h100 preset, a bf16 mixed-precision policy
(``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``: fp32 master weights and
optimizer states), ``device="cuda"`` (the optimizer step priced as CUDA's foreach AdamW) and the
default memory budget (80 GiB less the 10 % reserve; ``llama3-70b-fp32``: the same without the policy,
fp32 throughout, target < 45 s); each prints the
modelled peak and its breakdown, the fraction of parameter elements split along each mesh axis,
and the peak RSS of this process (``resource.getrusage``; target < 4 GiB).

    python benchmarks/plan_time.py [--rows gpt2-small,gpt2-xl,llama3-8b,llama3-70b,llama3-70b-fp32,llama3-8b-3d,mixtral-8x7b,
                                           deepseek-v3,llama3-70b-pp,llama3-405b-pp,llama3-70b-pp-auto,
                                           llama3-405b-pp-auto]
        [--solver cbc|highs] [--budget 40GiB]   # another solver (default: the planner's, cbc), another budget for the LLM rows
        [--no-share]   # also plan without repeated-block sharing (ILP size before/after)
        [--no-stamp]   # capture every layer instead of tracing four and stamping the rest
        [--baselines]   # also price the recipe baselines (plan() leaves them out by default)

Each row prints the seconds of every part of the pipeline: trace, strategies, memory model,
costs (pricing and building the problem), ILP (every stage-1 solve), remat (stage 2), inspect
(alternatives and timeline), baselines (the recipes, with ``--baselines``) and the rest.

Nothing is allocated: models are built on the meta device. The plan cache is off.
"""

import argparse
import math
import os
import resource
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import transformers as T  # noqa: E402

import autoparallel  # noqa: E402
from autoparallel.recipes import recipes  # noqa: E402
from autoparallel.solver.ilp import SOLVERS  # noqa: E402
from autoparallel.summary import step_parts  # noqa: E402
from autoparallel.tracer import capture  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402
from torch.distributed.tensor import Shard  # noqa: E402


def gpt2(layers, embd, heads):
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=layers, n_embd=embd, n_head=heads, use_cache=False))


def llama3(layers=32, hidden=4096, heads=32, intermediate=14336):
    return T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        use_cache=False))


def llama3_8b():
    return llama3()


def llama3_70b():
    return llama3(layers=80, hidden=8192, heads=64, intermediate=28672)


def mixtral_8x7b():
    return T.MixtralForCausalLM(T.MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, use_cache=False))


def llama3_405b():
    return llama3(layers=126, hidden=16384, heads=128, intermediate=53248)


# 16 nodes of 8 H100s: the first axis crosses nodes (400 Gb/s per GPU, 50 GB/s), the second NVLink
NODES_16x8 = autoparallel.MeshSpec((16, 8), ("dp", "tp"), alpha=(2e-5, 5e-6), beta=(1 / 50e9, 1 / 360e9))
# the same with the cross-node axis named "pp": pipeline stages forced on it
NODES_16x8_PP = autoparallel.MeshSpec((16, 8), ("pp", "tp"), alpha=(2e-5, 5e-6), beta=(1 / 50e9, 1 / 360e9))


def deepseek_v3():
    return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(use_cache=False))  # its defaults are DeepSeek-V3's dims


MOE_ROWS = ("mixtral-8x7b", "deepseek-v3")
"""Rows that also print the FSDP + EP recipe priced by the same model, and the plan's exposed
communication (issue 29)."""
ROWS = {  # build, batch, mesh, target seconds, LLM row (h100 preset, bf16 policy or "fp32", default budget)
    "gpt2-small": (lambda: gpt2(12, 768, 12), (8, 1024), (2, 4), 10.0, False),
    "gpt2-xl": (lambda: gpt2(48, 1600, 25), (8, 1024), (2, 4), 30.0, False),
    "llama3-8b": (llama3_8b, (64, 2048), (8, 8), 30.0, True),
    "llama3-70b": (llama3_70b, (128, 2048), (16, 8), 60.0, True),
    "llama3-70b-fp32": (llama3_70b, (128, 2048), (16, 8), 45.0, "fp32"),  # issue 27: no mixed precision
    "llama3-8b-3d": (llama3_8b, (64, 2048), (4, 4, 4), 30.0, True),
    "mixtral-8x7b": (mixtral_8x7b, (64, 4096), (8, 8), 60.0, True),
    "deepseek-v3": (deepseek_v3, (512, 4096), (64, 8), 120.0, True),
    # issue 28: one 8192-token sequence per data-parallel rank; "-pp": stages on the cross-node axis named "pp";
    # "-pp-auto": pipeline="auto" on unnamed axes (stages over either axis, or none); each priced against the
    # hand-written PP x FSDP x TP recipe (compare())
    "llama3-70b-pp": (llama3_70b, (128, 8192), NODES_16x8_PP, 60.0, True),
    "llama3-405b-pp": (llama3_405b, (128, 8192), NODES_16x8_PP, 60.0, True),
    "llama3-70b-pp-auto": (llama3_70b, (128, 8192), NODES_16x8, 120.0, True),
    "llama3-405b-pp-auto": (llama3_405b, (128, 8192), NODES_16x8, 120.0, True),
}


def run(name, solver, share, stamp, budget=None, baselines=False):
    build, (b, s), mesh, target, llm = ROWS[name]
    with torch.device("meta"):
        model = build()
    ids = torch.empty(b, s, dtype=torch.long, device="meta")
    kw = llm_options(budget, fp32=llm == "fp32") if llm else {}
    t0, cpu0 = time.perf_counter(), _cpu_s()
    inputs = {"input_ids": ids, "labels": ids.clone()}
    common = dict(solver=solver, share_layers=share, cache_dir=False, time_limit=300, stamp_layers=stamp, **kw)
    recipe = None
    if isinstance(mesh, autoparallel.MeshSpec):  # a pipelined row: the plan and the PP x FSDP x TP recipe
        auto = {} if "pp" in mesh.axis_names else {"pipeline": "auto"}
        cmp = autoparallel.compare(model, inputs, mesh_spec=mesh, **auto, **common)
        plan, recipe = cmp.plan, cmp.rows[1]
    else:
        plan = autoparallel.plan(model, inputs, mesh_shape=mesh, baselines=baselines, **common)
    total = time.perf_counter() - t0
    if recipe is not None and recipe.plan is not None:  # the recipe's own seconds are not the plan's
        total -= recipe.plan.solver_stats.stage_s.get("recipe", 0.0)
    return plan, total, _cpu_s() - cpu0, target, model, (b, s), mesh, recipe, inputs, common


def llm_options(budget, fp32: bool = False) -> dict:
    """The options of an LLM row (module docstring); ``fp32``: without the bf16 policy."""
    policy = None if fp32 else MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {"cost_model": autoparallel.CostModel("h100"), "memory_budget": budget, "device": "cuda",
            "mp_policy": policy}


def expert_recipe(model, inputs, mesh, common) -> tuple[str, object, str, float]:
    """The FSDP + EP recipe (:mod:`autoparallel.recipes`) planned with a mixture-of-experts row's
    options: ``(name, plan or None, why not, seconds)``."""
    t0 = time.perf_counter()
    traced = capture(model, inputs, mp_policy=common.get("mp_policy"), device=common.get("device"))
    rec = next(r for r in recipes(traced, autoparallel.MeshSpec(mesh)) if r.name.startswith("FSDP + EP"))
    plan, why = None, rec.reason
    if rec.constraints is not None:
        try:
            plan = autoparallel.plan(model, inputs, mesh_shape=mesh, constraints=rec.constraints, **common)
        except autoparallel.InfeasiblePlanError as e:
            why = str(e).splitlines()[0]
    return rec.name, plan, why, time.perf_counter() - t0


def expert_lines(plan, recipe) -> str:
    """The plan's exposed communication and the FSDP + EP recipe beside it."""
    name, rp, why, seconds = recipe
    step, _, comm, _ = step_parts(plan)
    out = f"  exposed communication {comm / step:.0%} of the plan's step"
    if rp is None:
        return out + f"\n  recipe {name}: {why}"
    r = step / rp.estimate.step_time_s
    fits = "OK" if rp.estimate.peak_memory_bytes <= 80 * 2**30 else "MISSED"
    return (out + f"\n  recipe {name}: step {rp.estimate.step_time_s:.2f} s, peak "
            f"{rp.estimate.peak_memory_bytes / 2**30:.1f} GiB (fits 80 GiB: {fits}; priced in {seconds:.1f} s, not "
            f"counted above)\n  plan / recipe step: {r:.2f}x (target <= 1.0x: {'OK' if r <= 1.0 else 'MISSED'})")


def _cpu_s() -> float:
    """CPU seconds of this process and of its finished children (the CBC solver runs as one):
    what the pipeline costs whatever else shares the cores."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def split_per_axis(plan) -> list[float]:
    """Per mesh axis, the fraction of parameter elements that axis splits."""
    total, split = 0, [0] * plan.mesh.ndim
    for node in plan.nodes.values():
        if node.op == "get_attr" and node.out_shapes:  # parameters and buffers
            n = math.prod(node.out_shapes[0])
            total += n
            for a, p in enumerate(node.output_specs[0]):
                split[a] += n if isinstance(p, Shard) else 0
    return [x / max(total, 1) for x in split]


def pipeline_line(plan) -> str:
    pl = plan.pipeline
    ck = plan.checkpoint
    return (f"over {pl.mesh.axis_names[pl.axis]} ({pl.pp}), boundaries {list(pl.boundaries)}, "
            f"{pl.microbatches} microbatches, {pl.schedule}, bubble {pl.bubble:.0%}, step {pl.step_s:.2f} s, "
            f"stage peaks up to {max(pl.stage_peak_bytes) / 2**30:.1f} GiB, "
            f"{recomputing(ck)}")


def recomputing(ck) -> str:
    if ck is None:
        return "no recomputation"
    policies = sorted({row.policy for row in ck.table})
    return f"recomputing {len(ck.regions)} regions ({', '.join(policies)})"


def memory_lines(plan) -> str:
    gib = 2 ** 30
    m = plan.estimate.memory
    parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in m.breakdown.items() if v)
    budget = plan.estimate.memory_budget_bytes
    ck = plan.checkpoint
    # a pipelined plan's peak is its largest stage's; the breakdown is its intra-stage plan's, all layers, one microbatch
    whole = ", of the intra-stage plan over every layer for one microbatch" if plan.pipeline is not None else ""
    return (f"  memory: modelled peak {plan.estimate.peak_memory_bytes / gib:.2f} GiB per device, budget "
            f"{'none' if budget is None else format(budget / gib, '.1f') + ' GiB'} "
            f"({'recomputing ' + str(len(ck.regions)) + ' regions' if ck else 'no recomputation'}; at the peak "
            f"without it, in the {m.phase}{whole}: {parts} GiB)\n"
            f"  parallelism: parameters split along mesh axes "
            f"{', '.join(f'{a}: {f:.0%}' for a, f in enumerate(split_per_axis(plan)))}; "
            f"peak RSS of this process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--solver", default=autoparallel.PlanOptions().solver, choices=list(SOLVERS),
                    help="the ILP solver (default: the planner's)")
    ap.add_argument("--no-share", action="store_true", help="also plan without block sharing")
    ap.add_argument("--no-stamp", action="store_true", help="trace every layer (no layer stamping)")
    ap.add_argument("--budget", default=None, help="memory budget of the LLM rows (default: the device's)")
    ap.add_argument("--baselines", action="store_true", help="also price the recipe baselines beside each plan")
    args = ap.parse_args()
    T.logging.set_verbosity_error()
    # warm up torch.export once so that the first row does not pay its one-time start-up
    torch.export.export(torch.nn.Linear(4, 4), (torch.empty(2, 4),), strict=False)
    totals = {}
    for name in args.rows.split(","):
        for share in ([True, False] if args.no_share else [True]):
            plan, total, cpu_s, target, model, (b, s), mesh, recipe, inputs, common = run(
                name, args.solver, share, not args.no_stamp, args.budget, args.baselines)
            st = plan.solver_stats
            nparams = sum(p.numel() for p in model.parameters()) / 1e9
            tag = "" if share else "  [no block sharing]"
            shape = mesh.shape if isinstance(mesh, autoparallel.MeshSpec) else mesh
            names = f" ({', '.join(mesh.axis_names)})" if isinstance(mesh, autoparallel.MeshSpec) else ""
            print(f"{name}: {nparams:.2f} B parameters, batch {b} x {s}, mesh {'x'.join(map(str, shape))}{names}{tag}")
            pl = plan.pipeline
            if pl is not None:
                print(f"  pipeline: {pipeline_line(plan)}")
            elif isinstance(mesh, autoparallel.MeshSpec):
                print(f"  pipeline: none (the plan without stages: step {plan.estimate.step_time_s:.2f} s, peak "
                      f"{plan.estimate.peak_memory_bytes / 2**30:.1f} GiB)")
            if recipe is not None:
                if recipe.plan is None:
                    print(f"  recipe {recipe.name}: {recipe.reason}")
                else:
                    r = plan.estimate.step_time_s / recipe.plan.estimate.step_time_s
                    print(f"  recipe {recipe.name}, {'; '.join(recipe.notes)}: {pipeline_line(recipe.plan)} "
                          f"(priced in {recipe.plan.solver_stats.stage_s.get('recipe', 0.0):.1f} s, not counted below)\n"
                          f"  plan / recipe step: {r:.2f}x (target <= 1.0x: {'OK' if r <= 1.0 else 'MISSED'}); "
                          f"fits 80 GiB: plan {'OK' if plan.estimate.peak_memory_bytes <= 80 * 2**30 else 'MISSED'}, "
                          f"recipe {'OK' if recipe.plan.estimate.peak_memory_bytes <= 80 * 2**30 else 'MISSED'}")
            stage = st.stage_s
            parts = {"trace": stage.get("trace", 0.0), "strategies": stage.get("strategies", 0.0), "memory model": stage.get("memory", 0.0),
                     "costs": stage.get("costs", 0.0), "ILP": stage.get("stage1", 0.0), "remat": stage.get("remat", 0.0),
                     "inspect": stage.get("inspect", 0.0), "baselines": stage.get("baselines", 0.0)}
            parts["other"] = total - sum(parts.values())
            print(f"  {' | '.join(f'{k} {v:.2f} s' for k, v in parts.items())} | total {total:.2f} s"
                  f" (target < {target:.0f} s: {'OK' if total < target else 'MISSED'}; {cpu_s:.2f} CPU s; load "
                  f"average {os.getloadavg()[0]:.1f})")
            print(f"  ({st.stamped_layers} layers stamped; last ILP solve: build {st.build_s:.2f} s, solve "
                  f"{st.solve_s:.2f} s; {st.memory_rounds} solves for the budget)")
            print(f"  ILP: {st.nodes} nodes -> {st.groups} groups (followers merged) -> {st.ilp_groups} "
                  f"(blocks shared, {st.shared_nodes} nodes share variables); {st.binary_vars} node vars, "
                  f"{st.edge_vars} edge vars, {st.constraints} constraints; {st.solver}, "
                  f"status {st.status}, gap {st.gap:.2%}")
            est = plan.estimate
            print(f"  plan: estimated step {est.step_time_s * 1e3:.1f} ms, {len(plan.collectives)} forward "
                  f"collectives, objective {st.objective_s * 1e3:.3f} ms")
            print(memory_lines(plan))
            if name in MOE_ROWS:
                print(expert_lines(plan, expert_recipe(model, inputs, mesh, common)))
            if share:
                totals[name] = total
    if "gpt2-small" in totals and "gpt2-xl" in totals:
        r = totals["gpt2-xl"] / totals["gpt2-small"]
        print(f"GPT-2 XL / GPT-2 small planning time: {r:.2f}x (target <= 2x: {'OK' if r <= 2 else 'MISSED'})")


if __name__ == "__main__":
    main()
