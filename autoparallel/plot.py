"""Pictures of a plan (matplotlib, the optional extra ``plot``).

:func:`plot` draws one PNG with two panels:

* per repeated layer (and the parts of the model before and after the layers), stacked
  bars of the estimated seconds of compute, exposed communication and recomputation;
* the modelled memory per device over one training step (forward, then backward), stacked
  by kind (:data:`autoparallel.solver.memory.KINDS`), with the budget as a line.

The memory timeline is recorded at solve time by :func:`autoparallel.solver.inspect.memory_timeline`
(from :meth:`~autoparallel.solver.memory.MemoryModel.timeline`) in ``plan.inspection.memory_timeline``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .plan import Plan


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
    after them (a parameter: the layer its name is under). A node's communication is its resharding plus, for a parameter, its
    gradient reduction scaled by the plan's exposed share of gradient communication;
    recomputation of a checkpoint region is spread over its nodes by compute. What belongs
    to no node (one latency per gradient-reduction axis, returning outputs) is a last row,
    ``"step-wide"``, so that the rows add up to the estimated step."""
    from .summary import layer_of_path

    est = plan.estimate
    grad, exposed = est.grad_comm_s, est.exposed_grad_comm_s
    share = exposed / grad if grad else 1.0
    recompute = _recompute_per_node(plan)
    parts: dict[str, list[float]] = {}
    seen_layer = False
    for n in plan.nodes.values():
        path = n.module_path
        if n.op == "get_attr":  # a parameter belongs to the layer its name is under
            path = (plan.inspection.state_nodes.get(n.name) or [""])[0]
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
    rest = est.step_time_s - sum(sum(v) for v in parts.values())
    if rest > 1e-12 * max(1.0, est.step_time_s):
        rows.append(("step-wide", 0.0, rest, 0.0))
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
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(11, 8.5))
    rows = layer_times(plan)
    x = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for k, (what, color) in enumerate((("compute", "tab:blue"), ("exposed communication", "tab:red"),
                                       ("recomputation", "tab:green"))):
        vals = np.array([r[1 + k] for r in rows]) * 1e3
        ax1.bar(x, vals, bottom=bottom, label=what, color=color)
        bottom += vals
    ax1.set_xticks(x, [r[0] for r in rows], rotation=90, fontsize=max(4, 9 - len(rows) // 12))
    ax1.set_ylabel("ms per step")
    step = plan.estimate.step_time_s
    ax1.set_title(f"estimated step {step * 1e3:.4g} ms on mesh {plan.mesh.shape} {plan.mesh.axis_names}")
    ax1.legend(fontsize=8)
    tl = plan.inspection.memory_timeline
    if tl:
        steps = np.array(tl["step"])
        kinds = [k for k, v in tl["by_kind"].items() if any(v)]
        budget = plan.estimate.memory_budget_bytes
        unit, scale = ("GiB", 2**30) if max(max(tl["total"]), budget or 0) >= 2**30 else ("MiB", 2**20)
        ax2.stackplot(steps, *[np.array(tl["by_kind"][k]) / scale for k in kinds], labels=kinds, alpha=0.8)
        ax2.axvline(tl["steps"] / 2, color="gray", linestyle=":", label="forward | backward")
        if budget:
            ax2.axhline(budget / scale, color="black", linestyle="--", label="budget")
        ax2.set_xlabel("step of the training step (forward, then backward)")
        ax2.set_ylabel(f"{unit} per device")
        ax2.legend(fontsize=8, loc="upper left")
    else:
        ax2.text(0.5, 0.5, "no memory timeline in this plan", ha="center", va="center")
    ax2.set_title("modelled memory per device")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [str(path)]
