"""The step time a plan models with and without the vocab-parallel strategies.

GPT-2 (Hugging Face architecture, random weights, 2 layers, hidden 64, sequence 16, the loss
computed inside) on a (4,) mesh, planned twice per (vocabulary, batch) row: as is, and with the
strategies that split ``embedding``'s vocabulary or ``cross_entropy_loss``'s classes filtered
out of the rules' lists. Printed per row: the modelled step time, its communication and
gradient-reduction parts, and the placements the plan gives the loss and the token embedding.

    python benchmarks/vocab_parallel.py [--preset cpu] [--rows 2048x2,2048x8,8192x2,8192x8]
"""

from __future__ import annotations

import argparse

import torch
from torch.distributed.tensor import Shard

import autoparallel
from autoparallel.strategies import generator

aten = torch.ops.aten
_RULE_STRATEGIES = generator._rule_strategies


def _without_vocab_split(record, node, in_shapes, out_shapes, mesh_shape):
    strategies = _RULE_STRATEGIES(record, node, in_shapes, out_shapes, mesh_shape)
    split = {aten.cross_entropy_loss.default: Shard(1), aten.embedding.default: Shard(0)}.get(node.target)
    if strategies and split is not None:
        strategies = [s for s in strategies if split not in s.inputs[0]]
    return strategies


def gpt2(vocab: int):
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=32,
                                          resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, use_cache=False))


def row(vocab: int, batch: int, preset: str) -> str:
    meta = {k: torch.empty(batch, 16, dtype=torch.long, device="meta") for k in ("input_ids", "labels")}
    lines = [f"vocabulary {vocab}, batch {batch} x 16, (4,), preset {preset}"]
    for label, rule in (("vocab-parallel allowed", _RULE_STRATEGIES), ("without vocab split", _without_vocab_split)):
        generator._rule_strategies = rule
        try:
            plan = autoparallel.plan(gpt2(vocab), meta, mesh_shape=(4,), cost_model=autoparallel.CostModel(preset),
                                     cache_dir=False)
        finally:
            generator._rule_strategies = _RULE_STRATEGIES
        e = plan.estimate
        loss = next(n for n in plan.nodes.values() if n.op == "cross_entropy_loss.default")
        wte = next(n for n in plan.nodes.values() if n.op == "embedding.default" and n.module_path == "transformer.wte")
        lines.append(f"  {label:24s} step {e.step_time_s * 1e6:8.1f} us  comm {e.comm_s * 1e6:6.1f} us  "
                     f"grad {e.grad_comm_s * 1e6:5.1f} us  loss {loss.specs_str()}  wte {wte.specs_str()}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="cpu")
    ap.add_argument("--rows", default="2048x2,2048x8,8192x2,8192x8", help="VOCABxBATCH, comma-separated")
    args = ap.parse_args()
    for r in args.rows.split(","):
        vocab, batch = (int(v) for v in r.split("x"))
        print(row(vocab, batch, args.preset))


if __name__ == "__main__":
    main()
