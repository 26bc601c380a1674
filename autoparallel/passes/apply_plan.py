"""Apply a Plan to the traced graph: the per-device graph with collectives.

The result computes on local shards. Its inputs are ``mesh_coord`` (this device's
coordinate on each mesh axis, an int64 tensor) and the flattened user inputs at global
shape. Parameters and buffers are read with ``get_attr`` (DTensors) and turned into local
shards by :func:`~autoparallel.runtime_kernels.param_local`; gradients of parameters
replicated along mesh axes are all-reduced in buckets (:func:`~autoparallel.runtime_kernels.grad_bucket`). Every resharding of the plan
becomes a straight line of ops: ``_c10d_functional`` collectives followed by
``wait_tensor``, or a local chunk selected by the device's mesh coordinate. Shape
arguments of views and expands are rewritten to local shapes, the capture device to the
run device, squeezes to reshapes (a split dim may be 1 locally without being squeezable),
the ``groups`` of a channel-split depthwise convolution to the local count,
and a batch-split ``cross_entropy_loss`` with mean reduction becomes a local sum
divided by the global count of kept targets.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Shard

from ..runtime_kernels import grad_bucket, param_local, returned
from ..placement import P, R, Spec, local_shape, num_shards, partial_axes
from ..plan import Plan
from ..solver.layout import Move
from ..graph import bind_args, op_args, output_leaves, tensor_inputs

aten = torch.ops.aten
c10d = torch.ops._c10d_functional

_CONV_GROUPS_ARG = {aten.conv1d.default: 6, aten.conv2d.default: 6, aten.conv3d.default: 6,
                    aten.convolution.default: 8}
_SQUEEZES = {aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default}
_SHAPE_ARG_OPS = {aten.view.default: 1, aten.reshape.default: 1, aten._unsafe_view.default: 1,
                  aten.expand.default: 1}


class _Emitter:
    def __init__(self, graph: fx.Graph, coord: fx.Node, plan: Plan, group_names: list[str]):
        self.g = graph
        self.coord = coord
        self.plan = plan
        self.groups = group_names
        self.mesh_shape = plan.mesh.shape
        self._coord_axis: dict[int, fx.Node] = {}
        self._first: dict[int, fx.Node] = {}

    def call(self, target, *args):
        return self.g.call_function(target, tuple(args))

    def wait(self, x):
        return self.call(c10d.wait_tensor.default, x)

    def coord_of(self, a: int) -> fx.Node:
        if a not in self._coord_axis:
            self._coord_axis[a] = self.call(aten.slice.Tensor, self.coord, 0, a, a + 1)
        return self._coord_axis[a]

    def emit(self, x: fx.Node, shape, spec: Spec, moves: list[Move]) -> fx.Node:
        """Emit ``moves`` converting ``x`` (global ``shape``, current ``spec``).

        Every collective leaves its result in contiguous (row-major) memory, as the value is
        on one device, so that any consumer (a ``view``, a value returned to the user) takes it
        as it is. A collective works along dim 0; a move along another dim ``d`` brings the
        ``n`` pieces of ``d`` to the front before it (``unflatten`` → ``movedim`` → one copy)
        and puts them back after it, each side one copy at most and none for dim 0."""
        for m in moves:
            a, n, grp = m.axis, self.mesh_shape[m.axis], self.groups[m.axis]
            loc = local_shape(shape, spec, self.mesh_shape)
            if m.kind == "all_gather":
                y = self.wait(self.call(c10d.all_gather_into_tensor.default, self.contiguous(x), n, grp))
                x = self.pieces_back(y, m.src_dim, n, loc[0])
                spec = spec[:a] + (R,) + spec[a + 1:]
            elif m.kind == "reduce_scatter":
                t = self.pieces_front(x, m.dst_dim, n, loc)
                x = self.wait(self.call(c10d.reduce_scatter_tensor.default, t, "sum", n, grp))
                spec = spec[:a] + (Shard(m.dst_dim),) + spec[a + 1:]
            elif m.kind == "all_reduce":
                x = self.wait(self.call(c10d.all_reduce.default, self.contiguous(x), "sum", grp))
                spec = spec[:a] + (R,) + spec[a + 1:]
            elif m.kind == "all_to_all":
                d, d2 = m.src_dim, m.dst_dim
                rows = (loc[0] // n) if d2 == 0 else loc[0]  # dim 0 of one piece
                t = self.pieces_front(x, d2, n, loc)
                y = self.wait(self.call(c10d.all_to_all_single.default, t, [rows] * n, [rows] * n, grp))
                x = self.pieces_back(y, d, n, rows)
                spec = spec[:a] + (Shard(d2),) + spec[a + 1:]
            elif m.kind == "slice":
                d = m.dst_dim
                u = self.call(aten.unflatten.int, x, d, [n, loc[d] // n])
                x = self.call(aten.squeeze.dim, self.call(aten.index_select.default, u, d, self.coord_of(a)), d)
                spec = spec[:a] + (Shard(d),) + spec[a + 1:]
            elif m.kind == "mask":
                if a not in self._first:  # 0-d: the product keeps x's shape, a 0-d x included
                    self._first[a] = self.call(aten.eq.Scalar, self.call(aten.select.int, self.coord, 0, a), 0)
                x = self.call(aten.mul.Tensor, x, self._first[a])
                spec = spec[:a] + (P,) + spec[a + 1:]
            else:
                raise ValueError(f"unknown move {m.kind}")
        return x

    def contiguous(self, x: fx.Node) -> fx.Node:
        return self.call(aten.contiguous.default, x)

    def pieces_front(self, x: fx.Node, d: int, n: int, loc) -> fx.Node:
        """``x`` (local shape ``loc``) with the ``n`` pieces of dim ``d`` one after the other
        along dim 0, each piece contiguous: the input of a collective that sends piece ``i``
        to the ``i``-th device of the group."""
        if d == 0:
            return self.contiguous(x)
        u = self.call(aten.movedim.int, self.call(aten.unflatten.int, x, d, [n, loc[d] // n]), d, 0)
        return self.call(aten.flatten.using_ints, self.contiguous(u), 0, 1)

    def pieces_back(self, y: fx.Node, d: int, n: int, rows: int) -> fx.Node:
        """Inverse of :meth:`pieces_front` on the output of a collective: ``y`` holds ``n``
        pieces of ``rows`` rows along dim 0, the ``i``-th from the ``i``-th device of the
        group; joined along dim ``d`` in that order (one copy unless ``d`` is 0)."""
        if d == 0:
            return y
        u = self.call(aten.movedim.int, self.call(aten.unflatten.int, y, 0, [n, rows]), 0, d)
        return self.call(aten.flatten.using_ints, u, d, d + 1)


def _replace_device(v, traced_on: str, device: str):
    if isinstance(v, torch.device) and v.type == traced_on:
        return torch.device(device)
    return v


def apply_plan(gm: fx.GraphModule, plan: Plan, group_names: list[str], device: str,
               param_targets: set[str], world_size: int, traced_on: str = "meta") -> fx.Graph:
    """Build the per-device graph for ``plan``.

    Args:
        gm: the traced graph the plan was made for.
        plan: the plan (node names must match ``gm``).
        group_names: c10d process-group name of each mesh axis.
        device: device type the module runs on (e.g. ``"cpu"``, ``"cuda"``).
        param_targets: ``get_attr`` targets that are parameters or buffers (DTensors).
        world_size: number of devices in the mesh.
        traced_on: device type the graph was captured on; its ``device=`` arguments move to ``device``.

    Raises:
        KeyError: when the plan does not describe a node of ``gm``.
    """
    graph = fx.Graph()
    coord = graph.placeholder("mesh_coord")
    em = _Emitter(graph, coord, plan, group_names)
    env: dict[fx.Node, fx.Node] = {}
    conv = {(c.dst, c.arg): c for c in plan.conversions}
    converted: dict[tuple, fx.Node] = {}
    ms = plan.mesh.shape

    def fetch(dst_name: str, j: int, x: fx.Node) -> fx.Node:
        """Input ``j`` of ``dst_name``: ``x`` converted as the plan says (shared by consumers)."""
        c = conv.get((dst_name, j))
        if c is None:
            return env[x]
        key = (x, tuple(c.moves))
        if key not in converted:
            converted[key] = em.emit(env[x], c.shape, plan.nodes[x.name].output_specs[0], c.moves)
        return converted[key]

    # parameters and buffers: local shards; gradients bucketed per (mesh axes replicated over, dtype)
    buckets: dict[tuple, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        attr = graph.get_attr(node.target)
        if node.target not in param_targets:
            env[node] = attr
            continue
        env[node] = graph.call_function(param_local, (attr,))
        spec = plan.nodes[node.name].output_specs[0]
        groups = tuple(group_names[a] for a, p in enumerate(spec) if p == R and ms[a] > 1)
        if groups and node.meta["autoparallel"].requires_grad:
            buckets.setdefault((groups, node.meta["val"].dtype), []).append(node)
    for (groups, _), members in buckets.items():
        bucket = graph.call_function(grad_bucket, (groups, *[env[m] for m in members]))
        for i, m in enumerate(members):
            env[m] = graph.call_function(operator.getitem, (bucket, i))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
        elif node.op == "get_attr":
            continue
        elif node.op == "call_function":
            np_ = plan.nodes[node.name]
            leaves, spec_tree = pytree.tree_flatten((node.args, node.kwargs))
            new_leaves = [env[x] if isinstance(x, fx.Node) else _replace_device(x, traced_on, device) for x in leaves]
            for j, (li, x) in enumerate(tensor_inputs(node)):
                new_leaves[li] = fetch(node.name, j, x)
            args, kwargs = pytree.tree_unflatten(new_leaves, spec_tree)
            if node.target in _SHAPE_ARG_OPS and np_.output_specs:
                i = _SHAPE_ARG_OPS[node.target]
                loc = local_shape(np_.out_shapes[0], np_.output_specs[0], ms)
                old = list(args[i])
                args = list(args)
                args[i] = [-1 if (node.target == aten.expand.default and s == -1) else l
                           for s, l in zip(old, loc)]
                args = tuple(args)
            if node.target in _CONV_GROUPS_ARG and len(args) > _CONV_GROUPS_ARG[node.target]:
                i = _CONV_GROUPS_ARG[node.target]
                pieces = num_shards(np_.input_specs[0], 1, ms)  # depthwise: channels split with their groups
                if args[i] > 1 and pieces > 1:
                    args = args[:i] + (args[i] // pieces,) + args[i + 1:]
            if node.target in _SQUEEZES:
                target = aten.reshape.default
                args = (args[0], list(local_shape(np_.out_shapes[0], np_.output_specs[0], ms)))
            else:
                target = node.target
            if node.target == aten.cross_entropy_loss.default and partial_axes(np_.output_specs[0]):
                env[node] = _split_batch_cross_entropy(graph, em, args, kwargs, np_.output_specs[0])
                continue
            new = graph.call_function(target, tuple(args), kwargs)
            new.meta = {k: v for k, v in node.meta.items() if k in ("nn_module_stack", "stack_trace")}
            if node.target in (aten.mean.dim, aten.mean.default):
                pieces = _mean_pieces(node, np_, ms)
                if pieces > 1:  # local mean over a split dim: the pending sum must be the global mean
                    new = graph.call_function(aten.div.Tensor, (new, pieces))
            env[node] = new
        elif node.op == "output":
            returned_leaves = output_leaves(node)
            outs = []
            for x in pytree.tree_leaves(node.args[0]):
                if x not in returned_leaves:
                    outs.append(env[x] if isinstance(x, fx.Node) else x)
                    continue
                y = fetch("output", returned_leaves.index(x), x)
                if x.meta["val"].dtype.is_floating_point:
                    y = graph.call_function(returned, (y, world_size))
                outs.append(y)
            graph.output(tuple(outs))
    graph.eliminate_dead_code()
    graph.lint()
    _tag_sources(graph, env)
    return graph


def _tag_sources(graph: fx.Graph, env: dict[fx.Node, fx.Node]) -> None:
    """``meta["source"]``: the traced node each emitted node was emitted for. A traced
    node's value is the last node emitted for it (its input conversions come first), so
    walking backwards, every node belongs to the next value in graph order."""
    origin = {v: k.name for k, v in env.items() if isinstance(v, fx.Node)}
    current = None
    for n in reversed(graph.nodes):
        if n.op == "output":
            continue
        current = origin.get(n, current)
        if current is not None:
            n.meta["source"] = current


def _split_batch_cross_entropy(graph, em: _Emitter, args, kwargs, out_spec) -> fx.Node:
    """cross_entropy on a batch split over mesh axes: the local sum (weight, ignore_index and
    label_smoothing as given), divided for 'mean' by the global denominator torch uses: the
    count of kept (not ignored) targets, or with a weight the sum of their classes' weights."""
    a = bind_args(aten.cross_entropy_loss.default, args, kwargs)
    x, t, w, ignore = a["self"], a["target"], a["weight"], a["ignore_index"]
    loss = graph.call_function(aten.cross_entropy_loss.default, (x, t, w, 2, ignore, a["label_smoothing"]))
    if a["reduction"] == 2:
        return loss
    kept = graph.call_function(aten.ne.Scalar, (t, ignore))
    if w is None:
        den = graph.call_function(aten.sum.default, (kept,))
        den = graph.call_function(aten._to_copy.default, (den,), {"dtype": torch.float32})
    else:  # the weight of each kept target's class, 0 for ignored ones
        cls = graph.call_function(aten.where.ScalarOther, (kept, t, 0))
        wt = graph.call_function(aten.index_select.default, (w, 0, graph.call_function(aten.reshape.default,
                                                                                       (cls, [-1]))))
        flat = graph.call_function(aten.reshape.default, (kept, [-1]))
        den = graph.call_function(aten.sum.default, (graph.call_function(aten.mul.Tensor, (wt, flat)),))
    for ax in partial_axes(out_spec):
        den = em.wait(em.call(c10d.all_reduce.default, den, "sum", em.groups[ax]))
    return graph.call_function(aten.div.Tensor, (loss, den))


def _mean_pieces(node: fx.Node, np_, mesh_shape) -> int:
    """Into how many pieces the reduced dims of a mean are split."""
    nd = len(np_.in_shapes[0])
    dims = op_args(node)["dim"] if node.target == aten.mean.dim else None
    dims = list(range(nd)) if dims is None else dims
    spec = np_.input_specs[0]
    n = 1
    for d in {x % nd for x in dims}:
        n *= math.prod(mesh_shape[a] for a, p in enumerate(spec)
                       if isinstance(p, Shard) and p.dim == d)
    return n
