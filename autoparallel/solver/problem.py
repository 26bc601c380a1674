"""The sharding ILP of a priced graph (Zheng et al., "Alpa", OSDI'22, §4: one choice among its
strategies per node, a resharding cost per edge), over groups of nodes: followers merged into
their producer's group, repeated layers sharing one set of variables, gradient reduction priced
by what the backward leaves exposed, once-paid latencies and DTensor overhead as fixed charges.

:func:`build_problem` builds it from the prices of :class:`~autoparallel.solver.pricing.Pricing`;
a :class:`GroupedProblem` holds it with what maps its solution back to the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch.fx as fx

from ..placement import R, Spec, is_replicated
from ..graph import tensor_inputs
from ..strategies import Strategy
from ..tracer.annotate import node_info
from .ilp import FixedCharge, Flow, ILPEdge, ILPProblem
from .pricing import Pricing


@dataclass
class GroupedProblem:
    """The sharding ILP of a graph over groups of nodes, and what maps its solution back.

    Attributes:
        ilp: one variable vector per group (a follower group whose layer template is
            itself) plus a last one for the graph output.
        strategies: node → its strategies (the nodes, in graph order).
        root: node → the root of its follower group (:func:`_follow`).
        fmap: node → per strategy of its group, the node's strategy index.
        template: node → the node whose variables it shares (itself when unshared).
        group: group root → its index in ``ilp.node_costs``.
        edges: every edge of the graph: ``(consumer or None for the output, input
            position, (producer, output index), requires_grad)``.
        stats: ``groups``, ``ilp_groups`` and ``shared_nodes``, for :class:`~autoparallel.results.SolverStats`.
    """

    ilp: ILPProblem
    strategies: dict[fx.Node, list[Strategy]]
    root: dict[fx.Node, fx.Node]
    fmap: dict[fx.Node, list[int]]
    template: dict[fx.Node, fx.Node]
    group: dict[fx.Node, int]
    edges: list[tuple]
    stats: dict[str, int]

    def group_of(self, node: fx.Node) -> int:
        """The ILP group index of ``node``."""
        return self.group[self.template[self.root[node]]]


def _follow(pricing: Pricing, strategies, layer) -> tuple[dict, dict]:
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
    for node in pricing.nodes:
        root[node], fmap[node] = node, list(range(len(strategies[node])))
        if node.op != "call_function":
            continue
        ins = [(j, pricing.value(x), node_info(x).requires_grad) for j, (_, x) in enumerate(tensor_inputs(node))]
        varying = [t for t in ins if len(strategies[root[t[1][0]]]) > 1]
        if len(varying) != 1:
            continue
        j, (u, idx), rg = varying[0]
        if layer[node] != layer.get(u):
            continue  # followers stay inside one layer, so that layers match
        r = root[u]
        sv = strategies[node]
        by_input: dict = {}
        for k, s in enumerate(sv):
            by_input.setdefault(s.inputs[j], []).append(k)
        f = []
        for i in range(len(strategies[r])):
            ks = by_input.get(strategies[u][fmap[u][i]].outputs[idx], [])
            if len(ks) != 1:
                break  # it would reshard, or could choose among outputs: let the ILP decide
            f.append(ks[0])
        if len(f) < len(strategies[r]):
            continue
        root[node], fmap[node] = r, f
    return root, fmap


def _shared(template, layer, root, fmap) -> dict[fx.Node, fx.Node]:
    """The layer template of every node. A layer whose follower grouping differs from its
    template's shares the variables of the first such layer of the same template that
    groups alike, or keeps its own: the first layer reads values from outside the layers,
    and when those are pinned (constraints, recipes) its nodes may follow differently from
    every later layer, which must not unshare them all."""
    orig = template
    bad = {layer[n] for n, t in orig.items()
           if t is not n and (orig.get(root[n]) is not root[t] or fmap[n] != fmap[t])}
    tmpl = dict(orig)
    by_layer: dict = {}  # bad layer -> its template's node -> its own node
    for n, t in orig.items():
        if t is not n and layer[n] in bad:
            by_layer.setdefault(layer[n], {})[t] = n
    leaders: list[dict] = []
    for nodes in by_layer.values():
        lead = next((c for c in leaders if c.keys() == nodes.keys() and all(
            c.get(orig[root[n]]) is root[c[t]] and fmap[n] == fmap[c[t]] for t, n in nodes.items())), None)
        if lead is None:
            leaders.append(nodes)
        for t, n in nodes.items():
            tmpl[n] = n if lead is None else lead[t]
    return tmpl


def build_problem(pricing: Pricing, strategies: dict[fx.Node, list[Strategy]], template: dict[fx.Node, fx.Node],
                  layer: dict[fx.Node, object], state_nodes: list[fx.Node]) -> GroupedProblem:
    """The ILP over shared groups of ``strategies`` priced by ``pricing`` (seconds), plus what
    maps its solution back.

    Args:
        template: node → the node of an identical earlier layer whose variables it shares
            (:func:`~autoparallel.solver.shared_layers.layer_templates`; itself when unshared).
        layer: node → its layer (:func:`~autoparallel.graph.layer_of`): followers stay inside one.
        state_nodes: the ``get_attr`` nodes of parameters and buffers, which the DTensor
            overhead is charged over.
    """
    nodes = pricing.nodes
    root, fmap = _follow(pricing, strategies, layer)
    tmpl = _shared(template, layer, root, fmap)
    croots = [n for n in nodes if root[n] is n and tmpl[n] is n]
    gidx = {n: i for i, n in enumerate(croots)}
    built = GroupedProblem(ILPProblem([], [], [r.name for r in croots] + ["output"]), strategies, root, fmap, tmpl,
                           gidx, list(pricing.edges()), {})
    built.ilp.node_costs = _group_costs(pricing, built, croots) + [[0.0]]  # the last group: the graph output
    built.ilp.exposed_rows = exposed_grad_rows(pricing, built)
    built.ilp.fixed_charges = (_latency_charges(pricing, built) + _zero_charges(pricing, built)
                               + _dtensor_charge(pricing, built, state_nodes))
    _add_edges(pricing, built)
    built.stats = {"groups": sum(1 for n in nodes if root[n] is n), "ilp_groups": len(croots),
                   "shared_nodes": sum(1 for n in nodes if tmpl[n] is not n)}
    return built

def _group_costs(pricing: Pricing, built: GroupedProblem, croots: list[fx.Node]) -> list[list[float]]:
    """Seconds of every ILP group per group strategy: its nodes' compute and own
    communication, each shared node counted once per layer that shares it. Gradient
    reduction launched during the backward is left to :func:`exposed_grad_rows`."""
    gcost = [[0.0] * len(built.strategies[r]) for r in croots]
    node_costs: dict[fx.Node, list[float]] = {}
    for node in pricing.nodes:
        t = built.template[node]
        if t not in node_costs:
            hide = t in pricing.launch_of
            node_costs[t] = [sum(pricing.node_cost(t, s)[:2]) - (pricing.grad_reduction(t, s)[0] if hide else 0.0)
                             for s in built.strategies[t]]
        g = built.group[built.root[t]]
        for i, k in enumerate(built.fmap[t]):
            gcost[g][i] += node_costs[t][k]
    return gcost


def exposed_grad_rows(pricing: Pricing, built: GroupedProblem) -> list[list[list[float]]]:
    """The ILP's exposed-communication rows (:class:`~autoparallel.solver.ilp.ILPProblem`):
    per gradient launch, per ILP group and group strategy, the gradient-reduction seconds
    launched there minus the backward compute seconds that run after it and before the
    next launch (:meth:`~autoparallel.solver.pricing.Pricing.launch_term`). Each parameter
    launches when its own gradient is complete, as if buckets held one parameter: the runtime's buckets
    (:mod:`autoparallel.passes.grad_buckets`) launch when their last gradient is, which
    this prices optimistically by at most one bucket's all-reduce."""
    rows = [[[] for _ in built.ilp.node_costs] for _ in range(max(pricing.launch_of.values(), default=-1) + 1)]
    terms: dict[fx.Node, list[float]] = {}
    for node, k in pricing.launch_of.items():
        t = built.template[node]
        if t not in terms:
            terms[t] = [g - c for g, c in (pricing.launch_term(t, s) for s in built.strategies[t])]
        if not any(terms[t]):
            continue
        g = built.group[built.root[t]]
        row = rows[k][g] = rows[k][g] or [0.0] * len(built.fmap[t])
        for i, si in enumerate(built.fmap[t]):
            row[i] += terms[t][si]
    return rows


def _latency_charges(pricing: Pricing, built: GroupedProblem) -> list[FixedCharge]:
    """One all-reduce latency per process group that some parameter's gradient is reduced
    over (:meth:`~autoparallel.solver.pricing.Pricing.reduction_groups`: a mesh axis, or the
    world; the gradient buckets' latency, paid once per group and in full), as ILP fixed charges over the strategies
    that reduce over it."""
    charges = []
    for group in [None] + [a for a, n in enumerate(pricing.mesh.shape) if n > 1]:
        strategies: dict[int, list[int]] = {}
        for node in pricing.nodes:
            if node.name in pricing.grad_params:
                t = built.template[node]
                ks = [i for i, si in enumerate(built.fmap[t]) if not built.strategies[t][si].zero_grad
                      and group in pricing.reduction_groups(built.strategies[t][si].outputs[0])]
                if ks:
                    strategies[built.group[built.root[t]]] = ks
        if strategies:
            charges.append(FixedCharge(pricing.latency(group), strategies))
    return charges


def _zero_charges(pricing: Pricing, built: GroupedProblem) -> list[FixedCharge]:
    """The latencies ZeRO parameters share, once per step per collective and process group
    (:meth:`~autoparallel.solver.pricing.Pricing.zero_charges`: the shards' all-gather after the
    step, stage 2's reduce-scatter), as ILP fixed charges over the strategies that pay them."""
    by_charge: dict[tuple, dict[int, list[int]]] = {}
    for node in pricing.nodes:
        if node.name not in pricing.grad_params:
            continue
        t = built.template[node]
        for i, si in enumerate(built.fmap[t]):
            for charge in pricing.zero_charges(built.strategies[t][si]):
                by_charge.setdefault(charge, {}).setdefault(built.group[built.root[t]], []).append(i)
    return [FixedCharge(pricing.cm.collective_time(kind, g, 0), {k: sorted(set(v)) for k, v in strategies.items()})
            for (kind, g), strategies in by_charge.items()]


def _dtensor_charge(pricing: Pricing, built: GroupedProblem, state_nodes) -> list[FixedCharge]:
    """:meth:`~autoparallel.solver.pricing.Pricing.dtensor_overhead` as an ILP fixed charge over
    every strategy that does not replicate a parameter or buffer (``state_nodes``) on every device."""
    cost, strategies = pricing.dtensor_overhead(), {}
    for node in state_nodes:
        t = built.template[node]
        ks = [i for i, si in enumerate(built.fmap[t])
              if not is_replicated(built.strategies[t][si].outputs[0]) or built.strategies[t][si].zero]
        if ks:
            g = built.group[built.root[t]]
            strategies[g] = sorted(set(strategies.get(g, [])) | set(ks))
    return [FixedCharge(cost, strategies)] if cost and strategies else []


def _add_edges(pricing: Pricing, built: GroupedProblem) -> None:
    """Resharding seconds of every edge: edges inside one group add to its node costs,
    the others become ILP edges between spec classes; edges of shared layers are
    priced once and counted once per layer."""
    tmpl, fmap, ilp = built.template, built.fmap, built.ilp
    out_g = len(ilp.node_costs) - 1
    repl = (R,) * pricing.mesh.ndim  # the output group's one (nominal) strategy
    acc = {}
    for consumer, j, (u, idx), rg in built.edges:
        tc, tu = (tmpl[consumer] if consumer is not None else None), tmpl[u]
        key = (tc, j, tu, idx)
        if key in acc:
            acc[key][1] += 1
            continue
        src_specs = [built.strategies[tu][k].outputs[idx] for k in fmap[tu]]
        dst_specs = [repl] if tc is None else [built.strategies[tc][k].inputs[j] for k in fmap[tc]]
        gu = built.group[built.root[tu]]
        gv = out_g if tc is None else built.group[built.root[tc]]
        if gu == gv:  # inside one group: a cost per strategy of the group
            vec = [pricing.edge_cost(key, (tu, idx), rg, a, b) for a, b in zip(src_specs, dst_specs)]
            acc[key] = [("internal", gu, vec), 1]
            continue
        if tc is None:  # a returned value: its target follows its source (returned_spec)
            o_cls, o_list = _classes(src_specs)
            cost = [[pricing.edge_cost(key, (tu, idx), rg, o, pricing.returned_spec(j, o))] for o in o_list]
            acc[key] = [("edge", ILPEdge(gu, gv, o_cls, [0], cost)), 1]
        else:
            acc[key] = [("edge", _pair_edge(pricing, key, (tu, idx), rg, gu, gv, src_specs, dst_specs)), 1]
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


def _pair_edge(pricing: Pricing, key, val, rg, gu: int, gv: int, src_specs: list[Spec],
               dst_specs: list[Spec]) -> ILPEdge:
    """The ILP edge between groups ``gu`` and ``gv`` (both with a choice) on edge ``key``
    (:meth:`~autoparallel.solver.pricing.Pricing.edge_cost`) for the specs its producer's and
    consumer's group strategies give and ask for: costs per pair of spec classes from the tensor's distance matrix
    (:meth:`~autoparallel.solver.layout.Redistributor.distances`), and, when the tensor's
    spec graph has fewer useful moves than the edge has pairs of classes, the same costs
    as a :class:`~autoparallel.solver.ilp.Flow` over those moves. Pinned edges (no
    redistribution) and specs cut in units keep the pairwise form."""
    o_cls, o_list = _classes(src_specs)
    i_cls, i_list = _classes(dst_specs)
    shape, dtype = node_info(val[0]).outputs[val[1]]
    g, d, move_s = pricing.layout_for(val).distances(shape, dtype.itemsize, dtype.is_floating_point, rg)
    o_ids, i_ids = [g.index.get(s) for s in o_list], [g.index.get(s) for s in i_list]
    if None in o_ids or None in i_ids or (key[0], key[1]) in pricing.pinned:  # unit cuts: not in g
        cost = [[pricing.edge_cost(key, val, rg, o, i) for i in i_list] for o in o_list]
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


def _classes(specs: list[Spec]) -> tuple[list[int], list[Spec]]:
    uniq: dict[Spec, int] = {}
    cls = [uniq.setdefault(s, len(uniq)) for s in specs]
    return cls, list(uniq)
