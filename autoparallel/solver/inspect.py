"""What the views of a plan read, computed when it is solved (:class:`~autoparallel.results.Inspection`):
per-node alternatives (what :mod:`autoparallel.explain` prints; the definition of an
alternative is there), the memory timeline (:mod:`autoparallel.plot`), parameter names per
``get_attr`` node and what each is read through (:mod:`autoparallel.summary`). The views
only read these; they import nothing from the solver.
"""

from __future__ import annotations

import math

import numpy as np
import torch.fx as fx

from ..constraints import read_through
from ..placement import spec_to_json

KEEP = 3
"""Alternatives stored per node, cheapest first."""


def alternatives(pricing, strategies: dict, template: dict, choice: dict, edges: list) -> dict[str, dict]:
    """Per node with more than one strategy: its chosen strategy and its :data:`KEEP`
    cheapest alternatives (module docstring), each ``{"specs": [input specs, output
    specs] (JSON, as ``Plan.to_json``), "compute_s",
    "comm_s", "memory_bytes", "cost_s"}``, under ``"chosen"`` and ``"alternatives"``
    (ascending ``cost_s``). A node of a repeated layer that shares its template's ILP
    variables (:mod:`~autoparallel.solver.shared_layers`) gets ``{"same_as": template}``:
    its alternatives are the template's, priced with the template's neighbours.

    Args:
        pricing: the :class:`~autoparallel.solver.pricing.Pricing` of the graph.
        strategies: node → its strategies; template: node → the node whose ILP variables it
            shares (:attr:`~autoparallel.solver.planner.Planner.template`).
        choice: node → chosen strategy.
        edges: the graph's edges ``(consumer or None, input position, (producer, output
            index), requires_grad)``.
    """
    into: dict = {}
    out_of: dict = {}
    for e in edges:
        consumer, _, (u, _), _ = e
        if consumer is not None:
            into.setdefault(consumer, []).append(e)
        out_of.setdefault(u, []).append(e)
    result = {}
    for node, options in strategies.items():
        if len(options) < 2 or node not in choice:
            continue
        shared = template.get(node, node)
        if shared is not node:  # a repeated layer's copy: priced once, on its template
            result[node.name] = {"same_as": shared.name}
            continue
        priced = []
        for s in options:
            row = _price(pricing, node, s, choice, into.get(node, ()), out_of.get(node, ()))
            if row is not None:
                priced.append((row["cost_s"], s is not choice[node], row))
        chosen = next((r for _, other, r in priced if not other), None)
        if chosen is None:
            continue
        rest = sorted((r for _, other, r in priced if other), key=lambda r: (r["cost_s"], str(r["specs"])))
        result[node.name] = {"chosen": chosen, "alternatives": rest[:KEEP]}
    return result


def _price(pricing, node, s, choice, ins, outs) -> dict | None:
    """The cost row of ``node`` under strategy ``s``, neighbours at ``choice``; ``None``
    when ``s`` needs an impossible redistribution."""
    compute, own, mem = pricing.node_cost(node, s)
    comm = own
    for consumer, j, (u, idx), rg in ins:
        key = (consumer, j, u, idx)
        comm += pricing.edge_cost(key, (u, idx), rg, choice[u].outputs[idx], s.inputs[j])
    for consumer, j, (u, idx), rg in outs:
        key = (consumer, j, u, idx)
        src = s.outputs[idx]
        dst = pricing.returned_spec(j, src) if consumer is None else choice[consumer].inputs[j]
        comm += pricing.edge_cost(key, (u, idx), rg, src, dst)
    if math.isinf(comm):
        return None
    specs = [[spec_to_json(x) for x in s.inputs], [spec_to_json(x) for x in s.outputs]]
    return {"specs": specs, "compute_s": compute, "comm_s": comm, "memory_bytes": int(mem),
            "cost_s": compute + comm}


POINTS = 256
"""Samples kept of the memory timeline: each the step of largest total in its stretch of steps."""


def memory_timeline(memory, choice: dict, points: int = POINTS) -> dict:
    """The memory timeline of ``choice`` downsampled to at most ``points`` steps, keeping
    the step of largest total in each stretch (so the peak is kept exactly).

    Returns:
        ``{"steps": number of steps (forward is the first half), "step": [sampled step],
        "total": [bytes], "by_kind": {kind: [bytes]}}``, bytes per device.
    """
    total, by_kind = memory.timeline(choice)
    n = len(total)
    idx = [int(b[np.argmax(total[b])]) for b in np.array_split(np.arange(n), min(points, n)) if len(b)]
    return {"steps": n, "step": idx, "total": [int(total[i]) for i in idx],
            "by_kind": {k: [int(v[i]) for i in idx] for k, v in by_kind.items()}}


def state_reads(gm: fx.GraphModule, state_nodes) -> dict[str, list[str]]:
    """The nodes each parameter's ``get_attr`` node of ``gm`` (those named in ``state_nodes``)
    is read through: its mixed-precision cast and its slices
    (:func:`autoparallel.constraints.read_through`), by node name; what
    :func:`autoparallel.summary.parameter_use` follows. Parameters read directly are left out."""
    reads = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and node.name in state_nodes:
            through = [n.name for n in read_through(node)]
            if through:
                reads[node.name] = through
    return reads
