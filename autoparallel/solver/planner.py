"""Turn a traced graph and its strategies into an ILP, solve it, and build the Plan."""

from __future__ import annotations

import bisect
import copy
import functools
import logging
import math
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .. import precision
from ..mesh import MeshSpec
from ..placement import R, Spec, is_replicated, local_shape
from ..errors import InfeasiblePlanError
from ..plan import Redistribution, NodePlan, Plan, holds_dtensors, returned_spec
from ..results import Estimate, Inspection, SolverStats
from ..graph import (aliased_input, is_view, layer_of, layers_of, moves_no_data, output_leaves, tensor_inputs,
                     written_inputs)
from ..strategies import Strategy, record_of
from ..tracer.annotate import node_info
from .shared_layers import layer_templates
from .costs import CostModel, exposed_comm_time, optimizer_implementation
from .inspect import alternatives, memory_timeline, state_reads
from .ilp import FixedCharge, Flow, ILPEdge, ILPProblem, solve
from .memory import DEFAULT_OPTIMIZER, MemoryModel
from .remat import build_chain, chain_stages, checkpoint_plan
from .rotor import InfeasibleBudget, solve as rotor_solve
from .layout import Redistributor

log = logging.getLogger(__name__)
aten = torch.ops.aten


def _needs_grad(node: fx.Node) -> bool:
    return "autoparallel" in node.meta and node_info(node).requires_grad


def _grad_calls(node: fx.Node) -> int:
    """Calls of ``node``'s backward (an op neither matmul-like nor SDPA): one per tensor input
    its gradient flows to, except that ``add`` hands the gradient to an input of the output's
    shape as it is."""
    out = node.meta.get("val")
    return sum(1 for _, x in tensor_inputs(node) if _needs_grad(x) and not (
        node.target is aten.add.Tensor and isinstance(out, torch.Tensor) and x.meta["val"].shape == out.shape))


def _accumulations(node: fx.Node) -> int:
    """Additions autograd runs to sum the gradient of ``node``'s output over its uses: one per
    use beyond the first by an op that passes a gradient back."""
    uses = sum(1 for u in node.users if u.op == "call_function" and _needs_grad(u)
               for _, x in tensor_inputs(u) if x is node)
    return max(0, uses - 1)


def _local_bytes(shape, dtype, spec, mesh_shape) -> int:
    return math.prod(local_shape(shape, spec, mesh_shape)) * dtype.itemsize


def op_name(node: fx.Node) -> str:
    if node.op in ("placeholder", "get_attr"):
        return node.op
    return getattr(node.target, "__name__", str(node.target))


@dataclass
class GroupedProblem:
    """The sharding ILP of a graph over groups of nodes, and what maps its solution back.

    Attributes:
        ilp: one variable vector per group (a follower group whose layer template is
            itself) plus a last one for the graph output.
        root: node → the root of its follower group (:meth:`Planner._follow`).
        fmap: node → per strategy of its group, the node's strategy index.
        template: node → the node whose variables it shares (itself when unshared).
        group: group root → its index in ``ilp.node_costs``.
        edges: every edge of the graph: ``(consumer or None for the output, input
            position, (producer, output index), requires_grad)``.
        stats: ``groups``, ``ilp_groups`` and ``shared_nodes``, for :class:`~autoparallel.results.SolverStats`.
    """

    ilp: ILPProblem
    root: dict[fx.Node, fx.Node]
    fmap: dict[fx.Node, list[int]]
    template: dict[fx.Node, fx.Node]
    group: dict[fx.Node, int]
    edges: list[tuple]
    stats: dict[str, int]

    def group_of(self, node: fx.Node) -> int:
        """The ILP group index of ``node``."""
        return self.group[self.template[self.root[node]]]


class Planner:
    """Prices every strategy and resharding edge of a graph and solves for the plan.

    Args:
        gm: the traced graph (annotated by the tracer).
        strategies: node → strategies (from the strategy generator).
        aliases: getitem node → (producer, output index).
        mesh: the MeshSpec.
        cost_model: a :class:`CostModel` (bound to ``mesh`` here).
        param_names: graph target → all names of that parameter/buffer.
        share_layers: give identical repeated layers one set of ILP variables
            (:mod:`autoparallel.solver.shared_layers`).
        memory: the step's :class:`~autoparallel.solver.memory.MemoryModel` (peak memory
            estimate and budget rows); ``None`` to leave memory out.
        outputs: how graph outputs are returned (:func:`~autoparallel.plan.returned_spec`):
            ``"sharded"`` or ``"replicated"``.
        whole_outputs: indices (in :func:`~autoparallel.graph.output_leaves` order) of outputs
            returned replicated whatever ``outputs`` says: buffer write-backs
            (:func:`written_back_outputs`).
        reduce_dtype: the dtype parameter gradients are all-reduced in (a mixed-precision
            policy's, :func:`autoparallel.precision.reduce_dtype`); ``None``: their own.
        optimizer: the optimizer whose step is priced (a key of
            :data:`~autoparallel.solver.memory.OPTIMIZER_STATES`).
        device: the device type the module will run on: picks the optimizer's implementation
            (:func:`~autoparallel.solver.costs.optimizer_implementation`).
    """

    def __init__(self, gm, strategies, aliases, mesh: MeshSpec, cost_model: CostModel, param_names,
                 share_layers: bool = True, memory: MemoryModel | None = None, outputs: str = "replicated",
                 whole_outputs: frozenset[int] = frozenset(), reduce_dtype: torch.dtype | None = None,
                 optimizer: str = DEFAULT_OPTIMIZER, device: str = "cpu"):
        self.gm = gm
        self.strategies = strategies
        self.aliases = aliases
        self.mesh = mesh
        self.cm = cost_model.bind(mesh)
        self._traits: dict[fx.Node, tuple[bool, int, int]] = {}  # _op_traits
        self.layout = Redistributor(self.cm)
        # gradient bytes per gathered byte -> its prices, and value -> its prices (:meth:`_layout_for`);
        # shared with restricted() copies, so that no path is priced twice
        self._grad_layouts: dict[float, Redistributor] = {}
        self._layout_of: dict[tuple[fx.Node, int], Redistributor] = {}
        self.param_names = param_names
        self.nodes = list(strategies)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        self._grad_params = {n.name for n in self.nodes if n.op == "get_attr" and node_info(n).requires_grad}
        self.reduce_dtype = reduce_dtype
        self.optimizer, self.optimizer_impl = optimizer, optimizer_implementation(device)
        self._layer = {n: layer_of(n) for n in self.nodes}
        self._pinned = aliased_edges(self.nodes)
        self.share_layers = share_layers
        self.template = layer_templates(self.nodes, strategies) if share_layers else {n: n for n in self.nodes}
        self.memory = memory
        self.outputs, self.whole_outputs = outputs, frozenset(whole_outputs)

    def restricted(self, strategies) -> "Planner":
        """A planner of the same graph, cost model, memory model and options over
        ``strategies``: the same nodes, each with a subset of its strategies here (e.g. a copy
        that :func:`autoparallel.constraints.restrict` narrowed). It shares this planner's
        memoized redistribution paths, so it prices no path twice (:mod:`autoparallel.recipes`
        prices hand-written recipes beside the plan so).

        Raises:
            ValueError: ``strategies`` over other nodes than this planner's.
        """
        if list(strategies) != self.nodes:
            raise ValueError("a restricted planner needs strategies for exactly the planner's nodes, in its order")
        other = copy.copy(self)
        other.strategies = strategies
        if self.share_layers and not self._same_count_classes(strategies):
            other.template = layer_templates(self.nodes, strategies)
        return other

    def _same_count_classes(self, strategies) -> bool:
        """Whether ``strategies`` sort the repeated layers of each list into the same classes
        of equal per-node strategy counts as this planner's. :func:`layer_templates` then
        gives the same templates: its signature of a layer is the layer's structure, which
        does not change, and these counts; and computing it again walks every node's
        arguments (0.5 s at Llama-3-8B scale)."""
        for by_index in layers_of(self.nodes).values():
            mine: dict[tuple, int] = {}
            theirs: dict[tuple, int] = {}
            for idx in sorted(by_index):
                a = tuple(len(self.strategies.get(n, ())) for n in by_index[idx])
                b = tuple(len(strategies.get(n, ())) for n in by_index[idx])
                if mine.setdefault(a, len(mine)) != theirs.setdefault(b, len(theirs)):
                    return False
        return True

    def returned_spec(self, j: int, src: Spec) -> Spec:
        """The placements graph output ``j``, produced in ``src``, is returned in."""
        return returned_spec(src, self.outputs, j in self.whole_outputs)

    # ------------------------------------------------------------ pricing
    def _value(self, x: fx.Node) -> tuple[fx.Node, int]:
        return self.aliases.get(x, (x, 0))

    def node_cost(self, node: fx.Node, s: Strategy, backward: bool = True) -> tuple[float, float, int]:
        """(compute s, own communication s, memory bytes) of ``node`` under ``s``; compute
        covers forward and backward, or the forward only when ``backward`` is False; a
        trainable parameter's compute is its optimizer update (:meth:`optimizer_time`)."""
        info = node_info(node)
        ms = self.mesh.shape
        out_bytes = sum(_local_bytes(sh, dt, sp, ms) for (sh, dt), sp in zip(info.outputs, s.outputs))
        if node.op == "get_attr":
            update = self.optimizer_time(node, s) if backward else 0.0
            return update, sum(self.grad_reduction(node, s)), out_bytes * (2 if info.requires_grad else 1)
        if node.op == "placeholder":
            return 0.0, 0.0, 0
        free_view, grad_calls, accumulations = self._op_traits(node)
        if free_view:
            flops, traffic = 0.0, 0
        else:
            flops = info.flops / s.split
            traffic = out_bytes + sum(_local_bytes(tuple(x.meta["val"].shape), x.meta["val"].dtype, sp, ms)
                                      for (_, x), sp in zip(tensor_inputs(node), s.inputs))
        dtype = info.dtype if info.outputs else None
        grads = info.requires_grad and backward
        compute = self.cm.compute_time(node.target, flops, traffic, dtype, grads, grad_calls)
        if grads and len(info.outputs) == 1:
            compute += accumulations * self.cm.compute_time(aten.add.Tensor, 0, 3 * out_bytes, dtype, False)
        record = record_of(node.target)
        comm = record.cost(node, s, self.cm) if record is not None and record.cost is not None else 0.0
        return compute, comm, out_bytes

    def _op_traits(self, node: fx.Node) -> tuple[bool, int, int]:
        """``(moves_no_data, backward calls, accumulation adds)`` of ``node``, the same for
        every strategy: computed once per node (node_cost runs once per strategy)."""
        traits = self._traits.get(node)
        if traits is None:
            traits = self._traits[node] = (moves_no_data(node), _grad_calls(node), _accumulations(node))
        return traits

    def optimizer_time(self, node: fx.Node, s: Strategy) -> float:
        """Seconds the optimizer step spends on parameter ``node``'s local shard under ``s``
        (:meth:`~autoparallel.solver.costs.CostModel.optimizer_step_time`) with the
        parameters held as plain tensors; 0 for nodes without a gradient. What DTensor
        parameters add is :meth:`dtensor_overhead`, paid once for the whole plan."""
        if node.name not in self._grad_params:
            return 0.0
        shape, dtype = node_info(node).outputs[0]
        numel = math.prod(local_shape(shape, s.outputs[0], self.mesh.shape))
        return self.cm.optimizer_step_time(numel, dtype.itemsize, self.optimizer, self.optimizer_impl,
                                           len(self._grad_params), dtensor=False)

    def dtensor_overhead(self) -> float:
        """Seconds the optimizer step adds to :meth:`optimizer_time`'s sum when the module
        holds its parameters as DTensors: the DTensor dispatch of its ops on every trainable
        parameter. The module does unless the plan replicates every parameter and buffer on
        every device (:class:`~autoparallel.codegen.module.ParallelModule`), so the ILP pays
        it once when any of them is placed otherwise (:meth:`_dtensor_charge`)."""
        n = len(self._grad_params)
        if n == 0:
            return 0.0
        step = functools.partial(self.cm.optimizer_step_time, 0, 1, self.optimizer, self.optimizer_impl, n)
        return max(0.0, n * (step(dtensor=True) - step(dtensor=False)))  # 0: a preset without the overhead

    def _state_nodes(self) -> list[fx.Node]:
        """The ``get_attr`` nodes of parameters and buffers."""
        return [n for n in self.nodes if n.op == "get_attr" and n.target in self.param_names]

    def _spans_world(self, spec: Spec) -> bool:
        """Whether ``spec`` replicates along two or more mesh axes of more than one device that
        together span the world: the runtime all-reduces such a bucket once over the world's
        group (:func:`autoparallel.runtime_kernels.grad_reduction._world_group`)."""
        axes = [a for a, p in enumerate(spec) if p == R and self.mesh.shape[a] > 1]
        return len(axes) > 1 and math.prod(self.mesh.shape[a] for a in axes) == math.prod(self.mesh.shape)

    def grad_reduction(self, node: fx.Node, s: Strategy) -> tuple[float, float]:
        """Bandwidth seconds of the all-reduce of parameter ``node``'s gradient under ``s``, as
        ``(launched, after)``: over the first mesh axis of more than one device that ``s``
        replicates it along, which the runtime launches during the backward
        (:mod:`autoparallel.runtime_kernels.grad_reduction`), and over the further such axes,
        reduced after the backward; when those axes together span the world, one all-reduce
        over the world, launched (:meth:`_spans_world`). ``(0, 0)`` for other nodes."""
        if node.name not in self._grad_params:
            return 0.0, 0.0
        shape, dtype = node_info(node).outputs[0]
        nbytes = _local_bytes(shape, self.reduce_dtype or dtype, s.outputs[0], self.mesh.shape)
        if self._spans_world(s.outputs[0]):
            return self.cm.grad_reduction_time(None, nbytes), 0.0
        times = [self.cm.grad_reduction_time(a, nbytes) for a, p in enumerate(s.outputs[0])
                 if p == R and self.mesh.shape[a] > 1]
        return (times[0], sum(times[1:])) if times else (0.0, 0.0)

    @functools.cached_property
    def _launch_of(self) -> dict[fx.Node, int]:
        """Node → the gradient launch its term joins, numbered in launch order (the backward
        runs the forward in reverse): a parameter's gradient launches when the backward of its
        first user in the forward has run; an op's backward compute runs after the last
        launch its forward position follows. Ops whose backward runs before every launch,
        and parameters without users, are left out. One launch per distinct first use: each
        parameter is its own bucket (see :meth:`exposed_grad_rows`). Empty when the cost model
        does not overlap gradient reduction (``CostModel.overlap_grad_reduction``)."""
        if not self.cm.overlap_grad_reduction:
            return {}
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        first_use = {n: min(order[u] for u in n.users) for n in self.nodes if n.name in self._grad_params and n.users}
        cuts = sorted(set(first_use.values()))  # forward order; launch k is cuts[-1 - k]
        launch = {n: len(cuts) - 1 - cuts.index(t) for n, t in first_use.items()}
        for n in self.nodes:
            if n.op == "call_function":
                later = len(cuts) - bisect.bisect_right(cuts, order[n])  # launches that precede n's backward
                if later:
                    launch[n] = later - 1
        return launch

    def _launch_term(self, node: fx.Node, s: Strategy) -> tuple[float, float]:
        """``(communication launched, backward compute)`` seconds of ``node`` under ``s`` at its
        launch (:attr:`_launch_of`), for :func:`~autoparallel.solver.costs.exposed_comm_time`."""
        if node.op == "get_attr":
            return self.grad_reduction(node, s)[0], 0.0
        if node.op != "call_function" or not node_info(node).requires_grad:
            return 0.0, 0.0
        return 0.0, self.node_cost(node, s)[0] - self.node_cost(node, s, backward=False)[0]

    def _layout_for(self, val: tuple[fx.Node, int]) -> Redistributor:
        """The redistribution prices of value ``val``: :attr:`layout`'s, or for a parameter's
        mixed-precision cast whose gradient is reduced in a wider dtype than it is gathered in
        (:func:`~autoparallel.precision.gathered_cast`) a :class:`GradDtypeRedistributor`
        pricing each all-gather's backward in ``reduce_dtype`` bytes, as the runtime runs it
        (:func:`~autoparallel.runtime_kernels.param_all_gather`)."""
        layout = self._layout_of.get(val)
        if layout is None:
            layout = self.layout
            if precision.gathered_cast(val[0], self.reduce_dtype) is not None:
                ratio = self.reduce_dtype.itemsize / node_info(val[0]).outputs[val[1]][1].itemsize
                if ratio not in self._grad_layouts:
                    self._grad_layouts[ratio] = GradDtypeRedistributor(self.cm, ratio)
                layout = self._grad_layouts[ratio]
            self._layout_of[val] = layout
        return layout

    def _redistribute(self, val: tuple[fx.Node, int], requires_grad: bool, src: Spec, dst: Spec):
        shape, dtype = node_info(val[0]).outputs[val[1]]
        return self._layout_for(val).redistribute(shape, dtype.itemsize, dtype.is_floating_point, src, dst,
                                                  requires_grad)

    def _edge_cost(self, key, val, rg, src: Spec, dst: Spec) -> float:
        """Redistribution seconds on edge ``key`` = (consumer, input, producer, output index);
        impossible on edges into in-place ops and their view chains (see aliased_edges)."""
        if src != dst and (key[0], key[1]) in self._pinned:
            return math.inf
        shape, dtype = node_info(val[0]).outputs[val[1]]
        return self._layout_for(val).cost(shape, dtype.itemsize, dtype.is_floating_point, src, dst, rg)

    def _pair_edge(self, key, val, rg, gu: int, gv: int, src_specs: list[Spec], dst_specs: list[Spec]) -> ILPEdge:
        """The ILP edge between groups ``gu`` and ``gv`` (both with a choice) on edge ``key``
        (:meth:`_edge_cost`) for the specs its producer's and consumer's group strategies give
        and ask for: costs per pair of spec classes from the tensor's distance matrix
        (:meth:`~autoparallel.solver.layout.Redistributor.distances`), and, when the tensor's
        spec graph has fewer useful moves than the edge has pairs of classes, the same costs
        as a :class:`~autoparallel.solver.ilp.Flow` over those moves. Pinned edges (no
        redistribution) and specs cut in units keep the pairwise form."""
        o_cls, o_list = _classes(src_specs)
        i_cls, i_list = _classes(dst_specs)
        shape, dtype = node_info(val[0]).outputs[val[1]]
        g, d, move_s = self._layout_for(val).distances(shape, dtype.itemsize, dtype.is_floating_point, rg)
        o_ids, i_ids = [g.index.get(s) for s in o_list], [g.index.get(s) for s in i_list]
        if None in o_ids or None in i_ids or (key[0], key[1]) in self._pinned:  # unit cuts: not in g
            cost = [[self._edge_cost(key, val, rg, o, i) for i in i_list] for o in o_list]
            return ILPEdge(gu, gv, o_cls, i_cls, cost)
        cost = d[np.ix_(o_ids, i_ids)]
        flow = None
        if len(o_list) > 1 and len(i_list) > 1 and g.arcs:
            a, b = (np.array(x) for x in zip(*((i, j) for i, j, _ in g.arcs)))
            # moves from a source's reach into a sink's, each the cheapest way between its ends
            keep = np.isfinite(d[o_ids]).any(axis=0)[a] & np.isfinite(d[:, i_ids]).any(axis=1)[b] & (move_s <= d[a, b])
            arcs = dict(zip(zip(a[keep].tolist(), b[keep].tolist()), move_s[keep].tolist()))  # one per (a, b)
            if len(arcs) < np.isfinite(cost).sum():
                flow = Flow(o_ids, i_ids, [(a, b, c) for (a, b), c in arcs.items()])
        return ILPEdge(gu, gv, o_cls, i_cls, cost.tolist(), flow)

    def _edges(self):
        """(consumer node, or None for the graph output; input position; value; requires_grad)."""
        for node in self.nodes:
            if node.op != "call_function":
                continue
            for j, (_, x) in enumerate(tensor_inputs(node)):
                yield node, j, self._value(x), node_info(x).requires_grad
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        for j, x in enumerate(output_leaves(out)):
            yield None, j, self._value(x), node_info(x).requires_grad

    # ------------------------------------------------------------ solve
    def _follow(self) -> tuple[dict, dict]:
        """Merge followers into their producer's group.

        A node with exactly one data input whose producer has a choice (the others come
        from single-strategy producers) follows that producer when, for every spec the
        producer can give, it has exactly one strategy taking that spec as is: its
        strategy is then a function of the group's choice and costs no optimality.
        Pointwise ops, views and cheap reductions thereby share the variables of their
        producer instead of owning a one-hot vector and edges.

        Returns:
            root: node → the root node of its group; fmap: node → per root strategy, the
            node's strategy index.
        """
        root, fmap = {}, {}
        for node in self.nodes:
            root[node], fmap[node] = node, list(range(len(self.strategies[node])))
            if node.op != "call_function":
                continue
            ins = [(j, self._value(x), node_info(x).requires_grad) for j, (_, x) in enumerate(tensor_inputs(node))]
            varying = [t for t in ins if len(self.strategies[root[t[1][0]]]) > 1]
            if len(varying) != 1:
                continue
            j, (u, idx), rg = varying[0]
            if self._layer[node] != self._layer.get(u):
                continue  # followers stay inside one layer, so that layers match
            r = root[u]
            sv = self.strategies[node]
            by_input: dict = {}
            for k, s in enumerate(sv):
                by_input.setdefault(s.inputs[j], []).append(k)
            f = []
            for i in range(len(self.strategies[r])):
                ks = by_input.get(self.strategies[u][fmap[u][i]].outputs[idx], [])
                if len(ks) != 1:
                    break  # it would reshard, or could choose among outputs: let the ILP decide
                f.append(ks[0])
            if len(f) < len(self.strategies[r]):
                continue
            root[node], fmap[node] = r, f
        return root, fmap

    def _shared(self, root, fmap) -> dict[fx.Node, fx.Node]:
        """The layer template of every node. A layer whose follower grouping differs from its
        template's shares the variables of the first such layer of the same template that
        groups alike, or keeps its own: the first layer reads values from outside the layers,
        and when those are pinned (constraints, recipes) its nodes may follow differently from
        every later layer, which must not unshare them all."""
        orig = self.template
        bad = {self._layer[n] for n, t in orig.items()
               if t is not n and (orig.get(root[n]) is not root[t] or fmap[n] != fmap[t])}
        tmpl = dict(orig)
        by_layer: dict = {}  # bad layer -> its template's node -> its own node
        for n, t in orig.items():
            if t is not n and self._layer[n] in bad:
                by_layer.setdefault(self._layer[n], {})[t] = n
        leaders: list[dict] = []
        for nodes in by_layer.values():
            lead = next((c for c in leaders if c.keys() == nodes.keys() and all(
                c.get(orig[root[n]]) is root[c[t]] and fmap[n] == fmap[c[t]] for t, n in nodes.items())), None)
            if lead is None:
                leaders.append(nodes)
            for t, n in nodes.items():
                tmpl[n] = n if lead is None else lead[t]
        return tmpl

    def build_problem(self) -> GroupedProblem:
        """The ILP over shared groups, plus what :meth:`solve` needs to map the solution back."""
        root, fmap = self._follow()
        tmpl = self._shared(root, fmap)
        croots = [n for n in self.nodes if root[n] is n and tmpl[n] is n]
        gidx = {n: i for i, n in enumerate(croots)}
        built = GroupedProblem(ILPProblem([], [], [r.name for r in croots] + ["output"]), root, fmap, tmpl, gidx,
                               list(self._edges()), {})
        built.ilp.node_costs = self._group_costs(built, croots) + [[0.0]]  # the last group: the graph output
        built.ilp.exposed_rows = self.exposed_grad_rows(built)
        built.ilp.fixed_charges = self._latency_charges(built) + self._dtensor_charge(built)
        self._add_edges(built)
        built.stats = {"groups": sum(1 for n in self.nodes if root[n] is n), "ilp_groups": len(croots),
                       "shared_nodes": sum(1 for n in self.nodes if tmpl[n] is not n)}
        return built

    def _group_costs(self, built: GroupedProblem, croots: list[fx.Node]) -> list[list[float]]:
        """Seconds of every ILP group per group strategy: its nodes' compute and own
        communication, each shared node counted once per layer that shares it. Gradient
        reduction launched during the backward is left to :meth:`exposed_grad_rows`."""
        gcost = [[0.0] * len(self.strategies[r]) for r in croots]
        node_costs: dict[fx.Node, list[float]] = {}
        for node in self.nodes:
            t = built.template[node]
            if t not in node_costs:
                hide = t in self._launch_of
                node_costs[t] = [sum(self.node_cost(t, s)[:2]) - (self.grad_reduction(t, s)[0] if hide else 0.0)
                                 for s in self.strategies[t]]
            g = built.group[built.root[t]]
            for i, k in enumerate(built.fmap[t]):
                gcost[g][i] += node_costs[t][k]
        return gcost

    def exposed_grad_rows(self, built: GroupedProblem) -> list[list[list[float]]]:
        """The ILP's exposed-communication rows (:class:`~autoparallel.solver.ilp.ILPProblem`):
        per gradient launch, per ILP group and group strategy, the gradient-reduction seconds
        launched there minus the backward compute seconds that run after it and before the
        next launch (:meth:`_launch_term`). Each parameter launches when its own gradient is
        complete, as if buckets held one parameter: the runtime's buckets
        (:mod:`autoparallel.passes.grad_buckets`) launch when their last gradient is, which
        this prices optimistically by at most one bucket's all-reduce."""
        rows = [[[] for _ in built.ilp.node_costs] for _ in range(max(self._launch_of.values(), default=-1) + 1)]
        terms: dict[fx.Node, list[float]] = {}
        for node, k in self._launch_of.items():
            t = built.template[node]
            if t not in terms:
                terms[t] = [g - c for g, c in (self._launch_term(t, s) for s in self.strategies[t])]
            if not any(terms[t]):
                continue
            g = built.group[built.root[t]]
            row = rows[k][g] = rows[k][g] or [0.0] * len(built.fmap[t])
            for i, si in enumerate(built.fmap[t]):
                row[i] += terms[t][si]
        return rows

    def _reduction_groups(self, spec: Spec) -> list[int | None]:
        """The process groups a gradient of a parameter held in ``spec`` is all-reduced over:
        mesh axes of more than one device, or ``[None]`` for the world's group
        (:meth:`_spans_world`)."""
        if self._spans_world(spec):
            return [None]
        return [a for a, p in enumerate(spec) if p == R and self.mesh.shape[a] > 1]

    def _latency(self, group: int | None) -> float:
        """Seconds of an empty all-reduce over mesh axis ``group`` (``None``: the world)."""
        return self.cm.collective_time("all_reduce", group, 0)

    def _latency_charges(self, built: GroupedProblem) -> list[FixedCharge]:
        """One all-reduce latency per process group that some parameter's gradient is reduced
        over (:meth:`_reduction_groups`: a mesh axis, or the world; the gradient buckets'
        latency, paid once per group and in full), as ILP fixed charges over the strategies
        that reduce over it."""
        charges = []
        for group in [None] + [a for a, n in enumerate(self.mesh.shape) if n > 1]:
            strategies: dict[int, list[int]] = {}
            for node in self.nodes:
                if node.name in self._grad_params:
                    t = built.template[node]
                    ks = [i for i, si in enumerate(built.fmap[t])
                          if group in self._reduction_groups(self.strategies[t][si].outputs[0])]
                    if ks:
                        strategies[built.group[built.root[t]]] = ks
            if strategies:
                charges.append(FixedCharge(self._latency(group), strategies))
        return charges

    def _dtensor_charge(self, built: GroupedProblem) -> list[FixedCharge]:
        """:meth:`dtensor_overhead` as an ILP fixed charge over every strategy that does not
        replicate a parameter or buffer on every device."""
        cost, strategies = self.dtensor_overhead(), {}
        for node in self._state_nodes():
            t = built.template[node]
            ks = [i for i, si in enumerate(built.fmap[t]) if not is_replicated(self.strategies[t][si].outputs[0])]
            if ks:
                g = built.group[built.root[t]]
                strategies[g] = sorted(set(strategies.get(g, [])) | set(ks))
        return [FixedCharge(cost, strategies)] if cost and strategies else []

    def grad_comm(self, choice: dict[fx.Node, Strategy]) -> tuple[float, float]:
        """``(grad_comm_s, exposed_grad_comm_s)`` of a strategy choice: the seconds of every
        gradient all-reduce (bandwidth over every axis plus one latency per axis), and the part
        of them the step waits for: what the runtime launches during the backward priced by
        :func:`~autoparallel.solver.costs.exposed_comm_time` over the launches of
        :attr:`_launch_of`, the rest (further axes, latencies) in full. The ILP's objective
        prices the same (:meth:`exposed_grad_rows`, :meth:`_latency_charges`)."""
        launches = [[0.0, 0.0] for _ in range(max(self._launch_of.values(), default=-1) + 1)]
        total = hidden = 0.0
        for node, s in choice.items():
            launched, after = self.grad_reduction(node, s)
            total += launched + after
            k = self._launch_of.get(node)
            if k is not None:
                hidden += launched
                g, c = self._launch_term(node, s)
                launches[k][0] += g
                launches[k][1] += c
        groups = {g for p in self.nodes if p.name in self._grad_params
                  for g in self._reduction_groups(choice[p].outputs[0])}
        latency = sum(self._latency(g) for g in groups)
        return total + latency, total - hidden + exposed_comm_time(launches) + latency

    def _add_edges(self, built: GroupedProblem) -> None:
        """Resharding seconds of every edge: edges inside one group add to its node costs,
        the others become ILP edges between spec classes; edges of shared layers are
        priced once and counted once per layer."""
        tmpl, fmap, ilp = built.template, built.fmap, built.ilp
        out_g = len(ilp.node_costs) - 1
        repl = (R,) * self.mesh.ndim  # the output group's one (nominal) strategy
        acc = {}
        for consumer, j, (u, idx), rg in built.edges:
            tc, tu = (tmpl[consumer] if consumer is not None else None), tmpl[u]
            key = (tc, j, tu, idx)
            if key in acc:
                acc[key][1] += 1
                continue
            src_specs = [self.strategies[tu][k].outputs[idx] for k in fmap[tu]]
            dst_specs = [repl] if tc is None else [self.strategies[tc][k].inputs[j] for k in fmap[tc]]
            gu = built.group[built.root[tu]]
            gv = out_g if tc is None else built.group[built.root[tc]]
            if gu == gv:  # inside one group: a cost per strategy of the group
                vec = [self._edge_cost(key, (tu, idx), rg, a, b) for a, b in zip(src_specs, dst_specs)]
                acc[key] = [("internal", gu, vec), 1]
                continue
            if tc is None:  # a returned value: its target follows its source (returned_spec)
                o_cls, o_list = _classes(src_specs)
                cost = [[self._edge_cost(key, (tu, idx), rg, o, self.returned_spec(j, o))] for o in o_list]
                acc[key] = [("edge", ILPEdge(gu, gv, o_cls, [0], cost)), 1]
            else:
                acc[key] = [("edge", self._pair_edge(key, (tu, idx), rg, gu, gv, src_specs, dst_specs)), 1]
        for item, mult in acc.values():
            if item[0] == "internal":
                for i, c in enumerate(item[2]):
                    ilp.node_costs[item[1]][i] += c * mult
            else:
                e = item[1]
                e.cost = [[c * mult for c in row] for row in e.cost]
                if e.flow is not None:
                    e.flow.arcs = [(a, b, c * mult) for a, b, c in e.flow.arcs]
                ilp.edges.append(e)

    def solve(self, *, solver: str = "cbc", time_limit: float = 60.0, memory_budget: int | None = None,
              checkpointing: bool = True, max_rounds: int = 12, inspect: bool = True,
              built: GroupedProblem | None = None) -> Plan:
        """Solve for the fastest plan whose modelled peak memory fits ``memory_budget`` bytes.

        Stage 1: the fastest plan; when its modelled peak is over budget, the memory at the
        steps where plans peak is priced into the objective (Lagrangian relaxation, at most
        ``max_rounds`` solves: :meth:`_stage1`) until the fastest fitting plan is found. When no
        sharding alone fits and ``checkpointing`` is on, stage 2 (:mod:`.remat`) picks
        activations to recompute on the plan of stage 1, re-solving stage 1 with a tighter
        allowance a bounded number of times until the recomputation schedule fits. ``inspect``
        records what the summary, explain and plot read (``plan.inspection``: :meth:`_inspectable`;
        about a tenth of the planning time at Llama-3-8B scale); a plan priced only for its estimate skips it.
        ``built``: this planner's :meth:`build_problem`, when the caller already built it.
        ``plan.solver_stats.stage_s`` holds the seconds of each part: ``costs`` (pricing, building
        the problem), ``stage1`` (every stage-1 solve, model building included), ``remat``
        (stage 2), ``inspect``.

        Raises:
            InfeasiblePlanError: when no plan fits the budget; the message gives the
                smallest peak the planner can reach.
        """
        t0 = time.perf_counter()
        built = built or self.build_problem()
        t_costs = time.perf_counter() - t0
        stage1 = functools.partial(self._stage1, built, solver=solver, time_limit=time_limit, max_rounds=max_rounds)
        t1 = time.perf_counter()
        found = stage1(memory_budget)
        t_stage1 = time.perf_counter() - t1
        checkpoint = plan = None
        if found is None:
            stages = chain_stages(self.memory.nodes) if checkpointing else {}
            if not stages:
                raise InfeasiblePlanError(self._budget_message(built, memory_budget, solver, time_limit))
            found, plan, checkpoint = self._two_stage(stage1, built, stages, memory_budget)
        t_remat = time.perf_counter() - t1 - t_stage1
        choice, sol, rounds = found
        plan = plan or self.make_plan(choice, built.edges)
        if memory_budget is not None:
            plan.estimate = replace(plan.estimate, memory_budget_bytes=int(memory_budget))
        if checkpoint is not None:
            plan.checkpoint, peak = checkpoint
            recompute = plan.checkpoint.recompute_s
            plan.estimate = replace(plan.estimate, step_time_s=plan.estimate.step_time_s + recompute,
                                    recompute_s=recompute, peak_memory_bytes=peak)
        plan.solver_stats = SolverStats(**sol.stats, nodes=len(self.nodes), edges=len(built.ilp.edges),
                                        strategies=sum(len(s) for s in self.strategies.values()),
                                        memory_rows=len(built.ilp.memory_rows), memory_rounds=rounds, **built.stats,
                                        stage_s={"costs": t_costs, "stage1": t_stage1, "remat": t_remat})
        if inspect:
            self._inspectable(plan, choice, built.edges)
        return plan

    def _inspectable(self, plan: Plan, choice, edges) -> None:
        """Record what the plan's summary, explain and plot read (:mod:`autoparallel.solver.inspect`):
        parameter names per node and what they are read through, each node's alternatives, the
        memory timeline."""
        t0 = time.perf_counter()
        state = {n.name: list(self.param_names[n.target]) for n in self.nodes
                 if n.op == "get_attr" and n.target in self.param_names}
        timeline = memory_timeline(self.memory, choice) if self.memory is not None else None
        plan.inspection = Inspection(state_nodes=state, state_reads=state_reads(self.gm, state),
                                     alternatives=alternatives(self, choice, edges), memory_timeline=timeline)
        plan.solver_stats.stage_s["inspect"] = time.perf_counter() - t0

    def _decode(self, built: GroupedProblem, sol) -> dict[fx.Node, Strategy]:
        """Node → strategy of an ILP solution."""
        return {n: self.strategies[n][built.fmap[n][sol.choice[built.group_of(n)]]] for n in self.nodes}

    def _stage1(self, built: GroupedProblem, budget: int | None, *, solver: str, time_limit: float,
                max_rounds: int):
        """``(choice, solution, solves)`` of the fastest plan found within ``budget`` bytes, or
        ``None`` when none is found (see :meth:`solve`).

        The fastest plan first; when its modelled peak is over ``budget``, Lagrangian
        relaxation of the memory rows (Fisher, "The Lagrangian relaxation method for solving
        integer programming problems", Management Science 1981, §2): the bytes held at the steps
        where plans peaked are priced at ``lam`` seconds per byte in the objective, first at
        the step time of the fastest plan per byte it is over budget, then ×4 until a plan
        fits, then bisected (geometric mean; halved while none is known not to fit) until the
        largest price that does not fit is within 1.2× of the smallest that does, or after
        ``max_rounds`` solves; the fastest fitting plan (by its unpenalized seconds) wins, and
        one as fast as the fastest plan ends the search. Each solve keeps the
        unconstrained problem's shape (the penalty is a cost per group strategy), whose LP
        relaxation solves integral in about a second at Llama-3-8B scale; hard memory rows
        made CBC branch until its time limit (60 s per row added). A Lagrangian plan may be
        slower than the optimum within the budget by the duality gap.
        """
        problem = built.ilp
        sol = solve(problem, solver=solver, time_limit=time_limit)
        choice = self._decode(built, sol)
        if budget is None or self.memory is None:
            return choice, sol, 1
        est = self.memory.estimate(choice)
        if est.peak_bytes <= budget:
            return choice, sol, 1
        base = problem.node_costs
        rows = {est.peak_step: self._memory_row(est.peak_step, built)}
        problem.memory_rows = list(rows.values())  # for the min-peak solve and solver_stats
        # first price: giving up the whole step time saves the excess over the budget
        lo, hi, lam, best = 0.0, None, max(sol.objective, 1e-9) / (est.peak_bytes - budget), None
        last, fastest = sol.choice, sol.objective
        for rounds in range(2, max_rounds + 1):
            problem.node_costs = [[c + lam * sum(r[g][k] for r in rows.values() if r[g]) for k, c in enumerate(cs)]
                                  for g, cs in enumerate(base)]
            try:
                sol = solve(problem, solver=solver, time_limit=time_limit)
            finally:
                problem.node_costs = base
            penalty = lam * sum(r[g][k] for r in rows.values() for g, k in enumerate(sol.choice) if r[g])
            sol.objective -= penalty
            sol.stats["objective_s"] -= penalty
            choice = self._decode(built, sol)
            est = self.memory.estimate(choice)
            log.info("memory budget: solve %d at %.3g s/GiB: peak %.4g GiB, step %.4g s (%.2f s)", rounds,
                     lam * 2**30, est.peak_bytes / 2**30, sol.objective, sol.stats["build_s"] + sol.stats["solve_s"])
            if est.peak_bytes <= budget:
                hi = lam
                if best is None or sol.objective < best[1].objective:
                    best = (choice, sol, rounds)
                if sol.objective <= fastest * (1 + 1e-9):
                    break  # as fast as the fastest plan: the optimum
            new_row = est.peak_bytes > budget and est.peak_step not in rows
            if est.peak_bytes > budget:
                lo = lam
                if new_row:
                    rows[est.peak_step] = self._memory_row(est.peak_step, built)
                    problem.memory_rows = list(rows.values())
            if hi is None and sol.choice == last and not new_row:
                break  # a higher price no longer changes the plan: none fits
            last = sol.choice
            if hi is None:
                lam *= 4
            elif hi <= 1.2 * lo:
                break
            else:
                lam = math.sqrt(lo * hi) if lo else hi / 2
        return best

    def _two_stage(self, stage1, built: GroupedProblem, stages, budget):
        """Stage 2: Rotor on stage-1 plans of decreasing allowance (the fastest plan, then
        allowances of 3/4, 1/2 and 1/4 of the way from its peak down to ``budget`` and of 7/8,
        3/4, ..., 1/4 of its peak, those not below ``budget``); the first whose recomputation
        schedule fits wins. The smallest reachable peak an infeasible budget reports is over the
        latter, which do not depend on ``budget``: planning again at that peak meets the plan
        that reached it (its allowance is at least that peak).

        Returns:
            ``((choice, solution, rounds), plan, (plan.checkpoint, modelled peak bytes))``.
        """
        built.ilp.memory_rows.clear()
        free = stage1(None)
        top = self.memory.estimate(free[0]).peak_bytes
        reachable = []
        fixed_fractions = {int(f * top) for f in (0.875, 0.75, 0.625, 0.5, 0.375, 0.25) if f * top >= budget}
        toward_budget = {int(budget + f * (top - budget)) for f in (0.75, 0.5, 0.25)}
        for allowance in [None] + sorted(fixed_fractions | toward_budget, reverse=True):
            found = free if allowance is None else stage1(allowance)
            if found is None:
                break
            choice = found[0]
            plan = self.make_plan(choice, built.edges)
            fwd = {n.name: self.node_cost(n, choice[n], backward=False)[0] for n in stages if n in choice}
            chain, fixed = build_chain(self.memory, choice, plan, fwd, stages)
            try:
                schedule = rotor_solve(chain, budget - fixed)
            except InfeasibleBudget as e:
                try:  # the smallest peak exactly may not fit once the DP rounds sizes up to slots
                    rotor_solve(chain, e.min_budget)
                    need = e.min_budget
                except InfeasibleBudget as rounded:
                    need = rounded.min_budget
                if allowance is None or allowance in fixed_fractions:
                    reachable.append((fixed + need, choice))
                continue
            log.info("activation checkpointing: %d regions, %.3g s recomputed, stage-1 allowance %.4g GiB",
                     len(schedule.regions), schedule.recompute_time, (allowance or top) / 2**30)
            return found, plan, (checkpoint_plan(chain, schedule, stages), fixed + int(schedule.peak_bytes))
        best, choice = min(reachable, key=lambda r: r[0]) if reachable else (top, free[0])
        best = int(math.ceil(best))
        raise InfeasiblePlanError(
            f"no plan fits memory_budget={budget / 2**30:.3g} GiB per device, even recomputing activations: the "
            f"smallest peak the planner reaches is about {best / 2**30:.3g} GiB ({best} bytes); without "
            f"recomputation {self.memory.dominant(choice)}. Raise the budget, use more devices or a smaller batch")

    def _memory_row(self, t: int, built: GroupedProblem) -> list[list[float]]:
        """Bytes held at step ``t``, per ILP group and group strategy (linear:
        :meth:`~autoparallel.solver.memory.MemoryModel.row`)."""
        row: list[list[float]] = [[] for _ in range(len(built.ilp.node_costs))]
        for owner, size in self.memory.row(t):
            g = built.group_of(owner)
            if not row[g]:
                row[g] = [0.0] * len(built.fmap[owner])
            for k, si in enumerate(built.fmap[owner]):
                row[g][k] += size(self.strategies[owner][si])
        return row

    def _budget_message(self, built: GroupedProblem, budget, solver, time_limit) -> str:
        """Why ``budget`` cannot be met, with the smallest reachable peak (a min-peak solve)."""
        problem = built.ilp
        problem.minimize_memory = True
        try:
            sol = solve(problem, solver=solver, time_limit=min(time_limit, 10.0))
            choice = self._decode(built, sol)
            best = self.memory.estimate(choice).peak_bytes
        finally:
            problem.minimize_memory = False
        return (f"no plan fits memory_budget={budget / 2**30:.3g} GiB per device: the smallest peak the planner "
                f"reaches on this mesh is about {best / 2**30:.3g} GiB ({best} bytes); {self.memory.dominant(choice)}. "
                "Raise the budget, use more devices or a smaller batch")

    def make_plan(self, choice: dict[fx.Node, Strategy], meta=None) -> Plan:
        """Build the Plan of a given strategy choice (``meta``: the edges, default all)."""
        meta = list(self._edges()) if meta is None else meta
        nodes: dict[str, NodePlan] = {}
        for node in self.gm.graph.nodes:
            if node.op == "output":
                continue
            info = node_info(node) if "autoparallel" in node.meta else None
            if node in self.aliases:
                u, idx = self.aliases[node]
                spec = choice[u].outputs[idx]
                nodes[node.name] = NodePlan(node.name, "getitem", info.module_path if info else "",
                                            [], [s for s, _ in info.outputs] if info else [], [], [spec])
                continue
            if node not in choice:
                continue
            s = choice[node]
            compute, comm, mem = self.node_cost(node, s)
            nodes[node.name] = NodePlan(
                node.name, op_name(node), info.module_path,
                [tuple(x.meta["val"].shape) for _, x in tensor_inputs(node)] if node.op == "call_function" else [],
                [sh for sh, _ in info.outputs], list(s.inputs), list(s.outputs), compute, comm, mem)
        redistributions = []
        for consumer, j, (u, idx), rg in meta:
            src = choice[u].outputs[idx]
            dst = self.returned_spec(j, src) if consumer is None else choice[consumer].inputs[j]
            if src == dst:
                continue
            cost, moves = self._redistribute((u, idx), rg, src, dst)
            if math.isinf(cost):
                raise RuntimeError(f"no redistribution {src} -> {dst} for {u.name}")
            name = "output" if consumer is None else consumer.name
            redistributions.append(Redistribution(u.name, idx, name, j, node_info(u).outputs[idx][0], list(moves), cost))
            if consumer is not None:
                nodes[name].comm_s += cost
        params = {}
        for node in self.nodes:
            if node.op == "get_attr" and node.target in self.param_names:
                for name in self.param_names[node.target]:
                    params[name] = choice[node].outputs[0]
        memory = self.memory.estimate(choice).as_peak() if self.memory is not None else None
        compute = sum(n.compute_s for n in nodes.values())
        comm = sum(n.comm_s for n in nodes.values()) + sum(c.cost_s for c in redistributions if c.dst == "output")
        # the nodes' comm_s hold their gradients' whole bandwidth; the step waits for the exposed part
        grad_total, grad_exposed = self.grad_comm(choice)
        comm += grad_exposed - sum(sum(self.grad_reduction(n, s)) for n, s in choice.items())
        # compute holds the optimizer step: each trainable parameter's node_cost is its update
        optimizer = sum(self.optimizer_time(n, s) for n, s in choice.items())
        if holds_dtensors(params):  # in no node's compute_s: paid once for the module
            overhead = self.dtensor_overhead()
            optimizer += overhead
            compute += overhead
        estimate = Estimate(step_time_s=compute + comm, compute_s=compute, comm_s=comm, optimizer_s=optimizer,
                            grad_comm_s=grad_total, exposed_grad_comm_s=grad_exposed,
                            peak_memory_bytes=memory.peak_bytes if memory else None, memory=memory)
        return Plan(self.mesh, nodes, redistributions, params, estimate, outputs=self.outputs)


class GradDtypeRedistributor(Redistributor):
    """:class:`Redistributor` prices for a value whose all-gathers' backward reduce-scatters
    run in a wider dtype than the gather: a parameter's mixed-precision cast, gathered in
    ``param_dtype`` and reduce-scattered in ``reduce_dtype``
    (:func:`~autoparallel.runtime_kernels.param_all_gather`). Every other move is priced as
    :class:`Redistributor` prices it.

    Args:
        cost_model: a bound :class:`CostModel`.
        ratio: bytes of the gradient per byte of the gathered value (2.0 for bf16 gathered,
            fp32 reduced).
    """

    def __init__(self, cost_model: CostModel, ratio: float):
        super().__init__(cost_model)
        self.ratio = ratio

    def move_cost(self, m, requires_grad: bool) -> float:
        if m.kind != "all_gather" or not requires_grad:
            return super().move_cost(m, requires_grad)
        return (self.cm.collective_time("all_gather", m.axis, m.nbytes)
                + self.cm.collective_time("reduce_scatter", m.axis, round(m.nbytes * self.ratio)))


def aliased_edges(nodes) -> set[tuple[fx.Node, int]]:
    """(consumer, input position) edges that must not be resharded: the written argument of
    an in-place op, and every view edge back to the tensor it aliases. A redistribution there
    would make the op write into a copy, silently losing the mutation."""
    pinned = set()
    for node in nodes:
        for j in written_inputs(node):
            x = node
            while j is not None:  # the written input, then back through views to their base
                pinned.add((x, j))
                x = tensor_inputs(x)[j][1]
                j = aliased_input(x) if is_view(x) else None
    return pinned


def written_back_outputs(gm: fx.GraphModule, buffer_mutations: dict[int, str]) -> frozenset[int]:
    """Indices in :func:`~autoparallel.graph.output_leaves` order of the outputs that are
    buffer write-backs (``buffer_mutations``: flat output index → buffer, as
    ``TracedModel.buffer_mutations``): returned whole, the module copies them into its
    replicated buffers."""
    out = next(n for n in gm.graph.nodes if n.op == "output")
    flat = pytree.tree_leaves(out.args[0])
    tensors = [i for i, x in enumerate(flat) if isinstance(x, fx.Node) and isinstance(x.meta.get("val"), torch.Tensor)]
    return frozenset(k for k, i in enumerate(tensors) if i in buffer_mutations)  # output_leaves' filter


def _classes(specs: list[Spec]) -> tuple[list[int], list[Spec]]:
    uniq: dict[Spec, int] = {}
    cls = [uniq.setdefault(s, len(uniq)) for s in specs]
    return cls, list(uniq)
