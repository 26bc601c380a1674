"""Hand-written parallelization recipes as constraint sets, priced beside the plan.

:func:`recipes` writes, for a model and a mesh, the constraints (:mod:`autoparallel.constraints`)
of the recipes people write by hand:

* **DDP**: every parameter replicated, the batch split over every mesh axis;
* **FSDP (ZeRO-3)** (Rajbhandari et al., SC 2020, §5): every parameter stored split over
  every mesh axis along its first dim they divide (replicated when none does) and read whole
  (``"S0(dp) -> R"``: all-gathered for compute, its gradient reduce-scattered), the batch
  split over every axis;
* **Megatron TP** (Shoeybi et al., 2019, §3): in each repeated layer, column-parallel
  projections (output features split) followed by a row-parallel one (input features split),
  the embedding whose rows are the LM head's vocabulary and the LM head split by
  vocabulary, other parameters replicated; on a 2-D mesh the first axis is data parallel
  (the batch split over it) and the last axis the tensor-parallel one; on a 1-D mesh the
  only axis is tensor parallel and the batch is not split;
* **FSDP + EP** (models with routed experts, :mod:`autoparallel.tracer.experts`; torchtitan's
  layout for mixture-of-experts models): FSDP as above, except that the routed experts are
  stored split by expert (dim 0) over the last mesh axis whose size divides their count, the
  expert-parallel axis, and along their next dim over the other axes, and read split by
  expert: tokens go to their experts' devices by all-to-all, the batch split over every axis;
* **FSDP + TP** (2-D meshes): Megatron TP on the last axis, each parameter additionally
  stored split over the first axes (FSDP) along its first dim that the split divides; the
  parameters Megatron splits are gathered over those axes for compute (read in their Megatron
  placement), the ones it replicates are read as the planner chooses (a row-parallel bias is
  added as a pending sum, ``P(tp)``, so "read whole" cannot be asked of it). A fused weight
  the tracer reads in slices (:mod:`autoparallel.tracer.fused`) is stored split over every axis
  along a dim the slices keep (a split of the sliced dim is no head-aligned cut of the parts),
  sliced on the shard, and each part read in its Megatron placement; a fused bias (its only dim
  is the sliced one) is read as the planner chooses.

Under a mixed-precision policy every parameter pinned ``STORED -> USED`` (FSDP's and FSDP + TP's
gathered ones) is cast on its shard and gathered in ``param_dtype``, as FSDP2 orders it
(:func:`autoparallel.constraints.restrict`); the others are cast where the planner finds it
cheaper.

Roles are found from the traced graph, not from module names: a *projection* is a 2-D
parameter that a matrix product reads as its weight (``aten.linear``: ``[out, in]``;
``aten.mm``/``addmm``/``matmul``: ``[in, out]``, so GPT-2's ``Conv1D`` is one too), with the
bias the same op adds, read directly, through a mixed-precision cast or in slices (a fused
projection split into parts by the tracer: one projection, placed by its first part); an
*embedding* is a parameter ``aten.embedding`` reads. Within a repeated layer, projections are visited in graph order: one whose input depends (inside
the layer) on a still open column-parallel projection is row-parallel and closes them,
any other is column-parallel (attention q/k/v → o, MLP up/gate → down, BERT's split
modules alike). The LM head is the projection outside the layers with the most output
features when that equals the largest embedding's rows (the vocabulary).

:func:`price` plans the recipes on the plan's own graph, strategies and costs: the plan's
baselines (``plan.inspection.baselines``, :func:`baselines`), which ``str(plan)`` prints;
:func:`autoparallel.compare` shows every recipe planned as a table. A recipe's plan is exactly the plan
solved with its constraints.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from .placement import format_spec
from .constraints import policy_cast, resolve, restrict
from .errors import AutoParallelError, InfeasiblePlanError
from .solver.ilp import fold_edges
from .graph import layer_of
from .mesh import MeshSpec
from .placement import R
from .runtime_kernels.experts import ROUTED_EXPERTS
from .tracer.annotate import node_info
from . import units
from .summary import fold

aten = torch.ops.aten
_MATMULS = {aten.mm.default: (1, None), aten.addmm.default: (2, 0), aten.matmul.default: (1, None)}
"""Matrix products reading a weight ``[in, out]``: op → (weight position, bias position)."""
_TRANSPOSES = {aten.t.default, aten.transpose.int, aten.permute.default}


def _read_as(param: fx.Node) -> fx.Node:
    """The node ops read parameter ``param`` through: its mixed-precision cast
    (:func:`~autoparallel.constraints.policy_cast`) or ``param`` itself."""
    return policy_cast(param) or param


def _reads(read: fx.Node):
    """``(value, user)`` for every op reading ``read`` (a parameter or its cast), and for each
    slice of it (a fused projection split into parts, :mod:`autoparallel.tracer.fused`) every
    op reading the slice."""
    for user in read.users:
        if user.target is aten.slice.Tensor:
            yield from ((user, u) for u in user.users)
        else:
            yield read, user


def _param_target(node) -> str | None:
    """The parameter target ``node`` reads, directly or through its slice and cast, else ``None``."""
    for op in (aten.slice.Tensor, aten._to_copy.default):
        if isinstance(node, fx.Node) and node.target is op:
            node = node.args[0]
    return node.target if isinstance(node, fx.Node) and node.op == "get_attr" else None


@dataclass
class Projection:
    """A parameter used as the weight of a matrix product.

    Attributes:
        weight / bias: parameter targets (``bias`` ``None`` when the product adds none).
        out_dim: the weight's dim of output features (0 for ``[out, in]``, 1 for ``[in, out]``).
        op: the product's node; layer: its repeated layer (:func:`~autoparallel.graph.layer_of`).
        role: ``"column"`` or ``"row"`` inside a layer, ``"head"`` for the LM head, else ``""``.
    """

    weight: str
    bias: str | None
    out_dim: int
    op: fx.Node
    layer: tuple[str, int] | None
    role: str = ""


@dataclass
class Roles:
    """What :func:`find_roles` found: projections, embedding tables (target → rows), the
    LM head's vocabulary (``None`` when there is no head), every parameter's target → shape,
    the tensor inputs (placeholder name → shape), and the fused projections' weights and
    biases (read in slices)."""

    projections: list[Projection]
    embeddings: dict[str, int]
    vocab: int | None
    params: dict[str, tuple[int, ...]]
    inputs: dict[str, tuple[int, ...]]
    fused: set[str] = field(default_factory=set)


@dataclass
class Recipe:
    """A named constraint set, or why it cannot be written for this model and mesh
    (``constraints`` ``None``); ``notes`` say where it departs from the textbook recipe."""

    name: str
    constraints: dict[str, str] | None
    reason: str = ""
    notes: list[str] = field(default_factory=list)


def find_roles(traced) -> Roles:
    """The projections (with their Megatron roles), embeddings and LM head of a traced model
    (:class:`~autoparallel.tracer.capture.TracedModel`), found as the module docstring says."""
    params = {}
    projections: list[Projection] = []
    embeddings: dict[str, int] = {}
    inputs = {}
    fused: set[str] = set()
    for node in traced.gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor):
            inputs[node.name] = tuple(val.shape)
        if node.op != "get_attr" or node.target not in traced.params:
            continue
        params[node.target] = tuple(val.shape)
        if len(val.shape) != 2:
            continue
        for read, user in _reads(_read_as(node)):
            proj = _projection(node, read, user)
            if proj is not None and read.target is aten.slice.Tensor:
                fused.update(t for t in (proj.weight, proj.bias) if t is not None)
            if proj is not None:
                if all(p.weight != proj.weight for p in projections):  # a fused one: its first part
                    projections.append(proj)
            elif user.target is aten.embedding.default and user.args[0] is read:
                embeddings[node.target] = val.shape[0]
    _layer_roles(projections)
    outside = [p for p in projections if p.layer is None]
    vocab = None
    if outside and embeddings:
        head = max(outside, key=lambda p: params[p.weight][p.out_dim])
        rows = params[head.weight][head.out_dim]
        if rows == max(embeddings.values()):
            head.role, vocab = "head", rows
    return Roles(projections, embeddings, vocab, params, inputs, fused)


def _projection(weight: fx.Node, read: fx.Node, user: fx.Node) -> Projection | None:
    """The projection ``weight`` (read as ``read``: itself or its cast) is in ``user``
    (through one transpose), or ``None``."""
    transposed = user.target in _TRANSPOSES
    op = next(iter(user.users), None) if transposed and len(user.users) == 1 else user
    src = user if transposed else read
    if op is None or op.op != "call_function":
        return None
    if op.target is aten.linear.default and len(op.args) > 1 and op.args[1] is src:
        out_dim, bias = 0, (op.args[2] if len(op.args) > 2 else None)
    elif op.target in _MATMULS and len(op.args) > _MATMULS[op.target][0] and op.args[_MATMULS[op.target][0]] is src:
        pos = _MATMULS[op.target][1]
        out_dim, bias = 1, (op.args[pos] if pos is not None else None)
    else:
        return None
    if transposed:
        out_dim = 1 - out_dim
    return Projection(weight.target, _param_target(bias), out_dim, op, layer_of(op))


def _layer_roles(projections: list[Projection]) -> None:
    """Column or row for the projections of each repeated layer (module docstring)."""
    by_layer: dict = {}
    for p in projections:
        if p.layer is not None:
            by_layer.setdefault(p.layer, []).append(p)
    order = {}
    for layer, projs in by_layer.items():
        if not order:
            order = {n: i for i, n in enumerate(projs[0].op.graph.nodes)}
        projs.sort(key=lambda p: order[p.op])
        open_cols: set[fx.Node] = set()
        for p in projs:
            if open_cols & _ancestors_in_layer(p.op, layer):
                p.role = "row"
                open_cols.clear()
            else:
                p.role = "column"
                open_cols.add(p.op)


def _ancestors_in_layer(node: fx.Node, layer) -> set[fx.Node]:
    seen, stack = set(), list(node.all_input_nodes)
    while stack:
        x = stack.pop()
        if x in seen or layer_of(x) != layer:
            continue
        seen.add(x)
        stack.extend(x.all_input_nodes)
    return seen


def _split(shape, dim: int, ways: int) -> bool:
    return 0 <= dim < len(shape) and shape[dim] % ways == 0


def _tp_specs(roles: Roles) -> dict[str, int | None]:
    """Megatron TP: parameter target → the dim split over the tp axis (``None``: replicated)."""
    out: dict[str, int | None] = {t: None for t in roles.params}
    for p in roles.projections:
        if p.role in ("column", "head"):
            out[p.weight] = p.out_dim
            if p.bias is not None:
                out[p.bias] = 0
        elif p.role == "row":
            out[p.weight] = 1 - p.out_dim
    for t, rows in roles.embeddings.items():
        if roles.vocab is not None and rows == roles.vocab:
            out[t] = 0
    return out


def recipes(traced, mesh: MeshSpec) -> list[Recipe]:
    """The constraint sets of DDP, FSDP, FSDP + EP, Megatron TP and FSDP + TP (module docstring) for a
    traced model on ``mesh``, the layers of a repeated list written once where they are placed
    alike (``model.layers.*.mlp.up_proj.weight``); a recipe that cannot be written has
    ``constraints=None`` and its ``reason``."""
    return [replace(r, constraints=_folded(r.constraints)) if r.constraints else r for r in _recipes(traced, mesh)]


def _folded(constraints: dict[str, str]) -> dict[str, str]:
    """``constraints`` (one entry per tensor name) with the names that differ only in their
    outermost layer index and are placed alike written as one glob, when it matches exactly
    those names: a constraint set people read, and one pattern to match instead of one per
    layer (matching is patterns × tensors)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for name, text in constraints.items():
        groups.setdefault((fold(name)[0], text), []).append(name)
    out = {}
    for (key, text), names in groups.items():
        pattern = key.format("*")
        if len(names) > 1 and [n for n in constraints if fnmatch.fnmatchcase(n, pattern)] == names:
            out[pattern] = text
        else:
            out.update(dict.fromkeys(names, text))
    return out


def _recipes(traced, mesh: MeshSpec) -> list[Recipe]:
    """:func:`recipes` with one constraint per tensor name."""
    roles = find_roles(traced)
    names = mesh.axis_names
    nd, size = mesh.ndim, mesh.size
    every = tuple(range(nd))
    out = []

    def spec(on: dict[int, int]) -> str:  # mesh axis → tensor dim split
        return format_spec(tuple(Shard(on[a]) if a in on else R for a in range(nd)), names)

    def batch(axes) -> tuple[dict[str, str], str]:
        ways = math.prod(mesh.shape[a] for a in axes)
        bad = [n for n, s in roles.inputs.items() if s and s[0] % ways]
        if bad:
            return {}, f"the batch of {bad[0]} ({roles.inputs[bad[0]][0]}) is not divisible by {ways} devices"
        return {n: spec({a: 0 for a in axes}) for n, s in roles.inputs.items() if s}, ""

    dp_all, why = batch(every)
    if why:
        out += [Recipe("DDP", None, why), Recipe("FSDP (ZeRO-3)", None, why)]
    else:
        out.append(Recipe("DDP", {t: "R" for t in roles.params} | dp_all))
        fsdp, notes = {}, []
        for t, shape in roles.params.items():
            d = next((d for d in range(len(shape)) if _split(shape, d, size)), None)
            fsdp[t] = spec({a: d for a in every}) + " -> R" if d is not None else "R"
            if d is None:
                notes.append(t)
        out.append(Recipe("FSDP (ZeRO-3)", fsdp | dp_all,
                          notes=[f"{len(notes)} parameters no mesh split divides stay replicated"] if notes else []))
        out += _expert_parallel(traced, mesh, fsdp | dp_all)
    tp_axis = nd - 1
    tp_name = f"Megatron TP over {names[tp_axis]}" + (f", DP over {', '.join(names[:-1])}" if nd > 1 else "")
    if not any(p.role for p in roles.projections):
        reason = "no repeated layer with projections (matrix products of 2-D parameters) found"
        return out + [Recipe(tp_name, None, reason), Recipe("FSDP + TP", None, reason)]
    tp = mesh.shape[tp_axis]
    dims = _tp_specs(roles)
    bad = [t for t, d in dims.items() if d is not None and not _split(roles.params[t], d, tp)]
    if bad:
        reason = f"{bad[0]} {list(roles.params[bad[0]])} cannot be split {tp} ways along dim {dims[bad[0]]}"
        return out + [Recipe(tp_name, None, reason), Recipe("FSDP + TP", None, reason)]
    dp_axes = tuple(range(nd - 1))
    batch_dp, why = batch(dp_axes) if dp_axes else ({n: "R" for n, s in roles.inputs.items() if s}, "")
    megatron = {t: spec({tp_axis: d} if d is not None else {}) for t, d in dims.items()}
    out.append(Recipe(tp_name, megatron | batch_dp) if not why else Recipe(tp_name, None, why))
    if nd < 2:
        out.append(Recipe("FSDP + TP", None, "needs a 2-D mesh (FSDP over the first axis, TP over the last)"))
        return out
    dp = math.prod(mesh.shape[a] for a in dp_axes)
    both, notes = {}, 0
    for t, d in dims.items():
        shape = roles.params[t]
        part_dim = next((e for e in range(len(shape)) if e != d and _split(shape, e, size)), None)
        if t in roles.fused and d is not None and part_dim is not None:
            # a fused weight is sliced into parts along d, which a split of d would mix: stored split over every
            # axis along another dim, sliced there, and each part read in its Megatron placement
            both[t] = spec({a: part_dim for a in every}) + f" -> {spec({tp_axis: d})}"
            continue
        order = [e for e in range(len(shape)) if e != d] + ([d] if d is not None else [])  # other dims first
        fs = next((e for e in order if _split(shape, e, dp * (tp if e == d else 1))), None)
        notes += fs is None
        on = {a: fs for a in dp_axes} if fs is not None else {}
        if d is not None:
            on[tp_axis] = d
        # read in its Megatron placement; one Megatron replicates (a row-parallel bias, a norm) is read as
        # the planner chooses: a row-parallel product adds its bias as a pending sum (P(tp)), not whole
        # a fused projection's parts slice the gathered weight, which a Megatron split cannot be read as
        use = fs is not None and d is not None and t not in roles.fused
        both[t] = spec(on) + (f" -> {spec({tp_axis: d})}" if use else "")
    if why:
        out.append(Recipe("FSDP + TP", None, why))
    else:
        note = [f"{notes} parameters stay replicated over {', '.join(names[:-1])}"] if notes else []
        out.append(Recipe("FSDP + TP", both | batch_dp, notes=note))
    return out


def _expert_parallel(traced, mesh: MeshSpec, fsdp: dict[str, str]) -> list[Recipe]:
    """FSDP + EP (module docstring) from the FSDP recipe's constraints ``fsdp``: ``[]`` for a
    model without routed experts."""
    nodes = [n for n in traced.gm.graph.nodes if n.op == "call_function" and n.target is ROUTED_EXPERTS]
    if not nodes:
        return []
    counts = {n.args[3].meta["val"].shape[0] for n in nodes}
    ep = next((a for a in reversed(range(mesh.ndim)) if mesh.shape[a] > 1 and all(e % mesh.shape[a] == 0
                                                                                   for e in counts)), None)
    name = "FSDP + EP" + (f" over {mesh.axis_names[ep]}" if ep is not None else "")
    if ep is None:
        return [Recipe(name, None, f"no mesh axis divides the experts' counts {sorted(counts)}")]
    others = [a for a in range(mesh.ndim) if a != ep]
    ways = math.prod(mesh.shape[a] for a in others)
    out = dict(fsdp)
    for n in nodes:
        for weight in n.args[3:5]:
            shape = tuple(weight.meta["val"].shape)
            held = {ep: 0} | ({a: 1 for a in others} if _split(shape, 1, ways) else {})
            read = (Shard(0) if a == ep else R for a in range(mesh.ndim))
            out[_param_target(weight)] = (format_spec(tuple(Shard(held[a]) if a in held else R
                                                            for a in range(mesh.ndim)), mesh.axis_names)
                                          + " -> " + format_spec(tuple(read), mesh.axis_names))
        out[node_info(n).module_path] = format_spec((Shard(0),) * mesh.ndim, mesh.axis_names)
    return [Recipe(name, out)]


@dataclass
class Row:
    """One line of a :class:`Comparison`: ``plan`` ``None`` when the recipe cannot be
    expressed or planned (``reason``), or was not planned because its step is at least
    ``at_least_s`` seconds, more than a faster recipe's (:func:`price`)."""

    name: str
    plan: object | None
    reason: str = ""
    notes: list[str] = field(default_factory=list)
    at_least_s: float | None = None


@dataclass
class Comparison:
    """The plan and the recipes priced by one cost model (:func:`autoparallel.compare`); ``rows[0]`` is
    the unconstrained plan. ``str()`` prints the table."""

    mesh: MeshSpec
    rows: list[Row]

    @property
    def plan(self):
        return self.rows[0].plan

    def best_recipe(self) -> Row | None:
        """The recipe with the shortest estimated step, ``None`` when none could be planned."""
        done = [r for r in self.rows[1:] if r.plan is not None]
        return min(done, key=lambda r: r.plan.estimate.step_time_s) if done else None

    def __str__(self) -> str:
        from .summary import columns, step_parts

        base = self.plan.estimate.step_time_s
        table = [("", "step", "vs plan", "compute", "exposed comm", "recompute", "peak memory")]
        notes = []
        for r in self.rows:
            if r.plan is None:
                table.append((r.name, "-", "", "", "", "", ""))
                notes.append(f"  {r.name}: cannot be expressed: {r.reason}")
                continue
            step, compute, comm, recompute = step_parts(r.plan)
            peak = r.plan.estimate.peak_memory_bytes
            table.append((r.name, units.seconds(step), f"{step / base:.2f}x", units.seconds(compute),
                          units.seconds(comm), units.seconds(recompute), units.nbytes(peak) if peak is not None else "?"))
            notes += [f"  {r.name}: {n}" for n in r.notes]
        m = self.mesh
        head = (f"the plan vs hand-written recipes on {' × '.join(f'{n} ({a})' for a, n in zip(m.axis_names, m.shape))}, "
                f"priced by {self.plan.estimate.costs or 'the same cost model'}:")
        best = self.best_recipe()
        step = best.plan.estimate.step_time_s if best else 0.0
        tail = [f"best recipe: {best.name}, {step / base:.2f}x the plan's step"] if best else []
        return "\n".join([head, columns(table)] + notes + tail)


def price(traced, mesh: MeshSpec, planner, strategies, *, solver: str, time_limit: float,
          memory_budget: int | None, costs: str, every: bool = False) -> list[Row]:
    """Every recipe of :func:`recipes` planned on the planner of a plan, without tracing or
    pricing anything again: ``strategies`` (the plan's, before its own constraints) narrowed
    by the recipe (:func:`autoparallel.constraints.restrict`), then
    :meth:`~autoparallel.solver.planner.Planner.restricted` regroups followers and layers and
    solves the ILP with the plan's memory budget and activation checkpointing, reusing the
    memoized redistribution paths: the same steps as ``plan(constraints=recipe)``, so the
    same plan.

    Two shortcuts, each exact about what it reports: a recipe whose parameters and optimizer
    states alone (live through the whole step) exceed ``memory_budget`` gets that as its
    reason without a solve (the planner's infeasibility search costs minutes at Llama-3-8B
    scale); and unless ``every`` (:func:`autoparallel.compare`) asks to plan each recipe, DDP is planned and then
    the others in order of a lower bound of their step (:func:`step_bound`), and a recipe
    whose bound exceeds the fastest step found is not planned (``Row.at_least_s``): it cannot
    be the fastest.

    Args:
        traced: the :class:`~autoparallel.tracer.capture.TracedModel` the plan was made from.
        mesh: its mesh; planner: its :class:`~autoparallel.solver.planner.Planner`.
        strategies: node → strategies of the plan before its constraints (not modified).
        solver / time_limit / memory_budget: as the plan was solved (seconds, bytes).
        costs: what priced the plan (``CostModel.describe()``), recorded in each row's plan.

    Returns:
        one :class:`Row` per recipe, in :func:`recipes`' order: its plan (``estimate`` and
        placements; no alternatives or memory timeline), or why it has none.
    """
    rows: dict[str, Row] = {}
    ready = []  # (not DDP, step bound, recipe, restricted planner, its problem, resolved constraints)
    listed = recipes(traced, mesh)
    for r in listed:
        if r.constraints is None:
            rows[r.name] = Row(r.name, None, r.reason)
            continue
        try:
            pins = resolve(r.constraints, traced, mesh)
            sub, built = _restricted_problem(planner, strategies, pins, mesh, memory_budget)
            ready.append((r.name != "DDP", step_bound(built.ilp), r, sub, built, pins))
        except AutoParallelError as e:
            rows[r.name] = Row(r.name, None, f"{type(e).__name__}: {e}")
    fastest = math.inf
    for _, bound, r, sub, built, pins in sorted(ready, key=lambda x: x[:2]):
        if not every and r.name != "DDP" and bound > fastest * (1 + 1e-9):
            rows[r.name] = Row(r.name, None, f"not planned: its step is at least {units.seconds(bound)}, more "
                                             f"than the fastest recipe's {units.seconds(fastest)}", r.notes, bound)
            continue
        try:
            p = sub.solve(solver=solver, time_limit=time_limit, memory_budget=memory_budget, inspect=False,
                          built=built)
        except AutoParallelError as e:
            rows[r.name] = Row(r.name, None, f"{type(e).__name__}: {e}")
            continue
        p.estimate = replace(p.estimate, costs=costs)
        p.inspection.placement_constraints = {q.pattern: q.text(mesh.axis_names) for q in pins}
        fastest = min(fastest, p.estimate.step_time_s)
        rows[r.name] = Row(r.name, p, notes=r.notes)
    return [rows[r.name] for r in listed]


def _restricted_problem(planner, strategies, pins, mesh: MeshSpec, memory_budget: int | None):
    """``(planner, its built problem)`` of ``strategies`` narrowed by ``pins`` (resolved
    constraints).

    Raises:
        ConstraintError: a pin no strategy meets.
        InfeasiblePlanError: parameters and optimizer states alone over ``memory_budget`` bytes.
    """
    narrowed = {n: list(ss) for n, ss in strategies.items()}
    restrict(narrowed, planner.aliases, pins, mesh.axis_names)
    floor = resident_floor(planner.memory, narrowed) if planner.memory is not None else 0
    if memory_budget is not None and floor > memory_budget:
        raise InfeasiblePlanError(f"parameters and optimizer states alone take {units.nbytes(floor)} per "
                                  f"device, over the {units.nbytes(memory_budget)} budget")
    sub = planner.restricted(narrowed)
    return sub, sub.build_problem()


def step_bound(problem) -> float:
    """A lower bound of the step (s) of every plan of a sharding ILP
    (:class:`~autoparallel.solver.ilp.ILPProblem`): each group at its cheapest strategy,
    counting its own seconds and the redistributions on edges whose other side has one spec
    class (folded into it, as the solver folds them); the other edges, exposed
    communication, fixed charges and recomputation add seconds that are never negative.

    Raises:
        InfeasiblePlanError: a group with no possible strategy (as the solver would).
    """
    lin, _ = fold_edges(problem)
    return sum(min(c) for c in lin)


def resident_floor(memory, strategies) -> int:
    """Bytes per device that no choice among ``strategies`` brings below: the memory items
    live through the whole step (parameters and optimizer states, :mod:`autoparallel.solver.memory`),
    each at its smallest size over its owner's strategies. A lower bound of every plan's peak."""
    last = memory.steps - 1
    return sum(min(it.size(s) for s in strategies[it.owner]) for it in memory.items
               if it.start == 0 and it.end == last and it.source is None and strategies.get(it.owner))


def baselines(rows: list[Row]) -> dict[str, dict]:
    """``plan.inspection.baselines``: recipe name → ``step_time_s``, ``comm_s``,
    ``recompute_s`` (seconds), ``peak_memory_bytes``; ``step_at_least_s`` for a recipe not
    planned because it cannot be the fastest (:func:`price`); or ``reason`` (text) when it
    cannot be expressed or planned."""
    out = {}
    for r in rows:
        if r.plan is None:
            out[r.name] = {"step_at_least_s": r.at_least_s} if r.at_least_s is not None else {"reason": r.reason}
            continue
        est = r.plan.estimate
        out[r.name] = {"step_time_s": est.step_time_s, "comm_s": est.comm_s, "recompute_s": est.recompute_s,
                       "peak_memory_bytes": est.peak_memory_bytes}
    return out
