"""An ILP solution back to a :class:`~autoparallel.plan.Plan`: each node's strategy
(:func:`choice_of`), then the plan of that choice (:func:`make_plan`): per node its placements
and seconds, the redistributions on the edges that reshard, the parameters' placements and
the step's estimate, all priced by :class:`~autoparallel.solver.pricing.Pricing`.
"""

from __future__ import annotations

import math

import torch.fx as fx

from ..graph import tensor_inputs
from ..plan import NodePlan, Plan, Redistribution, holds_dtensors
from ..results import Estimate
from ..strategies import Strategy
from ..strategies.zero import state_spec_of
from ..tracer.annotate import node_info
from .ilp import ILPSolution
from .memory import MemoryModel
from .pricing import Pricing
from .problem import GroupedProblem


def op_name(node: fx.Node) -> str:
    """The op a plan records for ``node``: ``placeholder``, ``get_attr`` or the target's name."""
    if node.op in ("placeholder", "get_attr"):
        return node.op
    return getattr(node.target, "__name__", str(node.target))


def choice_of(built: GroupedProblem, sol: ILPSolution) -> dict[fx.Node, Strategy]:
    """Node → strategy of an ILP solution of ``built``."""
    return {n: built.strategies[n][built.fmap[n][sol.choice[built.group_of(n)]]] for n in built.strategies}


def make_plan(pricing: Pricing, choice: dict[fx.Node, Strategy], edges, param_names,
              memory: MemoryModel | None) -> Plan:
    """The Plan of a strategy choice.

    Args:
        edges: the edges to redistribute on (:meth:`~autoparallel.solver.pricing.Pricing.edges`).
        param_names: graph target → all names of that parameter/buffer.
        memory: the step's memory model, for the estimate's peak (bytes); ``None``: no peak.
    """
    nodes = _node_plans(pricing, choice)
    redistributions = _redistributions(pricing, choice, edges, nodes)
    params, offloaded, states, scattered = {}, [], {}, []
    for node in pricing.nodes:
        if node.op == "get_attr" and node.target in param_names:
            for name in param_names[node.target]:
                params[name] = choice[node].outputs[0]
                if choice[node].offload:
                    offloaded.append(name)
                if choice[node].zero:
                    states[name] = state_spec_of(node, choice[node], pricing.mesh.shape)
                if choice[node].zero_grad:
                    scattered.append(name)
    estimate = _estimate(pricing, choice, nodes, redistributions, params, memory, bool(states))
    return Plan(pricing.mesh, nodes, redistributions, params, estimate, outputs=pricing.outputs,
                offloaded=tuple(offloaded), state_placements=states, sharded_gradients=tuple(scattered))


def _node_plans(pricing: Pricing, choice: dict[fx.Node, Strategy]) -> dict[str, NodePlan]:
    """Node name → its NodePlan: placements, compute and own communication seconds, bytes."""
    nodes: dict[str, NodePlan] = {}
    for node in pricing.gm.graph.nodes:
        if node.op == "output":
            continue
        info = node_info(node) if "autoparallel" in node.meta else None
        if node in pricing.aliases:
            u, idx = pricing.aliases[node]
            spec = choice[u].outputs[idx]
            nodes[node.name] = NodePlan(node.name, "getitem", info.module_path if info else "",
                                        [], [s for s, _ in info.outputs] if info else [], [], [spec])
            continue
        if node not in choice:
            continue
        s = choice[node]
        compute, comm, mem = pricing.node_cost(node, s)
        nodes[node.name] = NodePlan(
            node.name, op_name(node), info.module_path,
            [tuple(x.meta["val"].shape) for _, x in tensor_inputs(node)] if node.op == "call_function" else [],
            [sh for sh, _ in info.outputs], list(s.inputs), list(s.outputs), compute, comm, mem)
    return nodes


def _redistributions(pricing: Pricing, choice, edges, nodes: dict[str, NodePlan]) -> list[Redistribution]:
    """The moves of every edge whose two ends differ; each adds its seconds to its consumer's
    ``comm_s`` in ``nodes``."""
    redistributions = []
    for consumer, j, (u, idx), rg in edges:
        src = choice[u].outputs[idx]
        dst = pricing.returned_spec(j, src) if consumer is None else choice[consumer].inputs[j]
        if src == dst:
            continue
        cost, moves = pricing.redistribute((u, idx), rg, src, dst)
        if math.isinf(cost):
            raise RuntimeError(f"no redistribution {src} -> {dst} for {u.name}")
        name = "output" if consumer is None else consumer.name
        redistributions.append(Redistribution(u.name, idx, name, j, node_info(u).outputs[idx][0], list(moves), cost))
        if consumer is not None:
            nodes[name].comm_s += cost
    return redistributions


def _estimate(pricing: Pricing, choice, nodes, redistributions, params, memory: MemoryModel | None,
              zero: bool) -> Estimate:
    """The step's estimate (seconds, bytes) from the plan's nodes and redistributions."""
    peak = memory.estimate(choice).as_peak() if memory is not None else None
    compute = sum(n.compute_s for n in nodes.values())
    comm = sum(n.comm_s for n in nodes.values()) + sum(c.cost_s for c in redistributions if c.dst == "output")
    # the nodes' comm_s hold their gradients' whole bandwidth; the step waits for the exposed part
    grad_total, grad_exposed = pricing.grad_comm(choice)
    comm += grad_exposed - sum(sum(pricing.grad_reduction(n, s)) for n, s in choice.items())
    comm += pricing.zero_latencies(choice)  # the nodes' comm_s hold their all-gathers' bandwidth
    # compute holds the optimizer step: each trainable parameter's node_cost is its update
    optimizer = sum(pricing.optimizer_time(n, s) for n, s in choice.items())
    if zero or holds_dtensors(params):  # in no node's compute_s: paid once for the module
        overhead = pricing.dtensor_overhead()
        optimizer += overhead
        compute += overhead
    return Estimate(step_time_s=compute + comm, compute_s=compute, comm_s=comm, optimizer_s=optimizer,
                    grad_comm_s=grad_total, exposed_grad_comm_s=grad_exposed,
                    peak_memory_bytes=peak.peak_bytes if peak else None, memory=peak)
