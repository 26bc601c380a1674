"""Which ops of a captured graph have sharding rules, and where their strategies come from."""

from __future__ import annotations

import json
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch.fx as fx
from tabulate import tabulate

from ..tracer.annotate import node_info
from .generator import FALLBACK, REGISTRY, REPLICATED_BY_RULE, RULE, node_strategies

__all__ = ["CoverageRow", "CoverageReport", "coverage_of", "RULE", "REGISTRY", "REPLICATED_BY_RULE", "FALLBACK"]


@dataclass
class CoverageRow:
    """One ATen op of the graph and one source of strategies for its nodes: how many of its
    nodes take their strategies from there, and their module paths."""

    op: str
    source: str
    nodes: int
    modules: list[str]


@dataclass
class CoverageReport:
    rows: list[CoverageRow]

    def counts(self) -> dict[str, int]:
        """Number of distinct ops per source."""
        out: dict[str, int] = defaultdict(int)
        for r in self.rows:
            out[r.source] += 1
        return dict(out)

    def __str__(self) -> str:
        table = [[r.op, r.source, r.nodes, ", ".join(r.modules[:3]) + (" …" if len(r.modules) > 3 else "")]
                 for r in self.rows]
        summary = ", ".join(f"{v} {k}" for k, v in sorted(self.counts().items()))
        return tabulate(table, ["op", "strategies from", "nodes", "modules"], tablefmt="simple") + \
            f"\n{len(self.rows)} ops: {summary}"

    def to_json(self) -> str:
        return json.dumps([r.__dict__ for r in self.rows])


def coverage_of(gm: fx.GraphModule, mesh_shape: Sequence[int] = (2,)) -> CoverageReport:
    """The coverage report of a traced graph: one row per op and source of strategies,
    fallbacks first, then DTensor's registry, replicated by rule, and rules of ours.

    A node's source is what the strategy generator uses for it on a mesh of ``mesh_shape``
    (default ``(2,)``, on which the most dims divide evenly;
    :func:`~autoparallel.strategies.generator.node_strategies`): a node whose rule returns
    nothing for its arguments is a "replicate fallback" (or "torch registry") row of its op
    beside the op's "rule" row. A node without split strategies counts as "torch registry"
    when DTensor's registry splits another node of the same op (its shapes, not a missing
    rule, keep it whole).
    """
    mesh_shape = tuple(mesh_shape)
    ops: dict[tuple[str, str], list] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or not node_info(node).outputs:
            continue
        _, source = node_strategies(node, mesh_shape)
        entry = ops.setdefault((str(node.target), source), [0, set()])
        entry[0] += 1
        entry[1].add(node_info(node).module_path or "<root>")
    for op, source in [k for k in ops if k[1] == FALLBACK and (k[0], REGISTRY) in ops]:
        n, mods = ops.pop((op, source))
        ops[(op, REGISTRY)][0] += n
        ops[(op, REGISTRY)][1].update(mods)
    order = {FALLBACK: 0, REGISTRY: 1, REPLICATED_BY_RULE: 2, RULE: 3}
    rows = [CoverageRow(op, src, n, sorted(mods)) for (op, src), (n, mods) in ops.items()]
    rows.sort(key=lambda r: (order[r.source], r.op))
    return CoverageReport(rows)
