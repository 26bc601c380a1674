"""Time to plan GPT-2 small for a 2×4 mesh, split by stage (target: < 20 s on 2 cores).

Everything runs on the meta device: no weights or activations are allocated.

    python benchmarks/plan_time.py [--layers 12] [--mesh 2x4] [--batch 8] [--seq 1024] [--solver cbc]
"""

import argparse
import os
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import transformers  # noqa: E402

import autoparallel  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--mesh", default="2x4")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--solver", default="cbc", choices=["cbc", "highs"])
    args = ap.parse_args()
    mesh = tuple(int(x) for x in args.mesh.split("x"))
    transformers.logging.set_verbosity_error()
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=args.layers, use_cache=False))
    t_build = time.perf_counter() - t0
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    t0 = time.perf_counter()
    plan = autoparallel.plan(model, {"input_ids": ids, "labels": ids.clone()}, mesh_shape=mesh, solver=args.solver)
    total = time.perf_counter() - t0
    s = plan.solver_stats
    print(f"GPT-2 ({args.layers} layers, {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters), "
          f"batch {args.batch} x {args.seq}, mesh {'x'.join(map(str, mesh))}, solver {s['solver']}")
    print(f"  build model on meta      {t_build:7.2f} s (not counted)")
    print(f"  trace (torch.export)     {s['trace_s']:7.2f} s   {s['nodes']} nodes with strategies")
    print(f"  strategies               {s['strategies_s']:7.2f} s   {s['strategies']} strategies")
    print(f"  costs (nodes + edges)    {s['costs_s']:7.2f} s   {s['groups']} groups after merging followers, "
          f"{s['edges']} edges")
    print(f"  ILP build                {s['build_s']:7.2f} s   {s['binary_vars']} node vars, {s['edge_vars']} edge vars, "
          f"{s['constraints']} constraints")
    print(f"  ILP solve                {s['solve_s']:7.2f} s   status {s['status']}")
    print(f"  total plan()             {total:7.2f} s   (target < 20 s)")
    est = plan.estimate
    print(f"  estimated step {est['step_time_s'] * 1e3:.2f} ms, peak memory "
          f"{est['peak_memory_bytes'] / 2**30:.2f} GiB per device, {len(plan.collectives)} forward collectives")


if __name__ == "__main__":
    main()
