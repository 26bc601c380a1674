"""The plan as a person reads it: ``str(plan)``, one screen whatever the model's depth.

Sections (:func:`summary`):

* the mesh with its axis names and what priced the plan (a device preset or a profile);
* the estimated step: compute, exposed communication and recomputation, seconds;
* the modelled peak memory per device and its breakdown, against the budget if any;
* the plan's step beside data parallelism's (DDP) and the fastest hand-written recipe's,
  priced on the plan's own graph and costs (``plan.inspection.baselines``,
  :func:`autoparallel.recipes.price`);
* how each input is split (batch, sequence);
* per kind of parameter, repeated layers folded (``h.{0..11}.attn.c_attn.weight``): its
  placement, and how it is used: as stored, stored sharded and all-gathered for compute,
  or split further for compute (for a fused projection read in slices, what happens to
  its slices);
* the routed experts of mixture-of-experts layers: the experts per device, the axes of
  expert parallelism and the bytes each all-to-all sends per device per layer;
* the collectives of one repeated layer: kind, mesh axis, bytes per device, forward or
  backward, and the gradient reductions of its parameters.

Placements print in the named notation of :func:`autoparallel.placement.format_spec`
(``S0(dp) S1(tp)``), which ``constraints=`` reads back.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Sequence

from . import units
from .placement import R, Spec, format_spec
from .runtime_kernels.experts import exchanges_over_the_mesh, expert_hops

if TYPE_CHECKING:
    from .plan import Plan

_INDEXED = re.compile(r"^(.*?)\.(\d+)(\.|$)")
_BACKWARD = {"all_gather": "reduce_scatter", "reduce_scatter": "all_gather", "all_to_all": "all_to_all",
             "all_reduce": "all_reduce"}
"""The backward collective of a forward move of a value with a gradient (:mod:`autoparallel.solver.layout`)."""


def named(plan: "Plan", spec: Spec) -> str:
    """``spec`` in the named notation of ``plan``'s mesh."""
    return format_spec(spec, plan.mesh.axis_names)


def named_specs(plan: "Plan", inputs: Sequence[Spec], outputs: Sequence[Spec]) -> str:
    """``"<input specs> → <output specs>"`` in the named notation (outputs only when no input)."""
    ins = ", ".join(named(plan, s) for s in inputs)
    outs = ", ".join(named(plan, s) for s in outputs)
    return f"{ins} → {outs}" if ins else outs


def node_module(plan: "Plan", node) -> str:
    """The module path ``node`` (a :class:`~autoparallel.plan.NodePlan`) belongs to: its own,
    or for a parameter or buffer (a ``get_attr``) the module holding it (its first name's)."""
    if node.op == "get_attr":
        names = plan.inspection.state_nodes.get(node.name)
        if names:
            return names[0].rpartition(".")[0]
    return node.module_path


def fold(name: str) -> tuple[str, int | None]:
    """``("transformer.h.{}.attn.c_attn.weight", 3)`` for ``transformer.h.3.attn.c_attn.weight``:
    the name with its outermost layer index taken out, and the index (``None`` outside layers)."""
    m = _INDEXED.match(name)
    if m is None:
        return name, None
    return f"{m.group(1)}.{{}}{m.group(3)}{name[m.end():]}", int(m.group(2))


def ranges(indices) -> str:
    """``"0..3,5"`` for indices 0, 1, 2, 3, 5; ``"0,2,..,30"`` for every other index up to 30."""
    idx = sorted(set(indices))
    steps = {b - a for a, b in zip(idx, idx[1:])}
    if len(idx) > 3 and len(steps) == 1 and steps != {1}:
        return f"{idx[0]},{idx[1]},..,{idx[-1]}"
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}..{a}")
            start = b
    return ",".join(out)


def _axes(plan: "Plan", axes) -> str:
    return ",".join(plan.mesh.axis_names[a] for a in sorted(set(axes)))


def summary(plan: "Plan") -> str:
    """The one-screen summary of ``plan`` (module docstring)."""
    parts = [_header(plan), _pipeline(plan), _step(plan), _memory(plan), _compared(plan), _inputs(plan), _parameters(plan),
             _experts(plan), _layer_collectives(plan)]
    return "\n".join(p for p in parts if p)


def _header(plan: "Plan") -> str:
    m = plan.mesh
    axes = " × ".join(f"{n} ({a})" for a, n in zip(m.axis_names, m.shape))
    costs = plan.estimate.costs or "costs not recorded"
    constraints = plan.inspection.placement_constraints
    line = f"plan for a mesh of {m.size} devices: {axes}; priced by {costs}"
    if constraints:
        line += "\nconstraints: " + ", ".join(f"{k} {v}" for k, v in constraints.items())
    return line


def _pipeline(plan: "Plan") -> str:
    """The pipeline stages of a pipelined plan: its axis, each stage's layers, seconds per
    microbatch, peak and checkpointing, the microbatches, schedule, bubble and sends; empty otherwise."""
    pl = getattr(plan, "pipeline", None)
    if pl is None:
        return ""
    name = pl.mesh.axis_names[pl.axis]
    lines = [f"pipeline over mesh axis {name} ({pl.pp} devices): {pl.stages} stages of {pl.layers}, "
             f"{pl.microbatches} microbatches, {pl.schedule}, bubble {pl.bubble:.0%}, "
             f"sends {units.seconds(pl.p2p_s)} per microbatch per boundary; the plan below is one stage's "
             f"on the other axes, for one microbatch"]
    rows, spans = [], list(zip(pl.boundaries, pl.boundaries[1:]))
    s = 0
    while s < pl.stages:
        a, b = spans[s]
        key = _stage_key(pl, s)
        e = s
        while 0 < s and e + 1 < pl.stages - 1 and _stage_key(pl, e + 1) == key:
            e += 1
        if e > s:
            what = f"layers {a}-{spans[e][1] - 1}, {b - a} each"
            who = f"stages {s}-{e}"
        else:
            what = f"layers {a}-{b - 1}" if b - a > 1 else f"layer {a}"
            who = f"stage {s}" + (f" (rank {s % pl.pp})" if pl.stages > pl.pp else "")
        if s == 0:
            what = "embeddings, " + what
        if e == pl.stages - 1:
            what += ", head and loss"
        t = units.seconds(pl.stage_s[s]) if pl.stage_s else "?"
        peak = units.nbytes(pl.stage_peak_bytes[s]) if pl.stage_peak_bytes else "?"
        ck = {"off": "no recomputation", "auto": "recomputation (memory search)"}.get(
            pl.checkpointing[s], f"{pl.checkpointing[s]} checkpointing per layer") if pl.checkpointing else ""
        rows.append((who, what, f"{t} per microbatch", f"peak {peak}") + ((ck,) if ck else ()))
        s = e + 1
    return "\n".join(lines + [columns(rows)])


def _stage_key(pl, s: int) -> tuple:
    """What a summary row of stages shares: layers, seconds, peak and checkpointing."""
    a, b = pl.boundaries[s], pl.boundaries[s + 1]
    return (b - a, pl.stage_s[s] if pl.stage_s else None, pl.stage_peak_bytes[s] if pl.stage_peak_bytes else None,
            pl.checkpointing[s] if pl.checkpointing else None)


def step_parts(plan: "Plan") -> tuple[float, float, float, float]:
    """``(step, compute, exposed communication, recomputation)`` seconds of the estimate."""
    est = plan.estimate
    return est.step_time_s, est.compute_s, est.comm_s, est.recompute_s


def _step(plan: "Plan") -> str:
    step, compute, comm, recompute = step_parts(plan)
    optimizer = plan.estimate.optimizer_s
    line = (f"estimated step {units.seconds(step)} = compute {units.seconds(compute)}"
            + (f" (optimizer step {units.seconds(optimizer)})" if optimizer else "")
            + f" + exposed communication {units.seconds(comm)}" + (f" + recomputation {units.seconds(recompute)}" if recompute else ""))
    grad = plan.estimate.grad_comm_s
    if grad:
        line += f" (gradient reduction {units.seconds(grad)}, {units.seconds(plan.estimate.exposed_grad_comm_s)} exposed)"
    return line


def _memory(plan: "Plan") -> str:
    mem = plan.estimate.memory
    peak = plan.estimate.peak_memory_bytes
    if mem is None or peak is None:
        return ""
    budget = plan.estimate.memory_budget_bytes
    parts = ", ".join(f"{k} {units.nbytes(v)}" for k, v in mem.breakdown.items() if v)
    where = " (the fullest stage, its microbatches in flight)" if plan.pipeline is not None else ""
    line = f"peak memory {units.nbytes(peak)} per device{where}" + \
        (f" of a {units.nbytes(budget)} budget" if budget else " (no budget)")
    if plan.pipeline is not None:  # the breakdown is the intra-stage plan's: every layer, one microbatch
        return line + f"; every layer's on one device, one microbatch, in the {mem.phase}: {parts}"
    line += f", in the {mem.phase}: {parts}"
    if plan.checkpoint:
        line += f" (before recomputation {units.nbytes(mem.peak_bytes)})"
    if plan.offloaded:
        line += (f"; {len(plan.offloaded)} parameters held in host memory with their gradients and optimizer "
                 "states, stepped there")
    if plan.state_placements:
        line += (f"; {len(plan.state_placements)} parameters with optimizer states sharded (ZeRO-1: each device "
                 "steps its shard, all-gathered after the step)")
        if plan.sharded_gradients:
            line += f", {len(plan.sharded_gradients)} of them with gradients reduce-scattered onto it (ZeRO-2)"

    return line


def _compared(plan: "Plan") -> str:
    """Data parallelism (DDP) and the fastest hand-written recipe beside the plan's step, from
    ``plan.inspection.baselines`` (:func:`autoparallel.recipes.baselines`)."""
    base = plan.inspection.baselines
    if base is None:
        return "data parallelism and hand-written recipes: not priced (plan(..., baselines=True) or autoparallel.compare)"
    step = plan.estimate.step_time_s

    def priced(name: str, b: dict) -> str:
        extra = f", recomputing {units.seconds(b['recompute_s'])}" if b.get("recompute_s") else ""
        return f"{name} {units.seconds(b['step_time_s'])} ({b['step_time_s'] / step:.2f}x{extra})" if step else name

    done = {n: b for n, b in base.items() if "step_time_s" in b}
    best = min(done, key=lambda n: done[n]["step_time_s"]) if done else None
    ddp, parts = base.get("DDP"), []
    if ddp is not None and "step_time_s" in ddp:
        parts.append(priced("DDP", ddp) + (", the fastest recipe" if best == "DDP" else ""))
    elif ddp is not None:
        parts.append(f"DDP not possible ({_short(ddp['reason'])})")
    if best is not None and best != "DDP":
        parts.append("fastest recipe " + priced(best, done[best]))
    line = "vs this plan's step, same cost model: " + "; ".join(parts)
    others = []
    if step:
        others = [f"{n} {b['step_time_s'] / step:.2f}x" for n, b in done.items() if n not in ("DDP", best)]
        bounds = [f"{n} ≥ {b['step_at_least_s'] / step:.2f}x" for n, b in base.items() if "step_at_least_s" in b]
        others += bounds[:-1] + [bounds[-1] + " (≥: a lower bound, not planned)"] if bounds else []
    missing = [n for n, b in base.items() if "reason" in b and n != "DDP"]
    others += [f"not possible: {', '.join(missing)}"] if missing else []
    return line + ("\n  other recipes: " + "; ".join(others) if others else "")


def _short(reason: str) -> str:
    """The first clause of a reason, for one summary line."""
    return reason.split(": ", 1)[-1].split(";")[0][:100]


def _inputs(plan: "Plan") -> str:
    lines = []
    for n in plan.nodes.values():
        if n.op != "placeholder" or not n.out_shapes:
            continue
        splits: dict[int, set[int]] = defaultdict(set)
        for c in plan.redistributions:
            if c.src == n.name:
                for m in c.moves:
                    if m.kind == "slice" and m.dst_dim is not None:
                        splits[m.dst_dim].add(m.axis)
        shape = list(n.out_shapes[0])
        if plan.inputs == "local":
            moved = sorted({m.kind.replace("_", "-") for c in plan.redistributions if c.src == n.name for m in c.moves})
            rows = shape[0] // math.prod(plan.mesh.shape)
            lines.append(f"  {n.name} {shape}: {rows} rows from each rank"
                         + (f"; redistributed where ops need it otherwise ({', '.join(moved)})" if moved else ""))
            continue
        if not splits:
            lines.append(f"  {n.name} {shape}: read whole on every device")
            continue
        dims = "; ".join(f"dim {d} ({_dim_name(d, len(shape))}) split over {_axes(plan, axes)}"
                         for d, axes in sorted(splits.items()))
        lines.append(f"  {n.name} {shape}: {dims}")
    if plan.inputs == "local":
        head = ("inputs (each rank passes its own batch: the global batch's dim 0 split over every mesh axis, "
                "in rank order; ops that need more gather it):\n")
    else:
        head = "inputs (the global batch on every device, each op reads its part):\n"
    return head + "\n".join(lines) if lines else ""


def _dim_name(d: int, ndim: int) -> str:
    return {0: "batch", 1: "sequence"}.get(d, f"dim {d}") if ndim >= 2 else "batch"


def parameter_use(plan: "Plan", node_name: str) -> str:
    """How the parameter of get_attr node ``node_name`` is used: ``"as stored"``,
    ``"all-gathered over tp"`` (stored sharded, gathered for compute), ``"split over dp"``
    (stored whole or less split, split further for compute), or several of these. A parameter
    read through a mixed-precision cast is described by what happens to the cast copy; one read
    in slices (a fused projection, :mod:`autoparallel.tracer.fused`) by what happens to its
    slices (``"slices all-gathered over tp"``, ``"slices as stored"``), as recorded in
    ``plan.inspection.state_reads`` (:func:`autoparallel.solver.inspect.state_reads`; plans without
    the record: the parameter's own redistributions only)."""
    through = plan.inspection.state_reads.get(node_name, [])
    slices = {n for n in through if plan.nodes.get(n) is not None and plan.nodes[n].op.startswith("slice.")}
    uses = set()
    for c in plan.redistributions:
        if c.src != node_name and c.src not in through:
            continue
        kinds = defaultdict(set)
        for m in c.moves:
            kinds[m.kind].add(m.axis)
        for kind, axes in sorted(kinds.items()):
            word = {"all_gather": "all-gathered", "slice": "split", "all_to_all": "re-split (all-to-all)",
                    "mask": "kept on one device as a pending sum"}.get(kind, kind)
            uses.add(f"{'slices ' if c.src in slices else ''}{word} over {_axes(plan, axes)}")
    return "; ".join(sorted(uses)) if uses else ("slices as stored" if slices else "as stored")


def _parameters(plan: "Plan") -> str:
    groups: dict[tuple, list] = defaultdict(list)
    order = []
    for node_name, names in plan.inspection.state_nodes.items():
        node = plan.nodes.get(node_name)
        if node is None or not names:
            continue
        key_name, idx = fold(names[0])
        spec = plan.param_placements.get(names[0])
        if spec is None:
            continue
        where = " in host memory" if names[0] in plan.offloaded else ""
        if names[0] in plan.state_placements:
            grads = " and gradient" if names[0] in plan.sharded_gradients else ""
            where += f", states{grads} {named(plan, plan.state_placements[names[0]])}"
        key = (key_name, named(plan, spec) + where, parameter_use(plan, node_name), tuple(node.out_shapes[0]),
               tuple(fold(t)[0] for t in names[1:]))
        if key not in groups:
            order.append(key)
        groups[key].append(idx)
    if not groups:
        return ""
    rows = []
    for key in order:
        name, spec, use, shape, tied = key
        idx = [i for i in groups[key] if i is not None]
        shown = name.format("{" + ranges(idx) + "}") if idx else name
        if tied:
            shown += f" (= {', '.join(t.format('{' + ranges(idx) + '}') if idx else t for t in tied)})"
        rows.append((shown, str(list(shape)), spec, use))
    return (f"parameters and buffers ({len(plan.inspection.state_nodes)} tensors, {len(rows)} kinds):\n"
            + columns([("name", "shape", "placement", "use in compute")] + rows))


def _experts(plan: "Plan") -> str:
    """One line per way the plan runs routed experts (:mod:`autoparallel.strategies.moe`)."""
    groups: dict[tuple, list] = defaultdict(list)
    for n in plan.nodes.values():
        if n.op.startswith("routed_experts"):
            groups[(tuple(n.input_specs[0]), tuple(n.input_specs[3]))].append(n)
    lines = []
    for (tokens, experts), nodes in groups.items():
        n = nodes[0]
        hops = expert_hops((tokens, None, None, experts), plan.mesh.shape)
        total = n.in_shapes[3][0]
        per = total // math.prod(plan.mesh.shape[a] for _, a in hops)
        pairs = n.memory_bytes * n.in_shapes[1][1]  # this device's (token, expert) pairs' rows, bytes
        parts = []
        if exchanges_over_the_mesh(hops, plan.mesh.shape):  # one hop over the world's group
            parts.append(f"expert parallel over {_axes(plan, [a for _, a in hops])} at once (all-to-all of "
                         f"{units.nbytes(pairs)} per device over the whole mesh, 2 forward and 2 backward)")
            hops = []
        for kind, a in hops:
            if kind == "mask":
                pairs /= plan.mesh.shape[a]
                parts.append(f"split over {_axes(plan, [a])} (each device its experts' pairs, a pending sum)")
            else:
                parts.append(f"expert parallel over {_axes(plan, [a])} (all-to-all of {units.nbytes(pairs)} "
                             "per device, 2 forward and 2 backward)")
        split = [a for a, p in enumerate(tokens) if p != R]
        how = "; ".join(parts) if parts else "replicated on every device"
        layers: dict[str, list[int]] = defaultdict(list)
        for x in nodes:
            key, i = fold(x.module_path)
            layers[key].append(i)
        paths = sorted(k.format("{" + ranges(i) + "}") if None not in i else k for k, i in layers.items())
        lines.append(f"  {', '.join(paths)}: {total} experts, {per} per device; {how}; tokens "
                     + (f"split over {_axes(plan, split)}" if split else "whole"))
    return "routed experts:\n" + "\n".join(lines) if lines else ""


def columns(rows: list[tuple[str, ...]]) -> str:
    """Rows as left-aligned columns, two spaces apart, indented by two."""
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(f"{c:<{w[i]}}" for i, c in enumerate(r)).rstrip() for r in rows)


def layer_of_path(path: str) -> tuple[str, int] | None:
    """``("model.layers", 3)`` for a module path under ``model.layers.3``, else ``None``."""
    m = _INDEXED.match(path)
    return (m.group(1), int(m.group(2))) if m else None


def _layer_collectives(plan: "Plan") -> str:
    layers: dict[str, set[int]] = defaultdict(set)
    for n in plan.nodes.values():
        key = layer_of_path(n.module_path) if n.module_path else None
        if key:
            layers[key[0]].add(key[1])
    if not layers:
        return _collective_rows(plan, "whole model", lambda path: True, lambda name: True)
    out = []
    for lst, idx in layers.items():
        idx = sorted(idx)
        shown = idx[len(idx) // 2]  # a middle layer: the first and last meet the rest of the model
        inside = f"{lst}.{shown}"
        out.append(_collective_rows(
            plan, f"{lst}.{shown} (one of {lst}.{{{ranges(idx)}}})",
            lambda path, p=inside: path == p or path.startswith(p + "."),
            lambda name, p=inside: name.startswith(p + ".")))
    return "\n".join(out)


def _collective_rows(plan: "Plan", title: str, in_module, is_param) -> str:
    """The collectives of the nodes ``in_module`` selects (by module path) and the gradient
    reductions of the parameters ``is_param`` selects (by name), counted by kind, axis, bytes."""
    count: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])

    def add(kind, axis, nbytes, when):
        row = count[(kind, plan.mesh.axis_names[axis], when)]
        row[0] += 1
        row[1] += nbytes

    for c in plan.redistributions:
        dst = plan.nodes.get(c.dst)
        if dst is None or not in_module(dst.module_path):
            continue
        for m in c.moves:
            if m.kind in ("slice", "mask"):
                continue
            back = _BACKWARD.get(m.kind)
            add(m.kind, m.axis, m.nbytes, "forward" + (f"; its gradient: {back} in the backward" if back else ""))
    for node_name, names in plan.inspection.state_nodes.items():
        node = plan.nodes.get(node_name)
        if node is None or not node.comm_s or not is_param(names[0]):
            continue
        spec = plan.param_placements[names[0]]
        for a, p in enumerate(spec):
            if p.is_replicate() and plan.mesh.shape[a] > 1:
                add("all_reduce", a, node.memory_bytes // 2, "backward: parameter gradients")
    if not count:
        return f"collectives in {title}: none"
    rows = [(f"{n} × {kind}", f"over {axis}", units.nbytes(nbytes), when)
            for (kind, axis, when), (n, nbytes) in sorted(count.items(), key=lambda kv: kv[0][2])]
    total = sum(v[1] for v in count.values())
    return (f"collectives in {title}, {units.nbytes(total)} per device (bytes summed):\n"
            + columns([("count × kind", "mesh axis", "bytes", "when")] + rows))
