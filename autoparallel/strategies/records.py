"""One record per op (or op family): its sharding rule, its per-device rewrite, its own cost.

Everything the pipeline knows about an op beyond the generic machinery lives in its
:class:`OpRecord`, registered under the op's ATen overloads with :func:`record`:

- ``rule(node, in_shapes, out_shapes)``: the op's strategies, as a
  :class:`~autoparallel.strategies.engine.DimMap`, or as a function of the mesh shape that
  returns a list of :class:`~autoparallel.strategies.engine.Strategy` (``None``: the rule
  does not cover this node; see :mod:`~autoparallel.strategies.rules`).
- ``local(call)``: how the op runs on one device when the local op differs from the
  global one (a shape argument holding global sizes, a group count, a mean over a split
  dim, a loss divided by a global count). It receives a :class:`LocalCall` and returns
  the node that stands for the op's (local) value. Without it the op is emitted as
  captured, on local tensors.
- ``cost(node, strategy, cost_model)``: seconds of communication the op performs itself
  under ``strategy`` (beyond the resharding of its inputs, which the planner prices);
  without it, none.
- ``saved(node)``: for an op whose per-device form is not the captured op, the tensors that
  form keeps for its backward beyond its inputs, as ``(global shape, dtype)``, each divided
  among the devices as the op's work is (``Strategy.split``); the memory model reads it
  instead of running the captured op. Its inputs count as saved.
- ``load(node, strategy, mesh_shape, cost_model)``: the busiest device's share of the op's
  work over an even share (``Strategy.split``) under ``strategy``, for an op whose work per
  device depends on the data (routed experts: the pairs routed to a device's experts); the
  solver prices the busiest device's compute, since every device waits for it at the op's
  next collective, and the memory model sizes the busiest device's ``saved`` tensors. Without
  it, 1 (the work divides evenly).

The solver asks :func:`record_of` for ``cost``, the passes for ``local``; neither names an
op. Ops with ``torch.Tag.pointwise`` that have no record of their own and that DTensor's
registry does not split get :data:`~autoparallel.strategies.rules.POINTWISE_RECORD` (see
:func:`~autoparallel.strategies.generator.node_strategies`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from ..graph import bind_args
from ..placement import Spec, dim_unit, local_shape, num_shards, piece_length, shard_axes


@dataclass
class LocalCall:
    """One traced node about to be emitted on local shards, for a record's ``local`` hook.

    Attributes:
        node: the traced node (global shapes in its ``meta["val"]``).
        args / kwargs: its arguments on this device: tensors are the local values, already
            converted to ``input_specs``; every other argument as captured.
        in_shapes / out_shapes: global shapes of the data tensor inputs and the outputs.
        input_specs / output_specs: the specs of the chosen strategy.
        mesh_shape: devices per mesh axis.
        graph: the per-device graph being built.
        all_reduce: ``all_reduce(x, axis)`` emits a sum of ``x`` over mesh axis ``axis``
            and returns its result.
        coord: ``coord(axis)``, this device's coordinate along mesh axis ``axis`` (a node:
            a 1-element int64 tensor); ``None`` where the caller has no mesh coordinate.
        group: ``group(axis)``, the process-group name of mesh axis ``axis`` (what
            ``_c10d_functional`` collectives take); ``group(None)``, the world's where the
            mesh's devices are the world's ranks in row-major order (else ``None``); ``None``
            likewise.
    """

    node: fx.Node
    args: tuple
    kwargs: dict
    in_shapes: Sequence[tuple[int, ...]]
    out_shapes: Sequence[tuple[int, ...]]
    input_specs: Sequence[Spec]
    output_specs: Sequence[Spec]
    mesh_shape: tuple[int, ...]
    graph: fx.Graph
    all_reduce: Callable[[fx.Node, int], fx.Node]
    coord: Callable[[int], fx.Node] | None = None
    group: Callable[[int | None], str | None] | None = None

    def call(self, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        """Emit ``target(*args, **kwargs)``, tagged with the traced node's module path."""
        new = self.graph.call_function(target, tuple(args), kwargs or {})
        new.meta = {k: v for k, v in self.node.meta.items() if k in ("nn_module_stack", "stack_trace")}
        return new

    def emit(self, target=None, args: tuple | None = None, kwargs: dict | None = None) -> fx.Node:
        """Emit the op (or ``target``) on this call's arguments, or on those given."""
        return self.call(target or self.node.target, self.args if args is None else args,
                         self.kwargs if kwargs is None else kwargs)

    def bound(self) -> dict[str, Any]:
        """The local arguments by schema name (:func:`~autoparallel.graph.bind_args`)."""
        return bind_args(self.node.target, self.args, self.kwargs)

    def with_arg(self, name: str, value) -> tuple[tuple, dict]:
        """``(args, kwargs)`` with argument ``name`` set to ``value``: where the call passed
        it (position or keyword), else as a keyword."""
        pos = [a.name for a in self.node.target._schema.arguments if not a.kwarg_only]
        if name in pos and pos.index(name) < len(self.args):
            i = pos.index(name)
            return self.args[:i] + (value,) + self.args[i + 1:], self.kwargs
        return self.args, {**self.kwargs, name: value}

    def local_out_shape(self, i: int = 0) -> tuple[int, ...]:
        """Per-device shape of output ``i``."""
        return local_shape(self.out_shapes[i], self.output_specs[i], self.mesh_shape)

    def pieces(self, i: int, dim: int) -> int:
        """Into how many pieces dim ``dim`` of tensor input ``i`` is split."""
        return num_shards(self.input_specs[i], dim, self.mesh_shape)

    def all_reduce_max(self, x: fx.Node, axis: int) -> fx.Node:
        """Emit an elementwise maximum of ``x`` over mesh axis ``axis`` (a
        ``_c10d_functional.all_reduce`` with op ``"max"``, then its wait); its result."""
        c10d = torch.ops._c10d_functional
        return self.call(c10d.wait_tensor.default, (self.call(c10d.all_reduce.default, (x, "max", self.group(axis))),))

    def first_row(self, i: int, dim: int) -> fx.Node:
        """The global index of the first row of this device's piece of dim ``dim`` of tensor
        input ``i`` (a 1-element int64 tensor): the piece number (the mesh axes splitting the
        dim, ascending, count as digits, the first the most significant, as DTensor nests
        them) times the rows of a full piece, ``piece_length(size, pieces, unit)``: every
        piece before this one is full, as ``torch.chunk`` cuts (``ceil(size / pieces)`` rows,
        or whole units of a :class:`~autoparallel.placement.UnitShard`: 25 heads of 8 on 2
        devices start at rows 0 and 104)."""
        size, n = self.in_shapes[i][dim], self.pieces(i, dim)
        unit = dim_unit(self.input_specs[i], dim)
        index = None
        for a in shard_axes(self.input_specs[i], dim):
            c = self.coord(a)
            index = c if index is None else self.call(torch.ops.aten.add.Tensor, (
                self.call(torch.ops.aten.mul.Tensor, (index, self.mesh_shape[a])), c))
        return self.call(torch.ops.aten.mul.Tensor, (index, piece_length(size, n, unit)))


@dataclass(frozen=True)
class OpRecord:
    """What the pipeline knows about one op (module docstring)."""

    rule: Callable
    local: Callable[[LocalCall], fx.Node] | None = None
    cost: Callable[[fx.Node, Any, Any], float] | None = None
    saved: Callable[[fx.Node], list[tuple[tuple[int, ...], torch.dtype]]] | None = None
    load: Callable[[fx.Node, Any, tuple, Any], float] | None = None


RECORDS: dict[object, OpRecord] = {}
"""ATen overload, or the name of a library's op (:func:`record`), → its record."""


def record(*ops, local: Callable | None = None, cost: Callable | None = None, saved: Callable | None = None,
           load: Callable | None = None):
    """Decorator: register the decorated rule, with ``local``, ``cost``, ``saved`` and ``load``, for every op in
    ``ops``: ATen overloads, or the name (``str`` of the overload, as the coverage report
    prints it: ``"transformers.grouped_mm_fallback.default"``) of an op that a library
    defines with ``torch.library`` when it is imported, so that the overload does not exist
    when this package is. Returns the rule unchanged."""

    def deco(fn):
        for op in ops:
            RECORDS[op] = OpRecord(fn, local, cost, saved, load)
        return fn
    return deco


def record_of(op) -> OpRecord | None:
    """The op's own record (under the overload, else under its name for a library's op),
    ``None`` when it has none."""
    found = RECORDS.get(op)
    if found is None and isinstance(op, torch._ops.OpOverload) and op.namespace != "aten":
        found = RECORDS.get(str(op))
    return found


def is_pointwise(op) -> bool:
    """Torch tags the op elementwise (``torch.Tag.pointwise``: every output element depends
    only on the input elements at its own index, after broadcasting)."""
    return torch.Tag.pointwise in getattr(op, "tags", ())
