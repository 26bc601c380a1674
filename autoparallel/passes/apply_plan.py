"""Apply a Plan to the traced graph: the per-device graph with collectives.

The result computes on local shards. Its inputs are ``mesh_coord`` (this device's
coordinate on each mesh axis, an int64 tensor) and the flattened user inputs: at global
shape, placed replicated, under ``plan.inputs == "global"``; under ``"local"`` each is this
rank's own batch, the local shard of the global batch in the placeholder's planned placement
(dim 0 split along every mesh axis), taken as it is: a consumer that needs it otherwise gets
the redistribution the plan prices (an all-gather, an all-to-all), like any other value. Parameters and buffers are read with ``get_attr`` (DTensors) and turned into local
shards by :func:`~autoparallel.runtime_kernels.param_local`; gradients of parameters
replicated along mesh axes are all-reduced in buckets during the backward
(:func:`~autoparallel.runtime_kernels.reduce_grads_in_bucket`). Every redistribution of the plan
becomes a straight line of ops: ``_c10d_functional`` collectives followed by
``wait_tensor``, or a local chunk selected by the device's mesh coordinate; one per
(value, target placement), shared by the value's consumers; under a mixed-precision policy
whose reduce dtype is not the gathered one, the all-gathers of a parameter's cast go through
:func:`~autoparallel.runtime_kernels.param_all_gather` instead, so that the gradient is
reduce-scattered in the reduce dtype (:meth:`_PerDeviceGraph.gathered_param`). The capture
device becomes the run device, and an op whose local form differs from the captured one (a
shape argument, a mean over a split dim, ...) is emitted by its record's ``local`` hook
(:mod:`autoparallel.strategies.records`).

The emitted graph is meant to be read (``print(pmodel.graph_module.code)``): every value
of the captured graph keeps its node name, so the code and the plan table agree; the local
shard of a parameter is named after its fully qualified name; process groups are members
of an enum named after the mesh axes (``Group.tp``); and each redistribution and each
rewritten op carries ``node.meta["comment"]`` (module path, placements per mesh axis),
which :class:`~autoparallel.codegen.code.CommentedCode` prints above it.
"""

from __future__ import annotations

import builtins
import enum
import keyword
import math
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .. import precision, units
from ..graph import output_leaves, tensor_inputs
from ..placement import (R, Spec, chunk_length, dim_unit, local_shape, named_placement, piece_length, shard_axes,
                         uneven_dims)
from ..plan import Move, Plan
from ..runtime_kernels import local_piece, onto_device, param_all_gather, param_local, reduce_grads_in_bucket, returned
from ..strategies.records import LocalCall, record_of
from .grad_buckets import DEFAULT_BUCKET_CAP_BYTES, grad_buckets

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_FX_GLOBALS = {"torch", "device", "inf", "nan", "math", "fx_pytree", "pytree", "NoneType", "Group"}  # bound by fx


def process_groups(axis_names, group_names: list[str]) -> list[enum.Enum]:
    """The c10d process-group name of each mesh axis as a member of a ``str`` enum ``Group``
    whose member names are the axis names: collectives take it where they take the group's
    name (it is that string), and the emitted code reads ``Group.tp`` instead of ``'3'``.
    Axis names that are not Python identifiers are made into ones."""
    names: list[str] = []
    for a, axis in enumerate(axis_names):
        name = re.sub(r"\W", "_", str(axis))
        if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_") \
                or name in ("name", "value") or name in names:
            name = f"axis{a}"
        names.append(name)
    group = enum.StrEnum("Group", list(zip(names, group_names)), module=__name__)
    return [group[n] for n in names]


def placements_str(spec: Spec, axis_names) -> str:
    """One placement per mesh axis, named: ``S<dim>(<axis>)``, ``P(<axis>)`` or ``R``, e.g.
    ``S0(dp) S2(tp)`` (DTensor's order, not the plan table's one token per tensor dim)."""
    return " ".join(named_placement(p, axis) for p, axis in zip(spec, axis_names))


def _spec_tag(spec: Spec, axis_names) -> str:
    """:func:`placements_str` as part of a name: ``replicated``, or e.g. ``s0dp_s2tp``."""
    if all(p == R for p in spec):
        return "replicated"
    return "_".join(re.sub(r"\W", "", t.lower()) for t in placements_str(spec, axis_names).split())


@dataclass
class _Pieces:
    """A collective's result whose ``n`` pieces (``rows`` rows each, along dim 0) are not yet
    joined along dim ``dim``: kept so while the next move can take them as they are."""

    node: fx.Node
    dim: int
    n: int
    rows: int
    gathered: bool  # all-gathered: the pieces of ``dim`` along the mesh axes after the next one out


class _Emitter:
    """Emits redistributions (:meth:`redistribute`) into ``graph``.

    Args:
        graph: the per-device graph being built.
        coord: its ``mesh_coord`` placeholder.
        plan: the plan (its mesh gives the axis sizes).
        groups: the process group of each mesh axis (:func:`process_groups`).
        names: emitted node → preferred name, filled for the mesh-coordinate nodes.
    """

    def __init__(self, graph: fx.Graph, coord: fx.Node, plan: Plan, groups: list, names=None):
        self.g = graph
        self.coord = coord
        self.groups = groups
        self.mesh_shape = plan.mesh.shape
        self.axis_names = [g.name for g in groups]
        self.names: dict[fx.Node, str] = {} if names is None else names
        self._coord_axis: dict[int, fx.Node] = {}
        self._first: dict[int, fx.Node] = {}

    def call(self, target, *args):
        return self.g.call_function(target, tuple(args))

    def wait(self, x):
        return self.call(c10d.wait_tensor.default, x)

    def coord_of(self, a: int) -> fx.Node:
        """This device's coordinate along mesh axis ``a`` (a 1-element tensor)."""
        if a not in self._coord_axis:
            self._coord_axis[a] = self.call(aten.slice.Tensor, self.coord, 0, a, a + 1)
            self.names[self._coord_axis[a]] = f"coord_{self.axis_names[a]}"
        return self._coord_axis[a]

    def first_of(self, a: int) -> fx.Node:
        """Whether this device is the first along mesh axis ``a`` (a 0-d bool tensor)."""
        if a not in self._first:
            self._first[a] = self.call(aten.eq.Scalar, self.call(aten.select.int, self.coord, 0, a), 0)
            self.names[self._first[a]] = f"first_{self.axis_names[a]}"
        return self._first[a]

    def redistribute(self, x: fx.Node, shape, spec: Spec, moves: list[Move]) -> fx.Node:
        """Emit ``moves`` redistributing ``x`` (global ``shape``, current ``spec``).

        Every collective leaves its result in contiguous (row-major) memory, as the value is
        on one device, so that any consumer (a ``view``, a value returned to the user) takes it
        as it is. A collective works along dim 0; a move along another dim ``d`` brings the
        ``n`` pieces of ``d`` to the front before it (``unflatten`` → ``movedim`` → one copy)
        and puts them back after it, each side one copy at most and none for dim 0. Pieces a
        collective leaves at the front stay there while the next move takes them so: an
        all-gather of the same dim along the next mesh axis out (one join for both), or a
        move that would bring the same pieces to the front again (no join at all)."""
        for m in moves:
            x = self.move(x, shape, spec, m)
            spec = m.applied_to(spec)
        return self.joined(x)

    def move(self, x, shape, spec: Spec, m: Move):
        """One move; ``x`` and the result are nodes or :class:`_Pieces`."""
        a, n, grp = m.axis, self.mesh_shape[m.axis], self.groups[m.axis]
        loc = local_shape(shape, spec, self.mesh_shape)
        if m.kind in ("all_gather", "slice", "reduce_scatter") and \
                shape[m.src_dim if m.dst_dim is None else m.dst_dim] % (n * self.unit(spec, m)):
            return self.uneven_move(self.joined(x), shape, spec, loc, m)
        if m.kind == "all_gather":
            if isinstance(x, _Pieces) and x.gathered and x.dim == m.src_dim and max(shard_axes(spec, x.dim)) == a:
                y = self.wait(self.call(c10d.all_gather_into_tensor.default, x.node, n, grp))
                return _Pieces(y, x.dim, n * x.n, x.rows, True)
            t = self.contiguous(self.joined(x))
            y = self.wait(self.call(c10d.all_gather_into_tensor.default, t, n, grp))
            return _Pieces(y, m.src_dim, n, self.rows(t, shape, spec), True) if m.src_dim else y
        if m.kind == "reduce_scatter":
            t = self.pieces_front(x, m.dst_dim, n, loc)
            return self.wait(self.call(c10d.reduce_scatter_tensor.default, t, "sum", n, grp))
        if m.kind == "all_reduce":
            return self.wait(self.call(c10d.all_reduce.default, self.contiguous(self.joined(x)), "sum", grp))
        if m.kind == "all_to_all":
            d, d2 = m.src_dim, m.dst_dim
            rows = (loc[0] // n) if d2 == 0 else loc[0]  # dim 0 of one piece
            t = self.pieces_front(x, d2, n, loc)
            y = self.wait(self.call(c10d.all_to_all_single.default, t, [rows] * n, [rows] * n, grp))
            return _Pieces(y, d, n, rows, False) if d else y
        if m.kind == "slice":
            d = m.dst_dim
            return self.call(local_piece, self.joined(x), d, n, self.coord_of(a))
        if m.kind == "mask":  # 0-d factor: the product keeps x's shape, a 0-d x included
            return self.call(aten.mul.Tensor, self.joined(x), self.first_of(a))
        raise ValueError(f"unknown move {m.kind}")

    def rows(self, x: fx.Node, shape, spec: Spec):
        """The size of dim 0 of ``x`` (global ``shape`` under ``spec``): an int, or, when dim 0
        is split unevenly, a node reading it from ``x`` (it differs between devices)."""
        if 0 in uneven_dims(shape, spec, self.mesh_shape):
            return self.call(aten.sym_size.int, x, 0)
        return local_shape(shape, spec, self.mesh_shape)[0]

    @staticmethod
    def unit(spec: Spec, m: Move) -> int:
        """Rows per unit of the cut move ``m`` makes (a slice, reduce-scatter) or undoes (an
        all-gather of ``spec``); 1 for other moves."""
        return dim_unit(spec, m.src_dim) if m.kind == "all_gather" else m.unit

    def uneven_move(self, x: fx.Node, shape, spec: Spec, loc, m: Move) -> fx.Node:
        """A move into or out of a dim split unevenly along axis ``m.axis`` (the only axis that
        splits it; :mod:`autoparallel.placement`, "Uneven splits" and "Splits in units"), exact
        through padding: with ``c`` rows per piece (``ceil(s / n)``, or ``unit · ceil(s / unit /
        n)`` for a cut in units), an all-gather pads each device's piece to ``c`` rows,
        gathers and keeps the first ``s`` rows (the pads sit after the last real row, as the
        first pieces are full); a slice or reduce-scatter pads the whole dim to ``n·c``, takes
        this device's ``c`` rows and narrows them to the device's row count
        (:func:`~autoparallel.placement.chunk_length`, rank-dependent without rank-dependent
        Python). The pads' gradients are dropped by the backward of pad and narrow."""
        a, n, grp = m.axis, self.mesh_shape[m.axis], self.groups[m.axis]
        d = m.src_dim if m.kind == "all_gather" else m.dst_dim
        s, ndim, unit = shape[d], len(shape), self.unit(spec, m)
        c = piece_length(s, n, unit)
        if m.kind == "all_gather":
            short = self.call(operator.sub, c, self.call(aten.sym_size.int, x, d))
            padded = self.call(aten.contiguous.default, self.pad(x, d, ndim, short))
            y = self.wait(self.call(c10d.all_gather_into_tensor.default, padded, n, grp))
            if d == 0:
                return self.call(aten.narrow.default, y, 0, 0, s)
            y = self.joined(_Pieces(y, d, n, self.rows(padded, shape, spec), True))
            return self.copy(self.call(aten.narrow.default, y, d, 0, s))
        x = self.pad(x, d, ndim, n * c - s)
        if m.kind == "slice":
            y = self.call(local_piece, x, d, n, self.coord_of(a))
        else:
            full = loc[:d] + (n * c,) + loc[d + 1:]
            y = self.wait(self.call(c10d.reduce_scatter_tensor.default, self.pieces_front(x, d, n, full), "sum", n,
                                    grp))
        length = self.call(chunk_length, self.coord, a, s, n, *((unit,) if unit > 1 else ()))
        y = self.call(aten.narrow.default, y, d, 0, length)
        return self.copy(y) if d else y

    def copy(self, x: fx.Node) -> fx.Node:
        """A contiguous copy of ``x``, whose strides may differ between devices: under
        ``LocalTensorMode``, ``contiguous()`` left the narrowed piece of a shorter rank strided."""
        return self.g.call_function(aten.clone.default, (x,), {"memory_format": torch.contiguous_format})

    def pad(self, x: fx.Node, d: int, ndim: int, rows) -> fx.Node:
        """``x`` with ``rows`` zero rows (an int or a node) appended along dim ``d``."""
        return self.call(aten.constant_pad_nd.default, x, [0, 0] * (ndim - 1 - d) + [0, rows])

    def contiguous(self, x: fx.Node) -> fx.Node:
        """``x`` in contiguous memory (a collective's result already is)."""
        if x.target is c10d.wait_tensor.default:
            return x
        return self.call(aten.contiguous.default, x)

    def pieces_front(self, x, d: int, n: int, loc) -> fx.Node:
        """``x`` (local shape ``loc``) with the ``n`` pieces of dim ``d`` one after the other
        along dim 0, each piece contiguous: the input of a collective that sends piece ``i``
        to the ``i``-th device of the group."""
        if isinstance(x, _Pieces) and x.dim == d and x.n == n:
            return x.node  # the pieces of the last collective, not joined
        x = self.joined(x)
        if d == 0:
            return self.contiguous(x)
        u = self.call(aten.movedim.int, self.call(aten.unflatten.int, x, d, [n, loc[d] // n]), d, 0)
        return self.call(aten.flatten.using_ints, self.contiguous(u), 0, 1)

    def joined(self, x) -> fx.Node:
        """``x`` as a node: the pieces of a :class:`_Pieces` joined along its dim in order (the
        ``i``-th from the ``i``-th device of the group; one copy)."""
        if not isinstance(x, _Pieces):
            return x
        u = self.call(aten.movedim.int, self.call(aten.unflatten.int, x.node, 0, [x.n, x.rows]), 0, x.dim)
        if isinstance(x.rows, fx.Node):  # rows differ by device: the copy made explicit (flatten's
            u = self.copy(u)             # own falls back to a view under LocalTensorMode and fails)
        return self.call(aten.flatten.using_ints, u, x.dim, x.dim + 1)


def _replace_device(v, traced_on: str, device: str):
    if isinstance(v, torch.device) and v.type == traced_on:
        return torch.device(device)
    return v


def _tail(graph: fx.Graph) -> fx.Node:
    """The last node of ``graph`` (which holds at least ``mesh_coord``)."""
    return next(iter(reversed(graph.nodes)))


class _PerDeviceGraph:
    """The steps of :func:`apply_plan`; one instance per call (arguments as there)."""

    def __init__(self, gm: fx.GraphModule, plan: Plan, group_names: list[str], device: str,
                 param_targets: set[str], world_size: int, traced_on: str, bucket_cap_bytes: int,
                 offloaded: frozenset[str], stage_of: dict[str, int] | None, world_group: str | None):
        self.gm, self.plan, self.device, self.traced_on = gm, plan, device, traced_on
        self.world_group = world_group
        self.stage_of = stage_of
        self.offloaded = offloaded
        self.bucket_cap_bytes = bucket_cap_bytes
        self.param_targets, self.world_size = param_targets, world_size
        self.graph = fx.Graph()
        self.names: dict[fx.Node, str] = {}  # emitted node → preferred name (:func:`_named_copy`)
        self.groups = group_names if all(isinstance(g, enum.Enum) for g in group_names) else \
            process_groups([f"axis{a}" for a in range(len(group_names))], group_names)
        self.axis_names = [g.name for g in self.groups]
        self.em = _Emitter(self.graph, self.graph.placeholder("mesh_coord"), plan, self.groups, self.names)
        self.env: dict[fx.Node, fx.Node] = {}
        self.by_input = {(c.dst, c.arg): c for c in plan.redistributions}
        self.done: dict[tuple[fx.Node, Spec], fx.Node] = {}  # (value, target spec) → redistributed
        self.reduce_in = precision.reduce_dtype(plan.mp_policy)  # parameter gradients' reduction dtype

    def comment(self, since: fx.Node, text: str) -> None:
        """Attach ``text`` to the first node emitted after ``since``, if any."""
        if since.next.op != "root":
            since.next.meta["comment"] = text

    def parameters(self) -> None:
        """Parameters and buffers: their local shards; the parameters replicated along mesh
        axes are read through their gradient bucket (:func:`grad_buckets`, emitted by
        :meth:`buckets_read_by` before the first op that reads one of its parameters), whose
        backward all-reduces their gradients while the backward goes on."""
        attrs = {}
        for node in self.gm.graph.nodes:
            if node.op != "get_attr":
                continue
            attrs[node] = attr = self.graph.get_attr(node.target)
            if node.target not in self.param_targets:
                self.env[node] = attr
                continue
            self.names[attr] = f"{node.name}_dtensor"
            self.env[node] = self.graph.call_function(param_local, (attr,))
            if node.target in self.offloaded:  # held in host memory: its shard copied to the device
                self.env[node] = self.graph.call_function(onto_device, (self.env[node], self.device))
        self.attrs = attrs
        self.bucket_of = {m: b for b in grad_buckets(self.gm, self.plan, self.param_targets, self.bucket_cap_bytes,
                                                     self.stage_of) for m in b.members}

    def buckets_read_by(self, node: fx.Node) -> None:
        """Emit the gradient bucket of each parameter ``node`` reads that is not emitted yet.
        The autograd engine runs the ready backward node created last first, so a bucket
        created ahead of the whole forward ran its all-reduce after the whole backward (and held
        every whole gradient of a ZeRO-2 bucket until then); created just before its first
        reader, it runs as soon as its gradients exist, before the earlier layers' backward."""
        pending = []
        for a in node.all_input_nodes:
            b = self.bucket_of.get(a)
            if b is not None and all(b is not p for p in pending):
                pending.append(b)
        for b in pending:
            for m in b.members:
                del self.bucket_of[m]
            groups = tuple(self.groups[a] for a in b.axes)
            since = _tail(self.graph)
            members = [self.attrs[m] for m in b.members]
            cast = b.dtype != b.members[0].meta["val"].dtype  # reduced in a mixed-precision policy's dtype
            kwargs = ({"reduce_dtype": b.dtype} if cast else {}) | ({"scatter": True} if b.scatter else {})
            bucket = self.graph.call_function(reduce_grads_in_bucket, (groups, *members), kwargs)
            how = "reduce-scattered onto their optimizer shards" if b.scatter else "all-reduced"
            self.comment(since, f"gradients of these {len(b.members)} parameters ({units.nbytes(b.nbytes)}"
                                f"{f' in {b.dtype}' if cast else ''}): {how} over "
                                f"{', '.join(g.name for g in groups)} during the backward")
            for i, m in enumerate(b.members):
                self.env[m] = self.graph.call_function(operator.getitem, (bucket, i))

    def redistributed(self, dst: str, j: int, x: fx.Node) -> fx.Node:
        """Input ``j`` of node ``dst`` (``"output"``: returned value ``j``): ``x``
        redistributed as the plan says, once per (value, target spec)."""
        c = self.by_input.get((dst, j))
        if c is None:
            return self.env[x]
        src = self.plan.nodes[x.name].output_specs[0]
        target = src
        for m in c.moves:
            target = m.applied_to(target)
        key = (x, target)
        if key not in self.done:
            module = self.plan.nodes[dst].module_path if dst in self.plan.nodes else "output"
            names = self.axis_names
            what = (f"{module + ': ' if module else ''}redistribute {x.name} {placements_str(src, names)} -> "
                    f"{placements_str(target, names)}")
            since = _tail(self.graph)
            view = self.replicated_view(x, target)
            if view is not None:
                view.meta["comment"] = f"{what}, a view of {x.args[0].name} redistributed"
                self.done[key] = view
            elif (cast := precision.gathered_cast(x, self.reduce_in)) is not None and \
                    any(m.kind == "all_gather" for m in c.moves):
                self.done[key] = self.gathered_param(x, cast, c.shape, src, c.moves)
                self.comment(since, f"{what}; the gradient reduce-scattered in {self.reduce_in}")
            else:
                self.done[key] = self.em.redistribute(self.env[x], c.shape, src, c.moves)
                self.comment(since, what)
            self.names.setdefault(self.done[key], f"{x.name}_{_spec_tag(target, names)}")
        return self.done[key]

    def gathered_param(self, x: fx.Node, cast: fx.Node, shape, spec: Spec, moves: list[Move]) -> fx.Node:
        """``x``, the mixed-precision policy's cast of a parameter or a view of it
        (:func:`~autoparallel.precision.gathered_cast`), redistributed by ``moves``: each run
        of all-gathers through :func:`~autoparallel.runtime_kernels.param_all_gather`, whose
        backward reduce-scatters in the policy's reduce dtype, the other moves as
        :meth:`_Emitter.move` emits them. When ``x`` is the cast and only slices come before
        the first all-gather, the kernel takes the parameter's own (fp32) shard, as the cast
        reads it, and casts it itself, so that the reduced fp32 gradient reaches the parameter
        unrounded (the cast then has no use left and is dropped); else it takes ``x`` as it is
        and autograd rounds the reduced gradient to ``x``'s dtype once."""
        first = next(i for i, m in enumerate(moves) if m.kind == "all_gather")
        cp = self.plan.nodes[cast.name]
        own = x is cast and cp.input_specs[0] == cp.output_specs[0] and all(m.kind == "slice" for m in moves[:first])
        if own:  # the parameter as the cast reads it (its shard, or a slice the plan takes of it)
            value, dtype = self.redistributed(cast.name, 0, cast.args[0]), x.meta["val"].dtype
        else:
            value, dtype = self.env[x], None
        i = 0
        while i < len(moves):
            if moves[i].kind != "all_gather":
                value = self.em.move(value, shape, spec, moves[i])
                spec = moves[i].applied_to(spec)
                i += 1
                continue
            steps = []
            while i < len(moves) and moves[i].kind == "all_gather":
                steps.append(self.gather_step(shape, spec, moves[i]))
                spec = moves[i].applied_to(spec)
                i += 1
            value = self.graph.call_function(param_all_gather, (self.em.joined(value), steps),
                                             {"dtype": dtype, "reduce_dtype": self.reduce_in})
            dtype = None  # gathered in the policy's dtype by now
        return self.em.joined(value)

    def gather_step(self, shape, spec: Spec, m: Move) -> tuple:
        """The :func:`~autoparallel.runtime_kernels.param_all_gather` step of all-gather ``m``
        (global ``shape``, current ``spec``): ``(group, n, dim, rows per piece, rows after)``,
        the pieces padded as :meth:`_Emitter.uneven_move` pads them when the split is uneven."""
        n, d = self.plan.mesh.shape[m.axis], m.src_dim
        unit = dim_unit(spec, d)
        if shape[d] % (n * unit):
            return self.groups[m.axis], n, d, piece_length(shape[d], n, unit), shape[d]
        rows = local_shape(shape, spec, self.plan.mesh.shape)[d]
        return self.groups[m.axis], n, d, rows, n * rows

    def replicated_view(self, x: fx.Node, target: Spec) -> fx.Node | None:
        """When ``x`` (to be replicated) is a view of a value the plan replicates too, the view
        of that replicated value (the logits and their flattened view for the loss: one
        all-gather, not two); else ``None``."""
        if x.target not in _VIEWS or any(p != R for p in target) or not isinstance(x.args[0], fx.Node):
            return None
        base = x.args[0]
        for c in self.plan.redistributions:
            if c.src == base.name and c.src_index == 0 and c.dst != x.name:
                spec = self.plan.nodes[base.name].output_specs[0]
                for m in c.moves:
                    spec = m.applied_to(spec)
                if all(p == R for p in spec):
                    y = self.redistributed(c.dst, c.arg, base)
                    return self.em.call(aten.reshape.default, y, list(self.plan.nodes[x.name].out_shapes[0]))
        return None

    def op(self, node: fx.Node) -> None:
        """A ``call_function`` node on local shards: its inputs redistributed, then the op (or
        its record's local form, commented when it differs from the captured call)."""
        np_ = self.plan.nodes[node.name]
        self.buckets_read_by(node)
        leaves, tree = pytree.tree_flatten((node.args, node.kwargs))
        leaves = [self.env[x] if isinstance(x, fx.Node) else _replace_device(x, self.traced_on, self.device)
                  for x in leaves]
        for j, (li, x) in enumerate(tensor_inputs(node)):
            leaves[li] = self.redistributed(node.name, j, x)
        args, kwargs = pytree.tree_unflatten(leaves, tree)
        em = self.em
        call = LocalCall(node, tuple(args), kwargs, np_.in_shapes, np_.out_shapes, np_.input_specs,
                         np_.output_specs, self.plan.mesh.shape, self.graph, lambda x, a: em.wait(
                             em.call(c10d.all_reduce.default, x, "sum", em.groups[a])),
                         coord=em.coord_of, group=lambda a: self.world_group if a is None else em.groups[a])
        record = record_of(node.target)
        since = _tail(self.graph)
        self.env[node] = record.local(call) if record is not None and record.local is not None else call.emit()
        split = any(p != R for spec in (*np_.input_specs, *np_.output_specs) for p in spec)
        if split and _rewritten(since, self.env[node], node.target, leaves):
            names = self.axis_names
            ins = ", ".join(placements_str(s, names) for s in np_.input_specs)
            outs = ", ".join(placements_str(s, names) for s in np_.output_specs)
            self.comment(since, f"{np_.module_path + ': ' if np_.module_path else ''}{ins} -> {outs}")

    def output(self, node: fx.Node) -> None:
        """The returned values, each redistributed as the plan says (to the placements
        :func:`~autoparallel.plan.returned_spec` gives), a floating one through
        :func:`returned` with the number of devices that hold it whole (its gradient is
        seeded in full on each). The output node's ``meta["returned"]`` holds, per flat
        output, ``(placements, global shape)`` of a value returned sharded, else ``None``."""
        self.buckets_read_by(node)
        leaves = output_leaves(node)
        outs, returned_as, j = [], [], 0  # j: index among the returned tensors (output_leaves)
        for x in pytree.tree_leaves(node.args[0]):
            if j >= len(leaves) or x is not leaves[j]:
                outs.append(self.env[x] if isinstance(x, fx.Node) else x)
                returned_as.append(None)
                continue
            y = self.redistributed("output", j, x)
            spec = self.returned_spec(j, x)
            if x.meta["val"].dtype.is_floating_point:
                copies = math.prod(n for n, p in zip(self.plan.mesh.shape, spec) if p == R)
                y = self.graph.call_function(returned, (y, copies))
            outs.append(y)
            returned_as.append(None if all(p == R for p in spec) else (spec, tuple(x.meta["val"].shape)))
            j += 1
        self.graph.output(tuple(outs)).meta["returned"] = returned_as

    def returned_spec(self, j: int, x: fx.Node) -> Spec:
        """The placements returned value ``j`` (node ``x``) has after its redistribution."""
        spec = self.plan.nodes[x.name].output_specs[0]
        c = self.by_input.get(("output", j))
        for m in c.moves if c is not None else ():
            spec = m.applied_to(spec)
        return spec

    def build(self) -> fx.Graph:
        """Parameters, then every traced node in order, then names (:func:`_named_copy`)."""
        self.parameters()
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node] = self.graph.placeholder(node.name)
            elif node.op == "call_function":
                self.op(node)
            elif node.op == "output":
                self.output(node)
        self.graph.eliminate_dead_code()
        _tag_sources(self.graph, self.env)
        graph = _named_copy(self.graph, self.env, self.names, {n.name for n in self.gm.graph.nodes})
        graph.lint()
        return graph


def _rewritten(since: fx.Node, value: fx.Node, target, leaves: list) -> bool:
    """Whether the nodes emitted after ``since`` for an op (its value ``value``) are other than
    one call of ``target`` on the arguments ``leaves``."""
    if since.next is not value or value.target != target:
        return True
    now = pytree.tree_leaves((value.args, value.kwargs))
    return len(now) != len(leaves) or any(a is not b and (type(a) is not type(b) or isinstance(a, torch.Tensor)
                                                          or a != b) for a, b in zip(now, leaves))


def _named_copy(graph: fx.Graph, env: dict[fx.Node, fx.Node], preferred: dict[fx.Node, str],
                reserved: set[str]) -> fx.Graph:
    """``graph`` copied with readable names: the value of every traced node is named as that
    node (so the code and the plan table agree), other nodes by ``preferred`` or their op,
    made unique without taking a traced node's name or a Python builtin's."""
    final = {}
    for traced, v in env.items():
        if isinstance(v, fx.Node) and v not in final:
            final[v] = traced.name
    taken = set(reserved) | set(final.values())
    counts: dict[str, int] = {}
    new = fx.Graph()
    copies: dict[fx.Node, fx.Node] = {}
    for n in graph.nodes:
        name = final.get(n)
        if name is None:
            base = preferred.get(n) or _op_name(n)
            name, i = base, counts.get(base, 0)
            while name in taken or keyword.iskeyword(name) or hasattr(builtins, name) or name in _FX_GLOBALS:
                i += 1
                name = f"{base}_{i}"
            counts[base] = i
            taken.add(name)
        args = fx.map_arg(n.args, copies.__getitem__)
        kwargs = fx.map_arg(n.kwargs, copies.__getitem__)
        copies[n] = new.create_node(n.op, n.target, args, kwargs, name=name if n.op != "output" else None,
                                    type_expr=n.type)
        copies[n].meta = dict(n.meta)
    return new


def _op_name(n: fx.Node) -> str:
    """A node's name from what it does: ``all_gather_into_tensor``, ``param_local``, ..."""
    if n.op in ("placeholder", "output"):
        return n.name
    if n.op == "get_attr":
        return n.target.replace(".", "_")
    return getattr(n.target, "_opname", None) or getattr(n.target, "__name__", None) or n.name


def apply_plan(gm: fx.GraphModule, plan: Plan, group_names: list[str], device: str,
               param_targets: set[str], world_size: int, traced_on: str = "meta",
               bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES, offloaded: frozenset[str] = frozenset(),
               stage_of: dict[str, int] | None = None, world_group: str | None = None) -> fx.Graph:
    """Build the per-device graph for ``plan`` (module docstring).

    Args:
        gm: the traced graph the plan was made for.
        plan: the plan (node names must match ``gm``).
        group_names: the process group of each mesh axis: :func:`process_groups` members, printed
            by mesh-axis name (``Group.tp``), or plain c10d group names (``Group.axis1``).
        device: device type the module runs on (e.g. ``"cpu"``, ``"cuda"``).
        param_targets: ``get_attr`` targets that are parameters or buffers (DTensors).
        world_size: number of devices in the mesh.
        traced_on: device type the graph was captured on; its ``device=`` arguments move to ``device``.
        bucket_cap_bytes: the largest gradient bucket in bytes per device (:func:`grad_buckets`).
        offloaded: ``get_attr`` targets of parameters held in host memory (``plan.offloaded``):
            their shards are copied to ``device`` where read (:func:`~autoparallel.runtime_kernels.onto_device`).
        stage_of: traced node name → pipeline stage of a pipelined plan (gradient buckets
            then hold one stage's parameters each).
        world_group: the world's process group where the mesh's devices are the world's ranks
            in row-major order (one collective over it spans every mesh axis at once, in mesh
            order), else ``None``.

    Raises:
        KeyError: when the plan does not describe a node of ``gm``.
    """
    return _PerDeviceGraph(gm, plan, group_names, device, param_targets, world_size, traced_on,
                           bucket_cap_bytes, offloaded, stage_of, world_group).build()


def _tag_sources(graph: fx.Graph, env: dict[fx.Node, fx.Node]) -> None:
    """``meta["source"]``: the traced node each emitted node was emitted for. A traced
    node's value is the last node emitted for it (its input redistributions come first), so
    walking backwards, every node belongs to the next value in graph order."""
    origin = {v: k.name for k, v in env.items() if isinstance(v, fx.Node)}
    current = None
    for n in reversed(graph.nodes):
        if n.op == "output":
            continue
        current = origin.get(n, current)
        if current is not None:
            n.meta["source"] = current
