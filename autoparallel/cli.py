"""Command line: ``python -m autoparallel {plan,coverage} ...``.

The model is either a Hugging Face architecture built from a config on the meta device
(``--model gpt2|llama|bert`` with ``--layers/--hidden/--heads/--vocab``) or a factory of
your own (``--factory package.module:function`` returning ``(model, meta_inputs)``).

Examples::

    python -m autoparallel plan --model llama --layers 32 --hidden 4096 --heads 32 --mesh 8x8 \\
        --batch 64 --seq 2048
    python -m autoparallel coverage --model bert
    python -m autoparallel plan --factory mymodels:build --mesh 2x4 --json plan.json
    python -m autoparallel plan --model gpt2 --mesh 2x2 --axes dp,tp --constraint 'lm_head.weight=S0(tp)' \\
        --compare --report out/

``plan`` prints the plan's summary (``str(plan)``); ``--table`` the per-module table;
``--compare`` the plan beside data parallelism and the hand-written recipes
(:func:`autoparallel.compare`); ``--report DIR`` writes ``summary.txt``, ``table.txt``,
``plan.json`` and ``plan.png`` (:meth:`Plan.plot <autoparallel.plan.Plan.plot>`, needs the
``plot`` extra) into ``DIR``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

import torch


def _hf_model(args):
    import transformers as T

    T.logging.set_verbosity_error()
    common = dict(vocab_size=args.vocab, use_cache=False) if args.model != "bert" else dict(vocab_size=args.vocab)
    if args.model == "gpt2":
        cfg = T.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, **common)
        cls = T.GPT2LMHeadModel
    elif args.model == "llama":
        cfg = T.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                            num_key_value_heads=args.kv_heads or args.heads, intermediate_size=4 * args.hidden,
                            **common)
        cls = T.LlamaForCausalLM
    elif args.model == "bert":
        cfg = T.BertConfig(num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                           intermediate_size=4 * args.hidden, **common)
        cls = T.BertForMaskedLM
    else:
        raise SystemExit(f"unknown --model {args.model!r}: choose gpt2, llama or bert, or pass --factory")
    with torch.device("meta"):
        model = cls(cfg)
    ids = torch.empty(args.batch, args.seq, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}


def _build(args):
    if args.factory:
        mod, _, fn = args.factory.partition(":")
        return getattr(importlib.import_module(mod), fn)()
    return _hf_model(args)


def main(argv=None) -> int:
    import autoparallel

    ap = argparse.ArgumentParser(prog="python -m autoparallel", description="Plan or inspect a model's sharding.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in [("plan", "solve the sharding plan and print it"),
                        ("coverage", "list the model's ops and where their strategies come from")]:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--model", default="gpt2", help="gpt2, llama or bert (built from a config on meta)")
        p.add_argument("--factory", help="package.module:function returning (model, meta_inputs)")
        p.add_argument("--layers", type=int, default=2)
        p.add_argument("--hidden", type=int, default=256)
        p.add_argument("--heads", type=int, default=4)
        p.add_argument("--kv-heads", type=int, default=None)
        p.add_argument("--vocab", type=int, default=1024)
        p.add_argument("--batch", type=int, default=8)
        p.add_argument("--seq", type=int, default=128)
        p.add_argument("--json", help="also write the result as JSON to this file")
        if name == "plan":
            p.add_argument("--mesh", default="2x2", help="mesh shape, e.g. 2x4")
            p.add_argument("--device", default="a100", help="cost-model device preset (a100, h100, cpu)")
            p.add_argument("--solver", default="cbc", choices=["cbc", "highs"])
            p.add_argument("-v", "--verbose", action="store_true", help="log progress per stage")
            p.add_argument("--axes", help="mesh axis names, comma-separated, e.g. dp,tp")
            p.add_argument("--constraint", action="append", default=[], metavar="PATTERN=PLACEMENTS",
                           help="pin tensors matching PATTERN, e.g. 'lm_head.weight=S0(tp)' (repeatable)")
            p.add_argument("--compare", action="store_true", help="also price DDP, FSDP, Megatron TP, FSDP + TP")
            p.add_argument("--table", action="store_true", help="print the per-module table, not the summary")
            p.add_argument("--report", metavar="DIR", help="write summary.txt, table.txt, plan.json, plan.png")
    args = ap.parse_args(argv)
    if getattr(args, "verbose", False):
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    model, meta_inputs = _build(args)
    if args.cmd == "coverage":
        result = autoparallel.coverage(model, meta_inputs)
        print(result)
    else:
        result = _plan(args, model, meta_inputs)
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())
    return 0


def _plan(args, model, meta_inputs):
    import autoparallel

    shape = tuple(int(x) for x in args.mesh.lower().split("x"))
    mesh = autoparallel.MeshSpec(shape, tuple(args.axes.split(",")) if args.axes else None)
    constraints = {}
    for item in args.constraint:
        pattern, sep, placements = item.partition("=")
        if not sep:
            raise SystemExit(f"--constraint {item!r}: expected PATTERN=PLACEMENTS, e.g. 'lm_head.weight=S0(tp)'")
        constraints[pattern] = placements
    options = dict(mesh_spec=mesh, solver=args.solver, cost_model=autoparallel.CostModel(args.device))
    if args.compare:
        if constraints:
            raise SystemExit("--compare prices the unconstrained plan: drop --constraint")
        comparison = autoparallel.compare(model, meta_inputs, **options)
        result = comparison.plan
    else:
        result = autoparallel.plan(model, meta_inputs, constraints=constraints or None, **options)
    print(result.table() if args.table else result)
    if args.compare:
        print(comparison)
    if args.report:
        for path in write_report(result, args.report):
            print(f"wrote {path}")
    return result


def write_report(plan, folder) -> list[str]:
    """Write ``summary.txt``, ``table.txt``, ``plan.json`` and ``plan.png`` of ``plan`` into
    ``folder`` (created); returns the paths written.

    Raises:
        ImportError: matplotlib is missing (the ``plot`` extra), after the text files.
    """
    from pathlib import Path

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in (("summary.txt", str(plan)), ("table.txt", plan.table()), ("plan.json", plan.to_json())):
        (out / name).write_text(text + ("\n" if not text.endswith("\n") else ""))
        written.append(str(out / name))
    return written + plan.plot(out / "plan.png")


if __name__ == "__main__":
    sys.exit(main())
