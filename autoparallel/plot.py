"""Pictures of a plan (matplotlib, the optional extra ``plot``).

:func:`plot` draws one PNG with two panels:

* per repeated layer (and the parts of the model before and after the layers), stacked
  bars of the estimated compute, exposed communication and recomputation, in the time unit
  of the largest bar (:mod:`autoparallel.units`);
* the modelled memory per device over one training step (forward, then backward), stacked
  by kind (:data:`autoparallel.solver.memory.KINDS`), its axis scaled to the data: the budget
  is a line when it is at most :data:`BUDGET_IN_VIEW` times the peak, else it is named in the
  title (a 72 GiB budget would flatten a 35 MiB timeline to nothing).

The memory timeline is recorded at solve time by :func:`autoparallel.solver.inspect.memory_timeline`
(from :meth:`~autoparallel.solver.memory.MemoryModel.timeline`) in ``plan.inspection.memory_timeline``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from . import units

if TYPE_CHECKING:
    from .plan import Plan

BUDGET_IN_VIEW = 3.0
"""The memory panel draws the budget as a line when it is at most this many times the peak."""


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise ImportError("plan.plot() needs matplotlib: pip install 'autoparallel[plot]' "
                          "(or pip install matplotlib)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def layer_times(plan: "Plan") -> list[tuple[str, float, float, float]]:
    """Per part of the model, in graph order: ``(label, compute s, exposed communication s,
    recomputation s)``. Parts are the repeated layers (``h.3``) and the nodes before and
    after them (a parameter: the layer its name is under). A node's compute holds its
    parameter's optimizer update; its communication is its resharding plus, for a parameter,
    its gradient reduction scaled by the plan's exposed share of gradient communication;
    recomputation of a checkpoint region is spread over its nodes by compute. What belongs to
    no node is a last row, ``"step-wide"``: compute (the DTensor dispatch of the optimizer step,
    paid once for the module) and communication (one latency per gradient-reduction axis,
    returning outputs), so that the rows add up to the estimate's compute, communication and step."""
    from .summary import layer_of_path, node_module

    est = plan.estimate
    grad, exposed = est.grad_comm_s, est.exposed_grad_comm_s
    share = exposed / grad if grad else 1.0
    recompute = _recompute_per_node(plan)
    parts: dict[str, list[float]] = {}
    seen_layer = False
    for n in plan.nodes.values():
        path = node_module(plan, n)
        key = layer_of_path(path) if path else None
        if key:
            label, seen_layer = f"{key[0]}.{key[1]}", True
        else:
            label = "after layers" if seen_layer else "before layers"
        comm = n.comm_s * (share if n.op == "get_attr" else 1.0)
        row = parts.setdefault(label, [0.0, 0.0, 0.0])
        row[0] += n.compute_s
        row[1] += comm
        row[2] += recompute.get(n.name, 0.0)
    rows = [(k, *v) for k, v in parts.items()]
    rest = [total - sum(v[k] for v in parts.values())
            for k, total in enumerate((est.compute_s, est.comm_s, est.recompute_s))]
    if any(abs(r) > 1e-12 * max(1.0, est.step_time_s) for r in rest):
        rows.append(("step-wide", *rest))
    return rows


def _recompute_per_node(plan: "Plan") -> dict[str, float]:
    ck = plan.checkpoint
    if ck is None:
        return {}
    out = {}
    for region, row in zip(ck.regions, ck.table):
        names = [n for n, s in ck.stages.items() if region.start <= s < region.stop and n in plan.nodes]
        total = sum(plan.nodes[n].compute_s for n in names)
        for n in names:
            out[n] = row.recompute_s * (plan.nodes[n].compute_s / total if total else 1 / len(names))
    return out


def plot(plan: "Plan", path) -> list[str]:
    """Write the pictures of ``plan`` (module docstring) as one PNG at ``path``.

    Returns:
        the paths written.

    Raises:
        ImportError: matplotlib is not installed (names the ``plot`` extra).
    """
    plt = _matplotlib()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = figure(plan)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]


def figure(plan: "Plan"):
    """The matplotlib figure :func:`plot` saves: the step's bars above, the memory timeline below.

    Raises:
        ImportError: matplotlib is not installed (names the ``plot`` extra).
    """
    fig, (bars, memory) = _matplotlib().subplots(2, 1, figsize=(11, 8.5))
    _step_bars(plan, bars)
    _memory_panel(plan, memory)
    fig.tight_layout()
    return fig


def _step_bars(plan: "Plan", ax) -> None:
    """Stacked bars of :func:`layer_times`, in the unit of the tallest."""
    rows = layer_times(plan)
    unit, scale = units.time_unit(max((sum(r[1:]) for r in rows), default=0.0))
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for k, (what, color) in enumerate((("compute", "tab:blue"), ("exposed communication", "tab:red"),
                                       ("recomputation", "tab:green"))):
        vals = np.array([r[1 + k] for r in rows]) / scale
        ax.bar(x, vals, bottom=bottom, label=what, color=color)
        bottom += vals
    ax.set_xticks(x, [r[0] for r in rows], rotation=90, fontsize=max(4, 9 - len(rows) // 12))
    ax.set_ylabel(f"{unit} per step")
    ax.set_title(f"estimated step {units.seconds(plan.estimate.step_time_s)} on mesh {plan.mesh.shape} "
                 f"{plan.mesh.axis_names}")
    ax.legend(fontsize=8)


def _memory_panel(plan: "Plan", ax) -> None:
    """The memory timeline stacked by kind, the axis scaled to its peak (module docstring)."""
    tl = plan.inspection.memory_timeline
    title = "modelled memory per device"
    if not tl:
        ax.text(0.5, 0.5, "no memory timeline in this plan", ha="center", va="center")
        ax.set_title(title)
        return
    peak = max(tl["total"])
    budget = plan.estimate.memory_budget_bytes
    shown = budget is not None and budget <= BUDGET_IN_VIEW * peak
    unit, scale = units.bytes_unit(max(peak, budget) if shown else peak)
    kinds = [k for k, v in tl["by_kind"].items() if any(v)]
    ax.stackplot(np.array(tl["step"]), *[np.array(tl["by_kind"][k]) / scale for k in kinds], labels=kinds, alpha=0.8)
    ax.axvline(tl["steps"] / 2, color="gray", linestyle=":", label="forward | backward")
    if shown:
        ax.axhline(budget / scale, color="black", linestyle="--", label="budget")
    elif budget is not None:
        title += f": peak {units.nbytes(peak)}, far under the budget of {units.nbytes(budget)}"
    ax.set_ylim(0, 1.05 * max(peak, budget if shown else 0) / scale)
    ax.set_xlabel("step of the training step (forward, then backward)")
    ax.set_ylabel(f"{unit} per device")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(title)
