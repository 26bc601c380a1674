"""Which ops of a captured graph have sharding rules, and where their strategies come from."""

from __future__ import annotations

import json
import operator
from collections import defaultdict
from dataclasses import dataclass

import torch.fx as fx
from tabulate import tabulate

from ..tracer.annotate import node_info
from .rules import REPLICATE_ONLY, RULES

RULE = "rule"
REPLICATED_BY_RULE = "replicated by rule"
FALLBACK = "replicate fallback"


@dataclass
class CoverageRow:
    """One ATen op of the graph: where its strategies come from, how many nodes use it, and
    the module paths of those nodes."""

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


def coverage_of(gm: fx.GraphModule) -> CoverageReport:
    """The coverage report of a traced graph (fallback ops sorted first)."""
    ops: dict[str, list] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or not node_info(node).outputs:
            continue
        source = RULE if node.target in RULES else REPLICATED_BY_RULE if node.target in REPLICATE_ONLY else FALLBACK
        entry = ops.setdefault(str(node.target), [source, 0, set()])
        entry[1] += 1
        entry[2].add(node_info(node).module_path or "<root>")
    order = {FALLBACK: 0, REPLICATED_BY_RULE: 1, RULE: 2}
    rows = [CoverageRow(op, src, n, sorted(mods)) for op, (src, n, mods) in ops.items()]
    rows.sort(key=lambda r: (order[r.source], r.op))
    return CoverageReport(rows)
