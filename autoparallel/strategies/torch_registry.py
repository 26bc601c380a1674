"""Strategies from DTensor's own sharding rules, for ops without a rule of ours.

DTensor's sharding propagator keeps, per ATen op, a function that lists the op's legal
shardings. :func:`registry_strategies` asks it about one graph node and converts the
answer into our :class:`~autoparallel.strategies.engine.Strategy` objects. Two kinds of
entries are read, as the propagator itself reads them (single-dim first):

- ``op_single_dim_strategy_funcs``: rules over one mesh axis, as placement lists
  ``[outputs..., tensor inputs...]`` with ``_ShardingPlaceholder(d)`` standing for
  ``Shard(d)``; expanded here to the mesh as DTensor does, every combination of one rule
  per mesh axis.
- ``op_strategy_funcs``: functions of an ``OpSchema`` whose tensor arguments are
  ``OpStrategy`` objects. Each tensor is offered every evenly split spec (per mesh axis
  ``Replicate()``, ``Shard(d)`` for each dim, and ``Partial()`` for floating tensors), so
  that functions that follow their inputs' placements list all their strategies.

DTensor's decomposition-based propagation (ops with neither entry) is not used: it only
explores placements reachable from the inputs' current ones, at one decomposition trace
per combination of input placements. Composite ops that our capture keeps whole
(``group_norm``, ``einsum``, ``nll_loss_nd``, ``huber_loss``, ...) have no entry (DTensor
registers what they decompose into) and stay on the replicate fallback (capture rewrites
``batch_norm``, ``mse_loss`` and ``broadcast_tensors`` into ops with rules).

Only strategies that our codegen runs as DTensor would are kept: placements ``Shard(d)``
(not ``_StridedShard``), ``Replicate()`` and ``Partial("sum")`` (exact types: not
``_MaskPartial`` or ``_NormPartial``); every split dim divides evenly
(the rule of :func:`~autoparallel.strategies.engine.enumerate_strategies`); no placement
other than ``Replicate()`` on a mesh axis of size 1; no ``Partial`` on a tensor that is
not floating point; the mutated input of an in-place op has the spec of the output that
aliases it (the planner already forbids resharding that input). Ops that DTensor runs
through a custom handler (e.g. ``convolution``) get nothing, and ops whose shape or size
arguments DTensor rewrites to local values at dispatch (``new_empty_strided``,
``expand_copy``, ``native_group_norm``, ...) keep only strategies in which no tensor is
split, since our codegen runs an op with its captured arguments. A strategy's ``split``
counts the mesh axes that divide the work (see :func:`_divides_work`). Results are cached
per (op, argument shapes and values, mesh shape).

The mesh handed to the strategy functions is a ``DeviceMesh`` built with
``_init_backend=False, _rank=0``: no process group is created or needed, nothing global
is initialized, and it works in a single CPU process.

Private torch API relied on (written against torch 2.13.0), all of it in this module:

- ``torch.distributed.tensor.DTensor._op_dispatcher``: its ``sharding_propagator`` and
  ``_custom_op_handlers``;
- ``ShardingPropagator`` attributes ``op_single_dim_strategy_funcs``,
  ``op_strategy_funcs``, ``op_to_schema_info``,
  ``op_to_schema_info_for_single_dim_strategy``, ``op_to_shape_and_stride_idx``,
  ``op_to_scalar_shape_adjuster``, ``squeeze_op_to_dims_variant``;
- ``torch.distributed.tensor._op_schema``: ``OpSchema`` (and its ``args_meta``,
  ``kwargs_meta``), ``OpSpec``, ``OpStrategy``, ``TupleStrategy``;
- ``torch.distributed.tensor._dtensor_spec``: ``DTensorSpec``, ``TensorMeta``;
- ``torch.distributed.tensor._ops.single_dim_strategy._ShardingPlaceholder`` (``.dim``);
- ``torch.distributed.device_mesh.DeviceMesh`` keyword arguments ``_init_backend`` and
  ``_rank``.

A torch upgrade that moves any of these makes this module fail to import or
:func:`registry_strategies` raise ``AttributeError``; one that changes how strategy
functions are called or what they return makes ops read as unregistered (replicate
fallback). tests/test_torch_registry.py fails in both cases: it asks for every op of the
model zoo and requires split strategies for ops known to be registered.
"""

from __future__ import annotations

import itertools
import logging
import math
from typing import Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, TupleStrategy
from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder

from ..placement import P, R, Spec
from .engine import Strategy
from ..graph import tensor_inputs, written_inputs

log = logging.getLogger(__name__)

_MESHES: dict[tuple[int, ...], DeviceMesh] = {}
_CACHE: dict = {}


def _propagator():
    return DTensor._op_dispatcher.sharding_propagator


def _mesh(mesh_shape: tuple[int, ...]) -> DeviceMesh:
    """A DeviceMesh of ``mesh_shape`` with no process group behind it (see module docstring)."""
    if mesh_shape not in _MESHES:
        ranks: list = list(range(math.prod(mesh_shape)))
        for n in reversed(mesh_shape[1:]):  # nested lists, not a tensor: no active mode sees it
            ranks = [ranks[i:i + n] for i in range(0, len(ranks), n)]
        _MESHES[mesh_shape] = DeviceMesh("cpu", ranks, _init_backend=False, _rank=0)
    return _MESHES[mesh_shape]


def _even(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> bool:
    """Every split dim of ``shape`` divides evenly under ``spec`` (and exists)."""
    for a, p in enumerate(spec):
        if isinstance(p, Shard) and not 0 <= p.dim < len(shape):
            return False
    for d, size in enumerate(shape):
        n = math.prod(mesh_shape[a] for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == d)
        if size % n:
            return False
    return True


def _candidates(val: torch.Tensor, mesh: DeviceMesh) -> OpStrategy:
    """Every evenly split spec of a tensor, as the strategy of its producer."""
    shape = tuple(val.shape)
    options = [Replicate()] + [Shard(d) for d in range(len(shape))]
    if val.dtype.is_floating_point:
        options.append(Partial())
    meta = TensorMeta(val.shape, val.stride(), val.dtype)
    specs = [OpSpec(DTensorSpec(mesh, pl, tensor_meta=meta))
             for pl in itertools.product(options, repeat=mesh.ndim) if _even(shape, pl, mesh.shape)]
    return OpStrategy(specs)


def _schema(node: fx.Node, mesh: DeviceMesh, schema_info) -> OpSchema:
    """The node's arguments with every tensor replaced by its candidate strategies (tensor
    lists become a TupleStrategy, as DTensor wraps them)."""

    def wrap(x):
        if isinstance(x, fx.Node):
            val = x.meta.get("val")
            return _candidates(val, mesh) if isinstance(val, torch.Tensor) else val
        if isinstance(x, (list, tuple)):
            items = [wrap(y) for y in x]
            if items and all(isinstance(y, OpStrategy) for y in items):
                return TupleStrategy(items)
            return type(x)(items)
        return x

    args = tuple(wrap(a) for a in node.args)
    kwargs = {k: wrap(v) for k, v in node.kwargs.items()}
    return OpSchema(node.target, args, kwargs, schema_info=schema_info)


def _single_dim_combos(answer, mesh_ndim: int, n_inputs: int):
    """``(outputs, inputs)`` placement lists on the mesh from the per-axis rules ``answer``
    (each ``[outputs..., inputs...]``): every combination of one rule per mesh axis."""
    rules = [[Shard(p.dim) if isinstance(p, _ShardingPlaceholder) else p for p in rule] for rule in answer]
    if not rules:
        return []
    replicate = [Replicate()] * len(rules[0])  # implied on every axis, as DTensor inserts it
    if replicate not in rules:
        rules.append(replicate)
    n_outputs = len(rules[0]) - n_inputs
    combos = []
    for per_axis in itertools.product(rules, repeat=mesh_ndim):
        specs = [tuple(rule[k] for rule in per_axis) for k in range(len(rules[0]))]
        combos.append((specs[:n_outputs], specs[n_outputs:]))
    return combos


def _opspec_combos(op_strategy, n_inputs: int):
    """``(outputs, inputs)`` placement lists of the OpSpecs of an OpStrategy; ``None`` for
    a TupleStrategy (foreach ops: one strategy per list element)."""
    if not isinstance(op_strategy, OpStrategy):
        return None
    combos = []
    for s in op_strategy.strategies:
        if s.output_specs is None:
            continue
        outs = s.output_specs if isinstance(s.output_specs, tuple) else (s.output_specs,)
        out_pl = [o.placements if o is not None else None for o in outs]
        if s.input_specs is not None:
            in_pl = [i.placements if i is not None else None for i in s.input_specs]
        elif len(outs) == 1:  # DTensor reads a missing input_specs as "every input like the output"
            in_pl = out_pl * n_inputs
        else:
            continue
        combos.append((out_pl, in_pl))
    return combos


def _supported(p) -> bool:
    return type(p) is Replicate or type(p) is Shard or (type(p) is Partial and p.reduce_op == "sum")


def _ours(spec) -> Spec | None:
    if spec is None or not all(_supported(p) for p in spec):
        return None
    return tuple(R if type(p) is Replicate else P if type(p) is Partial else Shard(p.dim) for p in spec)


def _aliased_pairs(node: fx.Node) -> list[tuple[int, int]]:
    """(tensor input position, output position) of in-place ops: the output is the input."""
    return [(j, o) for j, outs in written_inputs(node).items() for o in outs]


def _convert(node: fx.Node, combos, mesh_shape: tuple[int, ...]) -> list[Strategy]:
    ins = [x.meta["val"] for _, x in tensor_inputs(node)]
    val = node.meta["val"]
    returns = [val] if isinstance(val, torch.Tensor) else list(val) if isinstance(val, (list, tuple)) else []
    vals = [v for v in returns if isinstance(v, torch.Tensor)]
    if not vals:
        return []
    aliased = _aliased_pairs(node)
    no_split = _args_rewritten_by_dtensor(node.target)
    result: list[Strategy] = []
    for outs, inps in combos:
        if len(inps) != len(ins):
            continue  # the registry's inputs are not our tensor inputs one for one
        if len(outs) == 1 and len(returns) > 1:
            outs = outs * len(returns)  # one spec for every output, as DTensor reads it
        if len(outs) != len(returns):
            continue
        in_specs = [_ours(s) for s in inps]
        out_specs = [_ours(s) for s, v in zip(outs, returns) if isinstance(v, torch.Tensor)]
        if any(s is None for s in in_specs + out_specs):
            continue
        tensors = list(zip(ins, in_specs)) + list(zip(vals, out_specs))
        if not all(_even(tuple(v.shape), s, mesh_shape) for v, s in tensors):
            continue
        if any(p != R and mesh_shape[a] == 1 for _, s in tensors for a, p in enumerate(s)):
            continue
        if any(p == P and not v.dtype.is_floating_point for v, s in tensors for p in s):
            continue
        if any(in_specs[i] != out_specs[o] for i, o in aliased):
            continue
        if no_split and any(isinstance(p, Shard) for _, s in tensors for p in s):
            continue
        split = math.prod(n for a, n in enumerate(mesh_shape) if _divides_work(a, in_specs, out_specs))
        s = Strategy(tuple(in_specs), tuple(out_specs), split)
        if s not in result:
            result.append(s)
    return result


def _divides_work(axis: int, in_specs, out_specs) -> bool:
    """Mesh axis ``axis`` divides the op's work: some output is split along it, or some
    output is a pending sum of inputs split along it (a contraction). A ``Partial`` passed
    through from ``Partial`` inputs does the full work on every device."""
    if any(isinstance(s[axis], Shard) for s in out_specs):
        return True
    return any(s[axis] == P for s in out_specs) and any(isinstance(s[axis], Shard) for s in in_specs)


def _args_rewritten_by_dtensor(op) -> bool:
    prop = _propagator()
    return (op in prop.op_to_shape_and_stride_idx or op in prop.op_to_scalar_shape_adjuster
            or op in prop.squeeze_op_to_dims_variant)


def _cache_key(node: fx.Node, mesh_shape: tuple[int, ...]):
    def meta(x):
        v = x.meta.get("val")
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), tuple(v.stride()), v.dtype)
        return ("N", repr(v))

    args = pytree.tree_map_only(fx.Node, meta, (node.args, node.kwargs))
    val = node.meta["val"]
    outs = pytree.tree_map_only(torch.Tensor, lambda v: (tuple(v.shape), v.dtype), val)
    return (node.target, mesh_shape, repr(args), repr(outs))


def registry_strategies(node: fx.Node, mesh_shape: Sequence[int]) -> list[Strategy] | None:
    """The strategies DTensor's sharding propagator lists for ``node``'s op on a mesh.

    Args:
        node: a ``call_function`` node of a captured graph whose tensor arguments and
            outputs carry ``meta["val"]`` (global shapes).
        mesh_shape: devices per mesh axis, e.g. ``(4,)`` or ``(2, 2)``.

    Returns:
        The converted strategies (see module docstring for what is kept): inputs in the
        order of :func:`~autoparallel.strategies.rules.tensor_inputs`, outputs in the order
        of the node's tensor outputs, ``split`` the product of the sizes of the mesh axes
        that divide the work (:func:`_divides_work`). May be empty, and need not contain the
        replicated strategy. ``None`` when DTensor registers no strategies for the op, runs
        it through a custom handler, or its strategy function raises (logged at debug
        level). Cached per (op, argument shapes and values, mesh shape).

    Raises:
        AttributeError: when the private torch API listed in the module docstring has
            changed (a moved import fails when this module is imported).
    """
    mesh_shape = tuple(mesh_shape)
    op = node.target
    prop = _propagator()
    single_dim = prop.op_single_dim_strategy_funcs.get(op)
    func = single_dim if single_dim is not None else prop.op_strategy_funcs.get(op)
    if func is None or op in DTensor._op_dispatcher._custom_op_handlers:
        return None
    key = _cache_key(node, mesh_shape)
    if key in _CACHE:
        return _CACHE[key]
    mesh = _mesh(mesh_shape)
    n_inputs = sum(isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)
                   for x in pytree.tree_leaves((node.args, node.kwargs)))
    # the schema info DTensor's dispatcher attaches (it tells how to flatten list arguments)
    info = prop.op_to_schema_info.get(op) or prop.op_to_schema_info_for_single_dim_strategy.get(op)
    schema = _schema(node, mesh, info)
    call_args = (op, schema.args_meta, schema.kwargs_meta) if single_dim is not None else (schema,)
    try:
        answer = func(*call_args)
    except Exception as e:  # a strategy function that cannot handle these arguments
        log.debug("DTensor's strategy function for %s failed on node %s: %s: %s", op, node.name,
                  type(e).__name__, e)
        answer = None
    if answer is None:
        combos = None
    elif single_dim is not None:
        combos = _single_dim_combos(answer, mesh.ndim, n_inputs)
    else:
        combos = _opspec_combos(answer, n_inputs)
    result = None if combos is None else _convert(node, combos, mesh_shape)
    _CACHE[key] = result
    return result
