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

Computed once at solve time (:func:`autoparallel.solver.inspect.alternatives`, stored in
``plan.inspection.alternatives``), so explaining needs no re-solve.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .placement import spec_from_json

if TYPE_CHECKING:  # the solver records alternatives; this prints them
    from .plan import Plan


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
    lines = [] if plan.inspection.alternatives else [
        "(this plan records no alternatives: it was made by hand, by make_plan, or before they were recorded; "
        "plan again to see them)"]
    for n in nodes:
        lines += _explain_node(plan, n)
    return "\n".join(lines)


def _designated(plan: "Plan", name: str) -> list[str]:
    if name in plan.nodes:
        return [name]
    state = [n for n, names in plan.inspection.state_nodes.items() if name in names]
    if state:
        return state
    return [n.name for n in plan.nodes.values() if n.module_path == name and n.op not in ("getitem", "placeholder")]


def _explain_node(plan: "Plan", node_name: str) -> list[str]:
    from .summary import named_specs

    node = plan.nodes[node_name]
    target = (plan.inspection.state_nodes.get(node_name) or [None])[0]
    head = f"{node_name} ({node.op}{', ' + target if target else ''}{', in ' + node.module_path if node.module_path else ''})"
    entry = plan.inspection.alternatives.get(node_name)
    if entry is not None and "same_as" in entry:
        head += f", priced on {entry['same_as']}: the same node of the layer it shares a plan with"
        entry = plan.inspection.alternatives.get(entry["same_as"])
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

