"""Per-node strategy lists for a traced graph: our own rule, else DTensor's sharding
registry (:mod:`.torch_registry`), else replicate fallback."""

from __future__ import annotations

import logging
import operator
from collections import defaultdict
from typing import Sequence

import torch.fx as fx
import torch.utils._pytree as pytree

from ..errors import ShardingRuleError
from ..placement import P, R
from ..tracer.annotate import node_info
from .engine import DimMap, Strategy, enumerate_strategies
from .rules import REPLICATE_ONLY, RULES, tensor_inputs
from .torch_registry import registry_strategies

log = logging.getLogger(__name__)


def _shapes(nodes) -> list[tuple[int, ...]]:
    return [tuple(n.meta["val"].shape) for n in nodes]


def _key(node: fx.Node, in_shapes, out_shapes):
    args = pytree.tree_map_only(fx.Node, lambda n: "T", (node.args, node.kwargs))
    return (node.target, tuple(in_shapes), tuple(out_shapes), repr(args))


def _partial_ok(strategy: Strategy, in_dtypes, out_dtypes) -> bool:
    for spec, dt in list(zip(strategy.inputs, in_dtypes)) + list(zip(strategy.outputs, out_dtypes)):
        if not dt.is_floating_point and any(p == P for p in spec):
            return False
    return True


class StrategyGenerator:
    """Lists the strategies of every node of a traced graph on a mesh.

    Placeholders (the global batch) are replicated: consumers that want them split take
    a local slice, which costs nothing. Parameters and buffers may be split over any of
    their dims. ``getitem`` nodes alias an output of their producer and get no strategies
    of their own (see :attr:`aliases`). An op without a rule of ours takes the strategies
    DTensor's sharding registry lists for it (:func:`.torch_registry.registry_strategies`),
    recorded in :attr:`registry_ops`; when that gives none but the replicated one, the op
    runs replicated and is recorded in :attr:`fallbacks`.

    Args:
        mesh_shape: devices per mesh axis.
        strict: raise instead of falling back to replication for ops without a rule.

    Attributes:
        fallbacks: op → module paths, for ops that only run replicated for want of a rule.
        registry_ops: op → module paths, for ops whose strategies come from DTensor's registry.

    Raises:
        ShardingRuleError: under ``strict=True``, listing every op that has neither a rule
            nor split strategies in DTensor's registry at once, each with the module paths
            that use it.
    """

    def __init__(self, mesh_shape: Sequence[int], strict: bool = False):
        self.mesh_shape = tuple(mesh_shape)
        self.strict = strict
        self.aliases: dict[fx.Node, tuple[fx.Node, int]] = {}
        self.fallbacks: dict[str, set[str]] = defaultdict(set)
        self.registry_ops: dict[str, set[str]] = defaultdict(set)
        self._cache: dict = {}

    def generate(self, gm: fx.GraphModule) -> dict[fx.Node, list[Strategy]]:
        nd = len(self.mesh_shape)
        repl = (R,) * nd
        out: dict[fx.Node, list[Strategy]] = {}
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            if node.op == "call_function" and node.target is operator.getitem:
                src = node.args[0]
                self.aliases[node] = (src, node.args[1])
                continue
            info = node_info(node)
            if not info.outputs:
                continue
            if node.op == "placeholder":
                out[node] = [Strategy((), (repl,) * len(info.outputs))]
            elif node.op == "get_attr":
                shape = info.outputs[0][0]
                dm = DimMap([], [tuple(f"d{i}" for i in range(len(shape)))], [], [shape])
                out[node] = enumerate_strategies(dm, self.mesh_shape)
            else:
                out[node] = self._op_strategies(node, info)
        if self.fallbacks and self.strict:
            lines = [f"  {op} (used in: {', '.join(sorted(p or '<root>' for p in paths))})"
                     for op, paths in sorted(self.fallbacks.items())]
            raise ShardingRuleError("no sharding rule for these ops, ours or DTensor's (strict=True):\n"
                                    + "\n".join(lines) + "\n  Pass strict=False to run them replicated.")
        return out

    def _op_strategies(self, node: fx.Node, info) -> list[Strategy]:
        ins = [n for _, n in tensor_inputs(node)]
        in_shapes = _shapes(ins)
        out_shapes = [s for s, _ in info.outputs]
        key = _key(node, in_shapes, out_shapes)
        if key not in self._cache:
            self._cache[key] = self._compute(node, info, ins, in_shapes, out_shapes)
        strategies, source = self._cache[key]
        if source is not None:
            op = str(node.target)
            if op not in source:
                if source is self.registry_ops:
                    log.info("no sharding rule for %s (node %s, module %s): strategies from DTensor's registry",
                             op, node.name, info.module_path or "<root>")
                else:
                    log.warning("no sharding rule for %s (node %s, module %s): it runs replicated",
                                op, node.name, info.module_path or "<root>")
            source[op].add(info.module_path)
        return strategies

    def _compute(self, node: fx.Node, info, ins, in_shapes, out_shapes):
        """(strategies, where to record the op: None, :attr:`registry_ops` or :attr:`fallbacks`)."""
        nd = len(self.mesh_shape)
        fn = RULES.get(node.target)
        strategies = None
        source = None
        if fn is not None:
            try:
                res = fn(node, in_shapes, out_shapes)
            except Exception as e:
                raise ShardingRuleError(
                    f"sharding rule for {node.target} failed on node {node.name} "
                    f"(module {info.module_path or '<root>'}): {type(e).__name__}: {e}") from e
            if isinstance(res, DimMap):
                strategies = enumerate_strategies(res, self.mesh_shape)
            elif res is not None:
                strategies = res
        elif node.target not in REPLICATE_ONLY:
            strategies = registry_strategies(node, self.mesh_shape)
            source = self.fallbacks
        in_dt = [n.meta["val"].dtype for n in ins]
        out_dt = [dt for _, dt in info.outputs]
        repl = Strategy(tuple((R,) * nd for _ in ins), tuple((R,) * nd for _ in out_shapes))
        strategies = [s for s in (strategies or []) if _partial_ok(s, in_dt, out_dt)]
        if source is not None and any(s != repl for s in strategies):
            source = self.registry_ops
        if repl not in strategies:
            strategies.append(repl)
        return strategies, source
