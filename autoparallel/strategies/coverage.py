"""Which ops of a captured graph have sharding rules, and where their strategies come from."""

from __future__ import annotations

import json
import operator
from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch.fx as fx
from tabulate import tabulate

from ..placement import R
from ..tracer.annotate import node_info
from .rules import REPLICATE_ONLY, RULES
from .torch_registry import registry_strategies

RULE = "rule"
REGISTRY = "torch registry"
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


def _source(node: fx.Node, mesh_shape: tuple[int, ...]) -> str:
    if node.target in RULES:
        return RULE
    if node.target in REPLICATE_ONLY:
        return REPLICATED_BY_RULE
    repl = (R,) * len(mesh_shape)
    strategies = registry_strategies(node, mesh_shape) or []
    if any(spec != repl for s in strategies for spec in s.inputs + s.outputs):
        return REGISTRY
    return FALLBACK


def coverage_of(gm: fx.GraphModule, mesh_shape: Sequence[int] = (2,)) -> CoverageReport:
    """The coverage report of a traced graph, fallback ops first, then ops whose strategies
    come from DTensor's registry, ops replicated by rule, and ops with a rule of ours.

    An op without a rule of ours counts as "torch registry" when DTensor's registry gives
    some node of it a split strategy on a mesh of ``mesh_shape`` (default ``(2,)``, on
    which the most dims divide evenly), else as "replicate fallback".
    """
    mesh_shape = tuple(mesh_shape)
    ops: dict[str, list] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem or not node_info(node).outputs:
            continue
        source = _source(node, mesh_shape)
        entry = ops.setdefault(str(node.target), [source, 0, set()])
        if source == REGISTRY:  # any node with split strategies makes the op a registry op
            entry[0] = REGISTRY
        entry[1] += 1
        entry[2].add(node_info(node).module_path or "<root>")
    order = {FALLBACK: 0, REGISTRY: 1, REPLICATED_BY_RULE: 2, RULE: 3}
    rows = [CoverageRow(op, src, n, sorted(mods)) for op, (src, n, mods) in ops.items()]
    rows.sort(key=lambda r: (order[r.source], r.op))
    return CoverageReport(rows)
