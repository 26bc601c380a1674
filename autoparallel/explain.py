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

**A module** is explained by its parts: one line per parameter or buffer it holds (placement,
use, cost and the next best alternative) and per direct submodule (its parameters'
placements and the sums of its nodes' compute, communication and output memory), plus the
ops it runs itself; its nodes one by one with ``nodes=True``.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from . import units
from .placement import spec_from_json
from .summary import columns, named, named_specs, node_module, parameter_use

if TYPE_CHECKING:  # the solver records alternatives; this prints them
    from .plan import NodePlan, Plan

PLACEMENTS_WIDTH = 44
"""Characters of a submodule's placements in a module's explanation; longer ones end with ``…``."""


def explain(plan: "Plan", name: str, nodes: bool = False) -> str:
    """The text of :meth:`Plan.explain <autoparallel.plan.Plan.explain>`: for a parameter or
    buffer name (tied names included) or a node name, its node's chosen strategy and the stored
    alternatives with their differences in compute, communication (seconds) and memory
    (bytes per device); for a module path, one line per parameter it holds and per direct
    submodule (module docstring), or with ``nodes`` every node run directly in the module.

    Raises:
        KeyError: ``name`` designates no node of the plan; the message gives examples.
    """
    designated = _designated(plan, name)
    inside = [] if designated else _under(plan, name)
    if not designated and not inside:
        some = list(plan.param_placements)[:2] + [n.module_path for n in plan.nodes.values() if n.module_path][:1]
        raise KeyError(f"{name!r} is not a parameter, buffer, module path or node of the plan; e.g. {some}")
    if inside and not nodes:
        return _explain_module(plan, name, inside)
    if inside:
        designated = [n.name for n in inside if n.module_path == name and n.op not in ("getitem", "placeholder")]
    lines = [] if plan.inspection.alternatives else [
        "(this plan records no alternatives: it was made by hand, by make_plan, or before they were recorded; "
        "plan again to see them)"]
    for n in designated:
        lines += _explain_node(plan, n)
    return "\n".join(lines)


def _designated(plan: "Plan", name: str) -> list[str]:
    """The node called ``name``, or the node of the parameter or buffer called ``name``."""
    if name in plan.nodes:
        return [name]
    return [n for n, names in plan.inspection.state_nodes.items() if name in names]


def _under(plan: "Plan", path: str) -> list["NodePlan"]:
    """The nodes of module ``path`` and its submodules (:func:`~autoparallel.summary.node_module`)."""
    return [n for n in plan.nodes.values() if _within(node_module(plan, n), path)]


def _within(module: str, path: str) -> bool:
    return bool(path) and (module == path or module.startswith(path + "."))


def _explain_module(plan: "Plan", path: str, inside: list["NodePlan"]) -> str:
    """One line per parameter ``path`` holds, per direct submodule, and for its own ops."""
    params: dict[str, "NodePlan"] = {}
    children: dict[str, list["NodePlan"]] = {}
    own: list["NodePlan"] = []
    for n in inside:
        rest = node_module(plan, n)[len(path) + 1:]
        if rest:
            children.setdefault(rest.split(".")[0], []).append(n)
        elif n.op == "get_attr":
            params[_param_name(plan, n, path)] = n
        else:
            own.append(n)
    rows = [("", "placement", "compute", "communication", "memory", "")]
    rows += [_parameter_row(plan, leaf, n) for leaf, n in params.items()]
    rows += [_sum_row(child, _placements(plan, f"{path}.{child}"), members) for child, members in children.items()]
    if own:
        rows.append(_sum_row("(its own ops)", "", own, _costliest_ops(own)))
    head = (f"{path}: {len(inside)} nodes, compute {units.seconds(sum(n.compute_s for n in inside))}, communication "
            f"{units.seconds(sum(n.comm_s for n in inside))}, memory {units.nbytes(sum(n.memory_bytes for n in inside))} "
            "per device (its nodes' outputs; a parameter with its gradient)")
    return "\n".join([head, columns(rows), f"(node by node: plan.explain({path!r}, nodes=True))"])


def _costliest_ops(nodes: list["NodePlan"], top: int = 3) -> str:
    """``"14 ops, the costliest: scaled_dot_product_attention, mul, add"`` (by compute and communication)."""
    ops = [n for n in nodes if n.op not in ("getitem", "placeholder")]
    cost: Counter = Counter()
    for n in ops:
        cost[n.op.partition(".")[0]] += n.compute_s + n.comm_s
    names = [op for op, _ in cost.most_common(top)]
    return f"{len(ops)} ops, the costliest: {', '.join(names)}" + (", …" if len(cost) > top else "")


def _param_name(plan: "Plan", node: "NodePlan", path: str) -> str:
    names = plan.inspection.state_nodes[node.name]
    return next((n for n in names if n.rpartition(".")[0] == path), names[0]).rpartition(".")[2]


def _parameter_row(plan: "Plan", leaf: str, node: "NodePlan") -> tuple[str, ...]:
    """A parameter or buffer: its placement and use, its cost, and its next best alternative."""
    spec = named(plan, node.output_specs[0]) if node.output_specs else "?"
    return (leaf, f"{list(node.out_shapes[0]) if node.out_shapes else ''} {spec}, {parameter_use(plan, node.name)}",
            units.seconds(node.compute_s), units.seconds(node.comm_s), units.nbytes(node.memory_bytes),
            _next_best(plan, node.name))


def _sum_row(label: str, placements: str, members: list["NodePlan"], note: str = "") -> tuple[str, ...]:
    return (label, placements, units.seconds(sum(n.compute_s for n in members)),
            units.seconds(sum(n.comm_s for n in members)), units.nbytes(sum(n.memory_bytes for n in members)), note)


def _placements(plan: "Plan", path: str) -> str:
    """The placements of the parameters and buffers under ``path``: ``"weight S1(tp), bias R"``
    for up to three, else counted (``"12 tensors: R ×10, S1(tp) ×2"``), cut to :data:`PLACEMENTS_WIDTH`."""
    held = [(n[len(path) + 1:], named(plan, s)) for n, s in plan.param_placements.items() if _within(n, path)]
    if len(held) <= 3:
        text = ", ".join(f"{n} {s}" for n, s in held)
    else:
        text = f"{len(held)} tensors: " + ", ".join(f"{s} ×{k}" for s, k in Counter(s for _, s in held).most_common())
    return text if len(text) <= PLACEMENTS_WIDTH else text[:PLACEMENTS_WIDTH - 1] + "…"


def _next_best(plan: "Plan", node_name: str) -> str:
    """``"next best S0(tp): +9.89 µs"`` from the node's recorded alternatives (its template's
    in a shared layer); ``""`` when the plan records none."""
    if not plan.inspection.alternatives:
        return ""
    entry = plan.inspection.alternatives.get(node_name)
    if entry is not None and "same_as" in entry:
        entry = plan.inspection.alternatives.get(entry["same_as"])
    if entry is None:
        return "its only strategy"
    if not entry["alternatives"]:
        return "every other strategy needs an impossible redistribution"
    best = entry["alternatives"][0]
    d = best["cost_s"] - entry["chosen"]["cost_s"]
    return f"next best {_row_specs(plan, best)}: {units.seconds(d, sign=True)}" + (" (cheaper alone)" if d < 0 else "")


def _explain_node(plan: "Plan", node_name: str) -> list[str]:
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
    lines = [f"{head}", f"  chosen       {_row_specs(plan, c)}: compute {units.seconds(c['compute_s'])}, communication "
                        f"{units.seconds(c['comm_s'])}, memory {units.nbytes(c['memory_bytes'])}"]
    for k, a in enumerate(entry["alternatives"]):
        d = a["cost_s"] - c["cost_s"]
        lines.append(f"  {'next best' if k == 0 else 'then':<12} {_row_specs(plan, a)}: {units.seconds(d, sign=True)} total "
                     f"(compute {units.seconds(a['compute_s'] - c['compute_s'], sign=True)}, communication "
                     f"{units.seconds(a['comm_s'] - c['comm_s'], sign=True)}, memory "
                     f"{units.nbytes(a['memory_bytes'] - c['memory_bytes'], sign=True)})"
                     + ("  <- cheaper alone; ruled out by the shared layers, the memory budget, the overlap "
                        "terms or the solver's time limit"
                        if d < 0 else ""))
    if not entry["alternatives"]:
        lines.append("  (every other strategy needs an impossible redistribution)")
    return lines


def _row_specs(plan: "Plan", row: dict) -> str:
    ins, outs = row["specs"]
    return named_specs(plan, [spec_from_json(s) for s in ins], [spec_from_json(s) for s in outs])
