"""The prices of a graph's strategies: per node, per edge, the optimizer step, gradient reduction
and the DTensor overhead.

:class:`Pricing` holds the graph, its mesh, the bound cost model
(:class:`~autoparallel.solver.costs.CostModel`: roofline compute, alpha-beta collectives) and
the memoized redistribution prices, and answers in seconds and bytes per device; the ILP
(:mod:`autoparallel.solver.problem`), the plan (:mod:`autoparallel.solver.decode`) and the
alternatives (:mod:`autoparallel.solver.inspect`) all read it, so each prices alike.
"""

from __future__ import annotations

import bisect
import functools
import math

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .. import precision
from ..mesh import MeshSpec
from ..placement import R, Spec, local_shape
from ..plan import returned_spec
from ..graph import aliased_input, is_view, moves_no_data, output_leaves, tensor_inputs, written_inputs
from ..strategies import Strategy, record_of
from ..strategies.zero import state_spec_of
from ..tracer.annotate import node_info
from .costs import CostModel, exposed_comm_time
from .memory import DEFAULT_OPTIMIZER
from .layout import Redistributor

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


class Pricing:
    """Seconds and bytes per device of every strategy and resharding edge of a graph.

    Shared by a :class:`~autoparallel.solver.planner.Planner` and its restricted copies, so
    that no redistribution path is priced twice.

    Args:
        gm: the traced graph (annotated by the tracer).
        nodes: the nodes that have strategies, in graph order.
        aliases: getitem node → (producer, output index).
        mesh: the MeshSpec.
        cost_model: a :class:`CostModel` (bound to ``mesh`` here).
        outputs: how graph outputs are returned (:func:`~autoparallel.plan.returned_spec`):
            ``"sharded"`` or ``"replicated"``.
        whole_outputs: indices (in :func:`~autoparallel.graph.output_leaves` order) of outputs
            returned replicated whatever ``outputs`` says: buffer write-backs
            (:func:`written_back_outputs`).
        reduce_dtype: the dtype parameter gradients are all-reduced in (a mixed-precision
            policy's, :func:`autoparallel.precision.reduce_dtype`); ``None``: their own.
        optimizer: the optimizer whose step is priced (a key of
            :data:`~autoparallel.solver.memory.OPTIMIZER_STATES`).
        optimizer_impl: the optimizer's implementation, ``"for-loop"`` or ``"foreach"``
            (:meth:`~autoparallel.options.PlanOptions.optimizer_implementation`).
    """

    def __init__(self, gm, nodes: list[fx.Node], aliases, mesh: MeshSpec, cost_model: CostModel, *,
                 outputs: str = "replicated", whole_outputs: frozenset[int] = frozenset(),
                 reduce_dtype: torch.dtype | None = None, optimizer: str = DEFAULT_OPTIMIZER,
                 optimizer_impl: str = "for-loop"):
        self.gm = gm
        self.nodes = nodes
        self.aliases = aliases
        self.mesh = mesh
        self.cm = cost_model.bind(mesh)
        self._traits: dict[fx.Node, tuple[bool, int, int]] = {}  # _op_traits
        self.layout = Redistributor(self.cm)
        # gradient bytes per gathered byte -> its prices, and value -> its prices (:meth:`layout_for`)
        self._grad_layouts: dict[float, Redistributor] = {}
        self._layout_of: dict[tuple[fx.Node, int], Redistributor] = {}
        self.grad_params = {n.name for n in nodes if n.op == "get_attr" and node_info(n).requires_grad}
        self.reduce_dtype = reduce_dtype
        self.optimizer, self.optimizer_impl = optimizer, optimizer_impl
        self.pinned = aliased_edges(nodes)
        self.outputs, self.whole_outputs = outputs, frozenset(whole_outputs)

    def returned_spec(self, j: int, src: Spec) -> Spec:
        """The placements graph output ``j``, produced in ``src``, is returned in."""
        return returned_spec(src, self.outputs, j in self.whole_outputs)

    def value(self, x: fx.Node) -> tuple[fx.Node, int]:
        """The value node ``x`` reads: ``(producer, output index)``, through a getitem."""
        return self.aliases.get(x, (x, 0))

    def node_cost(self, node: fx.Node, s: Strategy, backward: bool = True) -> tuple[float, float, int]:
        """(compute s, own communication s, memory bytes) of ``node`` under ``s``; compute
        covers forward and backward, or the forward only when ``backward`` is False; a
        trainable parameter's compute is its optimizer update (:meth:`optimizer_time`); an
        offloaded one's communication includes its copies over the host link, exposed (the
        runtime copies on the compute stream), and it holds no device bytes."""
        info = node_info(node)
        ms = self.mesh.shape
        out_bytes = sum(_local_bytes(sh, dt, sp, ms) for (sh, dt), sp in zip(info.outputs, s.outputs))
        if node.op == "get_attr":
            update = self.optimizer_time(node, s) if backward else 0.0
            comm = sum(self.grad_reduction(node, s))
            if s.offload:  # the shard to the device each forward, its gradient back each backward
                return update, comm + (2 if backward else 1) * self.cm.host_copy_time(out_bytes), 0
            if s.zero:  # the updated shards all-gathered once per step; the shard and its gradient held
                shard = out_bytes // math.prod(ms[a] for a in s.zero)
                gather = self.zero_gather(s.zero, out_bytes) if backward else 0.0
                return update, comm + gather, 2 * (out_bytes + shard)
            return update, comm, out_bytes * (2 if info.requires_grad else 1)
        if node.op == "placeholder":
            return 0.0, 0.0, 0
        free_view, grad_calls, accumulations = self._op_traits(node)
        record = record_of(node.target)
        if free_view:
            flops, traffic = 0.0, 0
        else:
            flops = info.flops / s.split
            traffic = out_bytes + sum(_local_bytes(tuple(x.meta["val"].shape), x.meta["val"].dtype, sp, ms)
                                      for (_, x), sp in zip(tensor_inputs(node), s.inputs))
            if record is not None and record.load is not None:  # the busiest device's share
                load = record.load(node, s, ms, self.cm)
                flops, traffic = flops * load, traffic * load
        dtype = info.dtype if info.outputs else None
        grads = info.requires_grad and backward
        compute = self.cm.compute_time(node.target, flops, traffic, dtype, grads, grad_calls)
        if grads and len(info.outputs) == 1:
            compute += accumulations * self.cm.compute_time(aten.add.Tensor, 0, 3 * out_bytes, dtype, False)
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
        if node.name not in self.grad_params:
            return 0.0
        shape, dtype = node_info(node).outputs[0]
        numel = math.prod(local_shape(shape, state_spec_of(node, s, self.mesh.shape), self.mesh.shape))
        return self.cm.optimizer_step_time(numel, dtype.itemsize, self.optimizer, self.optimizer_impl,
                                           len(self.grad_params), dtensor=False, on_host=s.offload)

    def zero_group(self, axes: tuple[int, ...]) -> int | None:
        """The process group a ZeRO parameter's shards are all-gathered over
        (:mod:`autoparallel.strategies.zero`): its single mesh axis, or ``None`` (the world's)
        for several axes spanning the mesh."""
        return axes[0] if len(axes) == 1 else None

    def zero_gather(self, axes: tuple[int, ...], nbytes: int) -> float:
        """Seconds of gathering ``nbytes`` of a ZeRO parameter (its whole local tensor) from its
        optimizer shards over ``axes``, once per step and exposed, as the module runs it before
        the forward (:class:`~autoparallel.codegen.zero.ZeroState`): the all-gather's bandwidth
        term (its latency is paid once per group, :meth:`zero_charges`) and the copies
        around it at the device's memory bandwidth (the shard into the bucket and into its own
        place among the gathered, ``4·shard`` bytes read and written, then the gathered into the
        whole copy, ``2·nbytes``)."""
        group = self.zero_group(axes)
        shard = nbytes / math.prod(self.mesh.shape[a] for a in axes)
        copies = (4 * shard + 2 * nbytes) / self.cm.device.mem_bw
        gather = self.cm.collective_time("all_gather", group, nbytes)
        return gather - self.cm.collective_time("all_gather", group, 0) + copies

    def zero_charges(self, s: Strategy) -> list[tuple[str, int | None]]:
        """The ``(collective, process group)`` latencies a ZeRO strategy shares with the others
        of its group, once per step: the all-gather of the shards, and under stage 2 the
        reduce-scatter of the gradients (their own buckets)."""
        if not s.zero:
            return []
        group = self.zero_group(s.zero)
        return [("all_gather", group)] + ([("reduce_scatter", group)] if s.zero_grad else [])

    def zero_latencies(self, choice: dict[fx.Node, Strategy]) -> float:
        """The latencies of :meth:`zero_charges` a strategy choice pays, each once (the ILP's
        fixed charges price the same)."""
        charges = {c for s in choice.values() for c in self.zero_charges(s)}
        return sum(self.cm.collective_time(kind, g, 0) for kind, g in charges)

    def dtensor_overhead(self) -> float:
        """Seconds the optimizer step adds to :meth:`optimizer_time`'s sum when the module
        holds its parameters as DTensors: the DTensor dispatch of its ops on every trainable
        parameter. The module does unless the plan replicates every parameter and buffer on
        every device (:class:`~autoparallel.codegen.module.ParallelModule`), so the ILP pays
        it once when any of them is placed otherwise (:func:`~autoparallel.solver.problem.build_problem`)."""
        n = len(self.grad_params)
        if n == 0:
            return 0.0
        step = functools.partial(self.cm.optimizer_step_time, 0, 1, self.optimizer, self.optimizer_impl, n)
        return max(0.0, n * (step(dtensor=True) - step(dtensor=False)))  # 0: a preset without the overhead

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
        over the world, launched (:meth:`_spans_world`); under ZeRO stage 2 the reduce-scatter
        over the state's axes instead, launched. ``(0, 0)`` for other nodes."""
        if node.name not in self.grad_params:
            return 0.0, 0.0
        shape, dtype = node_info(node).outputs[0]
        nbytes = _local_bytes(shape, self.reduce_dtype or dtype, s.outputs[0], self.mesh.shape)
        if s.zero_grad:  # reduce-scattered onto the shard over the state's axes: all of its replicated ones
            group = self.zero_group(s.zero)
            rs = self.cm.collective_time("reduce_scatter", group, nbytes)
            return rs - self.cm.collective_time("reduce_scatter", group, 0), 0.0
        if self._spans_world(s.outputs[0]):
            return self.cm.grad_reduction_time(None, nbytes), 0.0
        times = [self.cm.grad_reduction_time(a, nbytes) for a, p in enumerate(s.outputs[0])
                 if p == R and self.mesh.shape[a] > 1]
        return (times[0], sum(times[1:])) if times else (0.0, 0.0)

    @functools.cached_property
    def launch_of(self) -> dict[fx.Node, int]:
        """Node → the gradient launch its term joins, numbered in launch order (the backward
        runs the forward in reverse): a parameter's gradient launches when the backward of its
        first user in the forward has run; an op's backward compute runs after the last
        launch its forward position follows. Ops whose backward runs before every launch,
        and parameters without users, are left out. One launch per distinct first use: each
        parameter is its own bucket (see :func:`~autoparallel.solver.problem.exposed_grad_rows`).
        Empty when the cost model does not overlap gradient reduction (``CostModel.overlap_grad_reduction``)."""
        if not self.cm.overlap_grad_reduction:
            return {}
        order = {n: i for i, n in enumerate(self.gm.graph.nodes)}
        first_use = {n: min(order[u] for u in n.users) for n in self.nodes if n.name in self.grad_params and n.users}
        cuts = sorted(set(first_use.values()))  # forward order; launch k is cuts[-1 - k]
        launch = {n: len(cuts) - 1 - cuts.index(t) for n, t in first_use.items()}
        for n in self.nodes:
            if n.op == "call_function":
                later = len(cuts) - bisect.bisect_right(cuts, order[n])  # launches that precede n's backward
                if later:
                    launch[n] = later - 1
        return launch

    def launch_term(self, node: fx.Node, s: Strategy) -> tuple[float, float]:
        """``(communication launched, backward compute)`` seconds of ``node`` under ``s`` at its
        launch (:attr:`launch_of`), for :func:`~autoparallel.solver.costs.exposed_comm_time`."""
        if node.op == "get_attr":
            return self.grad_reduction(node, s)[0], 0.0
        if node.op != "call_function" or not node_info(node).requires_grad:
            return 0.0, 0.0
        return 0.0, self.node_cost(node, s)[0] - self.node_cost(node, s, backward=False)[0]

    def layout_for(self, val: tuple[fx.Node, int]) -> Redistributor:
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

    def redistribute(self, val: tuple[fx.Node, int], requires_grad: bool, src: Spec, dst: Spec):
        """``(seconds, moves)`` of the cheapest redistribution of value ``val`` from ``src`` to ``dst``."""
        shape, dtype = node_info(val[0]).outputs[val[1]]
        return self.layout_for(val).redistribute(shape, dtype.itemsize, dtype.is_floating_point, src, dst,
                                                 requires_grad)

    def edge_cost(self, key, val, rg, src: Spec, dst: Spec) -> float:
        """Redistribution seconds on edge ``key`` = (consumer, input, producer, output index);
        impossible on edges into in-place ops and their view chains (see aliased_edges)."""
        if src != dst and (key[0], key[1]) in self.pinned:
            return math.inf
        shape, dtype = node_info(val[0]).outputs[val[1]]
        return self.layout_for(val).cost(shape, dtype.itemsize, dtype.is_floating_point, src, dst, rg)

    def edges(self):
        """(consumer node, or None for the graph output; input position; value; requires_grad)."""
        for node in self.nodes:
            if node.op != "call_function":
                continue
            for j, (_, x) in enumerate(tensor_inputs(node)):
                yield node, j, self.value(x), node_info(x).requires_grad
        out = next(n for n in self.gm.graph.nodes if n.op == "output")
        for j, x in enumerate(output_leaves(out)):
            yield None, j, self.value(x), node_info(x).requires_grad

    def reduction_groups(self, spec: Spec) -> list[int | None]:
        """The process groups a gradient of a parameter held in ``spec`` is all-reduced over:
        mesh axes of more than one device, or ``[None]`` for the world's group
        (:meth:`_spans_world`)."""
        if self._spans_world(spec):
            return [None]
        return [a for a, p in enumerate(spec) if p == R and self.mesh.shape[a] > 1]

    def latency(self, group: int | None) -> float:
        """Seconds of an empty all-reduce over mesh axis ``group`` (``None``: the world)."""
        return self.cm.collective_time("all_reduce", group, 0)

    def grad_comm(self, choice: dict[fx.Node, Strategy]) -> tuple[float, float]:
        """``(grad_comm_s, exposed_grad_comm_s)`` of a strategy choice: the seconds of every
        gradient all-reduce (bandwidth over every axis plus one latency per axis), and the part
        of them the step waits for: what the runtime launches during the backward priced by
        :func:`~autoparallel.solver.costs.exposed_comm_time` over the launches of
        :attr:`launch_of`, the rest (further axes, latencies) in full. The ILP's objective
        prices the same (:mod:`autoparallel.solver.problem`)."""
        launches = [[0.0, 0.0] for _ in range(max(self.launch_of.values(), default=-1) + 1)]
        total = hidden = 0.0
        for node, s in choice.items():
            launched, after = self.grad_reduction(node, s)
            total += launched + after
            k = self.launch_of.get(node)
            if k is not None:
                hidden += launched
                g, c = self.launch_term(node, s)
                launches[k][0] += g
                launches[k][1] += c
        groups = {g for p in self.nodes if p.name in self.grad_params and not choice[p].zero_grad
                  for g in self.reduction_groups(choice[p].outputs[0])}
        latency = sum(self.latency(g) for g in groups)
        return total + latency, total - hidden + exposed_comm_time(launches) + latency


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

