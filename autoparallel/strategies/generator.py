"""Per-node strategy lists for a traced graph: our own rule (the op's record), else DTensor's
sharding registry (:mod:`.torch_registry`), else the pointwise rule for ops torch tags
pointwise, else replicate fallback."""

from __future__ import annotations

import logging
import math
import operator
from collections import defaultdict
from typing import Sequence

import torch.fx as fx
import torch.utils._pytree as pytree

from ..errors import ShardingRuleError
from ..placement import P, R, Shard, Spec, spec_problem, uneven_dims
from ..tracer.annotate import node_info
from .engine import DimMap, Strategy, enumerate_strategies
from ..graph import tensor_inputs
from .records import is_pointwise, record_of
from .rules import POINTWISE_RECORD, REPLICATE_ONLY, unit_candidates
from .torch_registry import registry_strategies

RULE = "rule"
REGISTRY = "torch registry"
REPLICATED_BY_RULE = "replicated by rule"
FALLBACK = "replicate fallback"
"""Where a node's strategies come from (:func:`node_strategies`)."""

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


def node_strategies(node: fx.Node, mesh_shape: Sequence[int],
                    unit_candidates: dict | None = None) -> tuple[list[Strategy], str]:
    """The strategies of an annotated ``call_function`` node on a mesh, and their source.

    The source is :data:`RULE` when a rule of ours covers the node (the rule of the op's
    record returns a DimMap or strategies), :data:`REPLICATED_BY_RULE` for ops in
    ``REPLICATE_ONLY``, :data:`REGISTRY` when DTensor's registry lists a split strategy for
    it, :data:`RULE` again when torch tags the op pointwise and the pointwise rule splits it,
    else :data:`FALLBACK`. A rule that returns ``None`` (or no strategy) does not cover the
    node: it goes on to the registry like an op without a rule. Strategies with a
    ``Partial`` non-floating tensor are dropped; the replicated strategy is always in the list.

    Args:
        node: a node of a graph annotated by :func:`~autoparallel.tracer.annotate.annotate_graph`.
        mesh_shape: devices per mesh axis.
        unit_candidates: size → rows per unit a rule's label may be cut in
            (:func:`~autoparallel.strategies.rules.unit_candidates` of the graph).

    Raises:
        ShardingRuleError: the node's rule raised; the message names the node, op and module path.
    """
    nd = len(mesh_shape)
    info = node_info(node)
    ins = [n for _, n in tensor_inputs(node)]
    in_shapes = _shapes(ins)
    out_shapes = [s for s, _ in info.outputs]
    in_dt = [n.meta["val"].dtype for n in ins]
    out_dt = [dt for _, dt in info.outputs]
    repl = Strategy(tuple((R,) * nd for _ in ins), tuple((R,) * nd for _ in out_shapes))

    def usable(strategies):
        return [s for s in (strategies or []) if _partial_ok(s, in_dt, out_dt)]

    source = REPLICATED_BY_RULE
    record = record_of(node.target)
    strategies = usable(_rule_strategies(record, node, in_shapes, out_shapes, mesh_shape, unit_candidates))
    if record is not None:
        source = RULE
    if not strategies and node.target not in REPLICATE_ONLY:
        strategies = usable(registry_strategies(node, mesh_shape))
        source = REGISTRY if any(s != repl for s in strategies) else FALLBACK
    if source == FALLBACK and is_pointwise(node.target):
        strategies = usable(_rule_strategies(POINTWISE_RECORD, node, in_shapes, out_shapes, mesh_shape))
        source = RULE if any(s != repl for s in strategies) else FALLBACK
    if repl not in strategies:
        strategies.append(repl)
    return strategies, source


def _rule_strategies(record, node: fx.Node, in_shapes, out_shapes, mesh_shape,
                     unit_candidates=None) -> list[Strategy] | None:
    """The strategies ``record``'s rule gives ``node`` (``None`` without a record)."""
    if record is None:
        return None
    try:
        res = record.rule(node, in_shapes, out_shapes)
    except Exception as e:
        raise ShardingRuleError(
            f"sharding rule for {node.target} failed on node {node.name} "
            f"(module {node_info(node).module_path or '<root>'}): {type(e).__name__}: {e}") from e
    if isinstance(res, DimMap):
        return enumerate_strategies(res, mesh_shape, unit_candidates)
    return res(tuple(mesh_shape)) if callable(res) else res


def _param_spec_ok(shape, spec, mesh_shape) -> bool:
    """Whether a parameter or buffer may be stored under ``spec``: even splits always; an
    uneven one (``distribute_tensor`` cuts ``torch.chunk`` pieces) only of its first dim, as
    along a later dim the pieces' strides differ by device and DTensor's gradient of
    ``to_local`` (torch 2.13) infers one global stride per device, and only when no mesh axis
    replicates it, as the flat gradient bucket of replicated parameters
    (:mod:`autoparallel.runtime_kernels.grad_reduction`) splits its buffer with ``torch.split``,
    which takes no size that differs by simulated rank."""
    uneven = uneven_dims(shape, spec, mesh_shape)
    return not uneven or (set(uneven) == {0} and all(p != R for n, p in zip(mesh_shape, spec) if n > 1))


def local_input_spec(mesh_shape: Sequence[int]) -> Spec:
    """The placements of every tensor input under ``inputs="local"``: dim 0 split along every
    mesh axis, axis 0 outermost (DTensor's order), so that the device whose coordinate is
    ``(c_0, ..., c_k)`` holds the rows of piece ``c_0 · n_1···n_k + ... + c_k``: on a mesh whose
    ranks are numbered that way (``torch.arange(world).reshape(shape)``), rank ``r``'s own batch
    is the ``r``-th piece of the global batch. An axis of one device holds the same rows either
    way and says ``Replicate`` (the layout moves take no split along it)."""
    return tuple(Shard(0) if n > 1 else R for n in mesh_shape)


def split_inputs(strategies: dict, mesh_shape: Sequence[int]) -> None:
    """``inputs="local"``: every tensor placeholder (a rank's own batch) keeps the one strategy
    :func:`local_input_spec` gives, in place of the replicated one; its consumers take it as
    they need it (a gather, an all-to-all) at the price the ILP sees.

    Raises:
        ValueError: a 0-d tensor input (no batch dim to concatenate the ranks' batches along),
            or one whose dim 0 the mesh does not split evenly (not ``local rows × world``).
    """
    spec = local_input_spec(mesh_shape)
    for node, ss in strategies.items():
        if node.op != "placeholder" or not ss or not ss[0].outputs:
            continue
        shape = tuple(node_info(node).outputs[0][0])
        if not shape:
            raise ValueError(f"input {node.name} is a 0-d tensor: under inputs='local' every tensor input is a "
                             "rank's own batch, concatenated with the other ranks' along dim 0; pass it as a "
                             "tensor with a batch dim, or use inputs='global'")
        problem = spec_problem(spec, shape, mesh_shape)
        if problem or shape[0] % _world(mesh_shape):
            raise ValueError(f"input {node.name} {list(shape)}: under inputs='local' its dim 0 is the ranks' "
                             f"batches concatenated, a multiple of the {_world(mesh_shape)} devices"
                             + (f" ({problem})" if problem else ""))
        strategies[node] = [Strategy((), (spec,))]


def _world(mesh_shape) -> int:
    return math.prod(mesh_shape)


class StrategyGenerator:
    """Lists the strategies of every node of a traced graph on a mesh.

    Placeholders (the global batch) are replicated: consumers that want them split take
    a local slice, which costs nothing (under ``inputs="local"`` the planner makes them split
    instead: :func:`split_inputs`). Parameters and buffers may be split over any of
    their dims, and unevenly as :func:`_param_spec_ok` allows. An op that returns no tensor
    (``x.item()``: a Python number) reads its tensor inputs replicated, so that every device
    computes the global value. ``getitem``
    nodes alias an output of their producer and get no strategies of their own (see
    :attr:`aliases`). A node that no rule of ours covers (no rule for
    its op, or the rule returns nothing for its arguments) takes the strategies DTensor's
    sharding registry lists for it (:func:`.torch_registry.registry_strategies`), recorded
    in :attr:`registry_ops`; when that gives none but the replicated one, the node runs
    replicated and its op is recorded in :attr:`fallbacks` (:func:`node_strategies`).

    Args:
        mesh_shape: devices per mesh axis.
        strict: raise instead of falling back to replication for nodes no rule covers.

    Attributes:
        fallbacks: op → module paths, for ops with a node that only runs replicated for
            want of a rule.
        registry_ops: op → module paths, for ops with a node whose strategies come from
            DTensor's registry.

    Raises:
        ShardingRuleError: under ``strict=True``, listing every op with a node that neither
            a rule nor DTensor's registry splits, at once, each with the module paths that
            use it; or when a rule fails on a node (:func:`node_strategies`).
    """

    def __init__(self, mesh_shape: Sequence[int], strict: bool = False):
        self.mesh_shape = tuple(mesh_shape)
        self.strict = strict
        self.aliases: dict[fx.Node, tuple[fx.Node, int]] = {}
        self.fallbacks: dict[str, set[str]] = defaultdict(set)
        self.registry_ops: dict[str, set[str]] = defaultdict(set)
        self._cache: dict = {}
        self._units: dict = {}  # the graph's unit candidates (rules.unit_candidates), set by generate

    def generate(self, gm: fx.GraphModule) -> dict[fx.Node, list[Strategy]]:
        nd = len(self.mesh_shape)
        repl = (R,) * nd
        out: dict[fx.Node, list[Strategy]] = {}
        self._units = unit_candidates(gm)
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            if node.op == "call_function" and node.target is operator.getitem:
                src = node.args[0]
                self.aliases[node] = (src, node.args[1])
                continue
            info = node_info(node)
            if node.op == "call_function" and not info.outputs:
                # a Python number (.item()) or nothing: the same on every device only from whole inputs
                out[node] = [Strategy(tuple(repl for _ in tensor_inputs(node)), ())]
                continue
            if not info.outputs:
                continue
            if node.op == "placeholder":
                out[node] = [Strategy((), (repl,) * len(info.outputs))]
            elif node.op == "get_attr":
                shape = info.outputs[0][0]
                dm = DimMap([], [tuple(f"d{i}" for i in range(len(shape)))], [], [shape], uneven=1)
                out[node] = [s for s in enumerate_strategies(dm, self.mesh_shape)
                             if _param_spec_ok(shape, s.outputs[0], self.mesh_shape)]
            else:
                out[node] = self._op_strategies(node, info)
        if self.fallbacks and self.strict:
            lines = [f"  {op} (used in: {', '.join(sorted(p or '<root>' for p in paths))})"
                     for op, paths in sorted(self.fallbacks.items())]
            raise ShardingRuleError("no sharding rule, ours or DTensor's, covers these ops (strict=True):\n"
                                    + "\n".join(lines) + "\n  Pass strict=False to run them replicated.")
        return out

    def _op_strategies(self, node: fx.Node, info) -> list[Strategy]:
        ins = [n for _, n in tensor_inputs(node)]
        key = _key(node, _shapes(ins), [s for s, _ in info.outputs]), tuple(self._units.items())
        if key not in self._cache:
            self._cache[key] = node_strategies(node, self.mesh_shape, self._units)
        strategies, source = self._cache[key]
        record = {REGISTRY: self.registry_ops, FALLBACK: self.fallbacks}.get(source)
        if record is not None:
            op = str(node.target)
            if op not in record:
                if source == REGISTRY:
                    log.info("no sharding rule of ours covers %s (node %s, module %s): strategies from "
                             "DTensor's registry", op, node.name, info.module_path or "<root>")
                else:
                    log.warning("no sharding rule covers %s (node %s, module %s): it runs replicated",
                                op, node.name, info.module_path or "<root>")
            record[op].add(info.module_path)
        return strategies
