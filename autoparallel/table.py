"""``plan.table()``: the plan as a table, one row per module (the default) or per node.

**Per module** (``by="module"``): one row per module path that runs ops or holds parameters,
in graph order (``model.layers.3.self_attn``; ``(top level)`` for what the model's own
``forward`` runs), with the parameters and buffers the module holds itself and their
placements, and the sums over the nodes run directly in it (a parameter's node counts for
the module holding it): compute seconds (forward, backward and the parameters' optimizer
step), communication seconds (resharding their inputs, the parameters' gradient reductions)
and memory, the bytes per device of those nodes' outputs (a parameter with its gradient).
**Per node** (``by="node"``): every ATen node with its input and output placements.

Both end with the step's estimate and, when the plan recomputes, its checkpoint regions.
Placements print in the named notation of :func:`autoparallel.placement.format_spec`, times
and sizes through :mod:`autoparallel.units`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from tabulate import tabulate

from . import precision, units
from .summary import named, named_specs, node_module

if TYPE_CHECKING:
    from .plan import Plan

PARAMETERS_WIDTH = 48
"""Characters of the per-module table's parameter column; longer lists end with ``…``."""

TOP_LEVEL = "(top level)"
"""The row of the nodes the model's own ``forward`` runs, outside any submodule."""


def table(plan: "Plan", by: str = "module", all_nodes: bool = False) -> str:
    """The text of :meth:`Plan.table <autoparallel.plan.Plan.table>` (module docstring).

    Raises:
        ValueError: ``by`` is neither ``"module"`` nor ``"node"``, or ``all_nodes`` with ``by="module"``.
    """
    if by not in ("module", "node"):
        raise ValueError(f"table(by={by!r}): by is 'module' (one row per module) or 'node' (one per ATen node)")
    if all_nodes and by != "node":
        raise ValueError("table(all_nodes=True) lists bookkeeping nodes: ask table(by='node', all_nodes=True)")
    body = module_rows(plan) if by == "module" else _node_rows(plan, all_nodes)
    return body + "\n" + _footer(plan) + _checkpoint(plan)


def module_rows(plan: "Plan") -> str:
    """The per-module table without its footer."""
    order: dict[str, int] = {}
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for k, n in enumerate(plan.nodes.values()):
        path = node_module(plan, n)
        rank = k if n.op != "get_attr" else len(plan.nodes) + k  # a module is placed by the first op it runs
        order[path] = min(order.get(path, rank), rank)
        row = sums[path]
        row[0] += n.compute_s
        row[1] += n.comm_s
        row[2] += n.memory_bytes
    held = _held_parameters(plan)
    rows = [[path or TOP_LEVEL, _shorten(held.get(path, "")), units.seconds(c), units.seconds(m), units.nbytes(b)]
            for path, (c, m, b) in sorted(sums.items(), key=lambda kv: order[kv[0]])]
    return tabulate(rows, ["module", "parameters (placement)", "compute", "communication", "memory"],
                    tablefmt="simple", disable_numparse=True)


def _held_parameters(plan: "Plan") -> dict[str, str]:
    """Module path → ``"weight S1(tp), bias R"``: the parameters and buffers it holds itself."""
    held: dict[str, list[str]] = defaultdict(list)
    for names in plan.inspection.state_nodes.values():
        for name in names:
            spec = plan.param_placements.get(name)
            if spec is not None:
                module, _, leaf = name.rpartition(".")
                held[module].append(f"{leaf} {named(plan, spec)}")
    return {m: ", ".join(p) for m, p in held.items()}


def _shorten(text: str, width: int = PARAMETERS_WIDTH) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def _node_rows(plan: "Plan", all_nodes: bool) -> str:
    """One row per node; bookkeeping nodes without a cost (inputs, tuple items) only with ``all_nodes``."""
    rows = [[n.name, n.op, n.module_path, named_specs(plan, n.input_specs, n.output_specs),
             units.seconds(n.compute_s), units.seconds(n.comm_s), units.nbytes(n.memory_bytes)]
            for n in plan.nodes.values() if all_nodes or n.op not in ("placeholder", "getitem") or n.comm_s]
    return tabulate(rows, ["node", "op", "module", "input specs → output spec", "compute", "communication", "memory"],
                    tablefmt="simple", disable_numparse=True)


def _footer(plan: "Plan") -> str:
    est = plan.estimate
    return (f"mesh {plan.mesh.shape}: estimated step {units.seconds(est.step_time_s)} "
            f"(compute {units.seconds(est.compute_s)}"
            + (f" with the optimizer step {units.seconds(est.optimizer_s)}" if est.optimizer_s else "")
            + f", communication {units.seconds(est.comm_s)}), "
            f"peak memory {units.nbytes(est.peak_memory_bytes or 0)} per device; "
            f"{len(plan.collectives)} forward collectives"
            + (f"; priced by {est.costs}" if est.costs else "")
            + (f"; {precision.describe(plan.mp_policy)}" if plan.mp_policy is not None else "")
            + ("; inputs: each rank its own batch" if plan.inputs == "local" else ""))


def _checkpoint(plan: "Plan") -> str:
    if not plan.checkpoint:
        return ""
    regions = [[r.stages, r.modules, r.policy, r.nodes, units.nbytes(r.saved_bytes), units.seconds(r.recompute_s)]
               for r in plan.checkpoint.table]
    return "\n\nactivation checkpointing (recomputed in backward; selective: matmul and attention outputs kept):\n" \
        + tabulate(regions, ["stages", "modules", "policy", "nodes", "memory saved", "recompute"], tablefmt="simple",
                   disable_numparse=True)
