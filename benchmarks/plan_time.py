"""Time to plan real model shapes on the meta device, whole pipeline, split by stage.

Rows (targets on a 2-core machine):

* GPT-2 small: 12 layers, batch 8 × 1024, 2×4 mesh — < 10 s
* GPT-2 XL: 48 layers, batch 8 × 1024, 2×4 mesh — < 30 s and ≤ 2× the 12-layer time
* Llama-3-8B dims: 32 layers, GQA 32/8 heads, vocab 128256, batch 64 × 2048, 8×8 mesh — < 60 s

    python benchmarks/plan_time.py [--rows gpt2-small,gpt2-xl,llama3-8b] [--solver cbc|highs]
        [--no-share]   # also plan without repeated-block sharing (ILP size before/after)
        [--no-stamp]   # capture every layer instead of tracing four and stamping the rest

Nothing is allocated: models are built on the meta device. The plan cache is off.
"""

import argparse
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import transformers as T  # noqa: E402

import autoparallel  # noqa: E402


def gpt2(layers, embd, heads):
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=layers, n_embd=embd, n_head=heads, use_cache=False))


def llama3_8b():
    return T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        use_cache=False))


ROWS = {
    "gpt2-small": (lambda: gpt2(12, 768, 12), (8, 1024), (2, 4), 10.0),
    "gpt2-xl": (lambda: gpt2(48, 1600, 25), (8, 1024), (2, 4), 30.0),
    "llama3-8b": (llama3_8b, (64, 2048), (8, 8), 60.0),
}


def run(name, solver, share, stamp):
    build, (b, s), mesh, target = ROWS[name]
    with torch.device("meta"):
        model = build()
    ids = torch.empty(b, s, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    plan = autoparallel.plan(model, {"input_ids": ids, "labels": ids.clone()}, mesh_shape=mesh, solver=solver,
                             share_layers=share, cache_dir=False, time_limit=300,
                             stamp_layers=stamp)
    return plan, time.perf_counter() - t0, target, model, (b, s), mesh


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--solver", default="cbc", choices=["cbc", "highs"])
    ap.add_argument("--no-share", action="store_true", help="also plan without block sharing")
    ap.add_argument("--no-stamp", action="store_true", help="trace every layer (no layer stamping)")
    args = ap.parse_args()
    T.logging.set_verbosity_error()
    # warm up torch.export once so that the first row does not pay its one-time start-up
    torch.export.export(torch.nn.Linear(4, 4), (torch.empty(2, 4),), strict=False)
    totals = {}
    for name in args.rows.split(","):
        for share in ([True, False] if args.no_share else [True]):
            plan, total, target, model, (b, s), mesh = run(name, args.solver, share, not args.no_stamp)
            st = plan.solver_stats
            nparams = sum(p.numel() for p in model.parameters()) / 1e9
            tag = "" if share else "  [no block sharing]"
            print(f"{name}: {nparams:.2f} B parameters, batch {b} x {s}, mesh {'x'.join(map(str, mesh))}{tag}")
            print(f"  trace {st['trace_s']:.2f} s ({st['stamped_layers']} layers stamped) | strategies {st['strategies_s']:.2f} s"
                  f" | memory model {st['memory_s']:.2f} s | costs {st['costs_s']:.2f} s"
                  f" | ILP build {st['build_s']:.2f} s | ILP solve {st['solve_s']:.2f} s | total {total:.2f} s"
                  f" (target < {target:.0f} s: {'OK' if total < target else 'MISSED'})")
            print(f"  ILP: {st['nodes']} nodes -> {st['groups']} groups (followers merged) -> {st['ilp_groups']} "
                  f"(blocks shared, {st['shared_nodes']} nodes share variables); {st['binary_vars']} node vars, "
                  f"{st['edge_vars']} edge vars, {st['constraints']} constraints; {st['solver']}, "
                  f"status {st['status']}, gap {st['gap']:.2%}")
            est = plan.estimate
            print(f"  plan: estimated step {est['step_time_s'] * 1e3:.1f} ms, {len(plan.collectives)} forward "
                  f"collectives, objective {st['objective_s'] * 1e3:.3f} ms")
            if share:
                totals[name] = total
    if "gpt2-small" in totals and "gpt2-xl" in totals:
        r = totals["gpt2-xl"] / totals["gpt2-small"]
        print(f"GPT-2 XL / GPT-2 small planning time: {r:.2f}x (target <= 2x: {'OK' if r <= 2 else 'MISSED'})")


if __name__ == "__main__":
    main()
