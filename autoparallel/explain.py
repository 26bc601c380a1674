"""Why a node has its strategy: the chosen strategy against the node's next best ones.

**Alternative** (the definition :meth:`Plan.explain <autoparallel.plan.Plan.explain>`
answers with): for a node ``v`` whose chosen strategy is ``s*``, every other strategy ``s``
of ``v``, every other node keeping its chosen strategy ("neighbours fixed"). Its cost is

    cost(s) = compute(v, s) + own_comm(v, s)
              + Σ_{edges u→v} redistribute(spec_u → input spec of s)
              + Σ_{edges v→w} redistribute(output spec of s → spec w needs)

in seconds, where ``compute`` is forward + backward compute, ``own_comm`` the
communication the node itself issues (a parameter's gradient reduction, an op's own
collective) and the redistributions are priced as in the ILP
(:class:`~autoparallel.solver.layout.Redistributor`); memory is the bytes per device of
the node's outputs (with the gradient for a parameter). These are exactly the terms of the
sharding ILP (Alpa, Zheng et al., OSDI 2022, §4.2) that depend on ``v``'s choice alone.
For an optimal plan without a memory budget, shared layers or exposed-communication
terms, ``s*`` is therefore the cheapest; otherwise an alternative may be cheaper locally
and be ruled out by what the local view omits (the same strategy in every repeated
layer, the memory budget, overlap of gradient communication): explain says so.

Computed once at solve time (:func:`alternatives`, stored in ``Plan.alternatives``), so
explaining needs no re-solve.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .placement import spec_from_json, spec_to_json

if TYPE_CHECKING:  # the planner builds alternatives; the plan prints them
    from .plan import Plan

KEEP = 3
"""Alternatives stored per node, cheapest first."""


def alternatives(planner, choice: dict, edges: list) -> dict[str, dict]:
    """Per node with more than one strategy: its chosen strategy and its :data:`KEEP`
    cheapest alternatives (module docstring), each ``{"specs": [input specs, output
    specs] (JSON, as ``Plan.to_json``), "compute_s",
    "comm_s", "memory_bytes", "cost_s"}``, under ``"chosen"`` and ``"alternatives"``
    (ascending ``cost_s``). A node of a repeated layer that shares its template's ILP
    variables (:mod:`~autoparallel.solver.shared_layers`) gets ``{"same_as": template}``:
    its alternatives are the template's, priced with the template's neighbours.

    Args:
        planner: the :class:`~autoparallel.solver.planner.Planner` that solved.
        choice: node → chosen strategy.
        edges: the planner's edges ``(consumer or None, input position, (producer, output
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
    for node, strategies in planner.strategies.items():
        if len(strategies) < 2 or node not in choice:
            continue
        template = planner.template.get(node, node)
        if template is not node:  # a repeated layer's copy: priced once, on its template
            result[node.name] = {"same_as": template.name}
            continue
        priced = []
        for s in strategies:
            row = _price(planner, node, s, choice, into.get(node, ()), out_of.get(node, ()))
            if row is not None:
                priced.append((row["cost_s"], s is not choice[node], row))
        chosen = next((r for _, other, r in priced if not other), None)
        if chosen is None:
            continue
        rest = sorted((r for _, other, r in priced if other), key=lambda r: (r["cost_s"], str(r["specs"])))
        result[node.name] = {"chosen": chosen, "alternatives": rest[:KEEP]}
    return result


def _price(planner, node, s, choice, ins, outs) -> dict | None:
    """The cost row of ``node`` under strategy ``s``, neighbours at ``choice``; ``None``
    when ``s`` needs an impossible redistribution."""
    compute, own, mem = planner.node_cost(node, s)
    comm = own
    for consumer, j, (u, idx), rg in ins:
        key = (consumer, j, u, idx)
        comm += planner._edge_cost(key, (u, idx), rg, choice[u].outputs[idx], s.inputs[j])
    for consumer, j, (u, idx), rg in outs:
        key = (consumer, j, u, idx)
        src = s.outputs[idx]
        dst = planner.returned_spec(j, src) if consumer is None else choice[consumer].inputs[j]
        comm += planner._edge_cost(key, (u, idx), rg, src, dst)
    if math.isinf(comm):
        return None
    specs = [[spec_to_json(x) for x in s.inputs], [spec_to_json(x) for x in s.outputs]]
    return {"specs": specs, "compute_s": compute, "comm_s": comm, "memory_bytes": int(mem),
            "cost_s": compute + comm}


def explain(plan: "Plan", name: str) -> str:
    """The text of :meth:`Plan.explain <autoparallel.plan.Plan.explain>`: for every node
    ``name`` designates (a parameter or buffer name, tied names included; a module path:
    the nodes run directly in that module; or a node name), its chosen strategy and the
    stored alternatives with their differences in compute, communication, memory and total.

    Raises:
        KeyError: ``name`` designates no node of the plan; the message gives examples.
    """
    nodes = _designated(plan, name)
    if not nodes:
        some = list(plan.param_placements)[:2] + [n.module_path for n in plan.nodes.values() if n.module_path][:1]
        raise KeyError(f"{name!r} is not a parameter, buffer, module path or node of the plan; e.g. {some}")
    lines = [] if plan.alternatives else ["(this plan records no alternatives: it was made by hand, by make_plan, "
                                          "or before they were recorded; plan again to see them)"]
    for n in nodes:
        lines += _explain_node(plan, n)
    return "\n".join(lines)


def _designated(plan: "Plan", name: str) -> list[str]:
    if name in plan.nodes:
        return [name]
    state = [n for n, names in plan.state_nodes.items() if name in names]
    if state:
        return state
    return [n.name for n in plan.nodes.values() if n.module_path == name and n.op not in ("getitem", "placeholder")]


def _explain_node(plan: "Plan", node_name: str) -> list[str]:
    from .summary import named_specs

    node = plan.nodes[node_name]
    target = (plan.state_nodes.get(node_name) or [None])[0]
    head = f"{node_name} ({node.op}{', ' + target if target else ''}{', in ' + node.module_path if node.module_path else ''})"
    entry = plan.alternatives.get(node_name)
    if entry is not None and "same_as" in entry:
        head += f", priced on {entry['same_as']}: the same node of the layer it shares a plan with"
        entry = plan.alternatives.get(entry["same_as"])
    if entry is None:
        return [f"{head}: {named_specs(plan, node.input_specs, node.output_specs)} — its only strategy "
                "(a single choice, or pinned by a constraint)"]
    c = entry["chosen"]
    lines = [f"{head}", f"  chosen       {_row_specs(plan, c)}: compute {_t(c['compute_s'])}, communication "
                        f"{_t(c['comm_s'])}, memory {_b(c['memory_bytes'])}"]
    for k, a in enumerate(entry["alternatives"]):
        d = a["cost_s"] - c["cost_s"]
        lines.append(f"  {'next best' if k == 0 else 'then':<12} {_row_specs(plan, a)}: {_dt(d)} total "
                     f"(compute {_dt(a['compute_s'] - c['compute_s'])}, communication "
                     f"{_dt(a['comm_s'] - c['comm_s'])}, memory {_db(a['memory_bytes'] - c['memory_bytes'])})"
                     + ("  <- cheaper alone; ruled out by the shared layers, the memory budget, the overlap "
                        "terms or the solver's time limit"
                        if d < 0 else ""))
    if not entry["alternatives"]:
        lines.append("  (every other strategy needs an impossible redistribution)")
    return lines


def _row_specs(plan: "Plan", row: dict) -> str:
    from .summary import named_specs

    ins, outs = row["specs"]
    return named_specs(plan, [spec_from_json(s) for s in ins], [spec_from_json(s) for s in outs])


def _t(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def _dt(s: float) -> str:
    return f"{'+' if s >= 0 else '-'}{abs(s) * 1e3:.3g} ms"


def _b(n: int) -> str:
    return f"{n / 2**20:.3g} MiB"


def _db(n: int) -> str:
    return f"{'+' if n >= 0 else '-'}{abs(n) / 2**20:.3g} MiB"

