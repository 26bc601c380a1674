"""Plan: the chosen strategy of every node, the redistributions between them, the activation
checkpointing, and estimates.

A plan is data: printable as a table, JSON round-trip exact, and identical on every rank
(rank 0 solves, the others receive its JSON).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard

from . import precision
from .jsonfields import _check, _fields, _is_count, _is_number
from .mesh import MeshSpec
from .pipeline_plan import PipelinePlan
from .placement import P, R, Spec, is_replicated, shard, spec_from_json, spec_str, spec_to_json, unit_of
from .results import Estimate, Inspection, SolverStats, from_old_layout

OUTPUTS = ("sharded", "replicated")
"""How the module returns its outputs (the ``outputs=`` planning option): ``"sharded"`` in
the placement of the value's producer with every pending sum reduced (:func:`returned_spec`),
``"replicated"`` whole on every device."""

INPUTS = ("global", "local")
"""What each rank passes the module (the ``inputs=`` planning option): ``"global"`` the whole
batch, the same on every rank (every tensor input replicated, each op reading its part);
``"local"`` its own batch, as under DDP with a ``DistributedSampler`` (every tensor input split
along dim 0 over every mesh axis, rank ``r`` holding the ``r``-th rows of the global batch)."""


def returned_spec(src: Spec, outputs: str, whole: bool = False) -> Spec:
    """The placements a graph output produced in ``src`` is returned in: replicated when
    ``outputs == "replicated"`` or ``whole`` (a buffer write-back), else ``src`` with each
    ``Partial`` replaced by ``Replicate`` (a shard costs nothing, a pending sum is reduced).

    Raises:
        ValueError: ``outputs`` is not one of :data:`OUTPUTS`.
    """
    if outputs not in OUTPUTS:
        raise ValueError(f"outputs must be one of {', '.join(map(repr, OUTPUTS))}, not {outputs!r}")
    if outputs == "replicated" or whole:
        return (R,) * len(src)
    return tuple(R if p.is_partial() or unit_of(p) > 1 else p for p in src)  # DTensor holds no unit cut


@dataclass(frozen=True)
class Move:
    """One step of a redistribution (:mod:`autoparallel.solver.layout`): ``kind`` (one of
    :data:`MOVE_KINDS`) along mesh ``axis``; ``src_dim``/``dst_dim`` are the tensor dims
    involved (``None`` where not applicable); ``nbytes`` the bytes the collective moves (as
    in :meth:`~autoparallel.solver.costs.CostModel.collective_time`); ``unit`` the rows per
    unit of the cut a slice or reduce-scatter makes (:class:`~autoparallel.placement.UnitShard`;
    1 for a plain cut, and in JSON only when it is not 1)."""

    kind: str
    axis: int
    src_dim: int | None
    dst_dim: int | None
    nbytes: int
    unit: int = 1

    def to_json(self) -> list:
        return [self.kind, self.axis, self.src_dim, self.dst_dim, self.nbytes] + ([self.unit] if self.unit != 1 else [])

    def applied_to(self, spec: Spec) -> Spec:
        """The spec this move turns ``spec`` into.

        Raises:
            ValueError: an unknown kind.
        """
        new = {"all_gather": R, "all_reduce": R, "mask": P}.get(self.kind)
        if new is None:
            if self.kind not in ("reduce_scatter", "all_to_all", "slice"):
                raise ValueError(f"unknown move {self.kind}")
            new = shard(self.dst_dim, self.unit)
        return spec[:self.axis] + (new,) + spec[self.axis + 1:]


@dataclass(frozen=True)
class Region:
    """Chain stages ``[start, stop)`` run under one ``torch.utils.checkpoint``; ``children``
    are checkpointed again during its recompute (:mod:`autoparallel.solver.rotor`). A
    ``selective`` region is one stage that keeps its matmul and attention outputs and
    recomputes the rest (:mod:`autoparallel.runtime_kernels.recompute`)."""

    start: int
    stop: int
    children: tuple["Region", ...] = ()
    selective: bool = False

    def to_json(self) -> dict:
        return {"start": self.start, "stop": self.stop, "children": [c.to_json() for c in self.children],
                "selective": self.selective}


@dataclass
class RegionSummary:
    """One top-level checkpoint region as the plan's table prints it: its ``stages``
    (``"3-5"``), the first and last ``modules`` it runs, its op ``nodes``, the activation
    bytes per device it saves (``saved_bytes``), the forward seconds it recomputes, and its
    ``policy``: ``"full"`` (only the region's inputs kept) or ``"selective"`` (matmul and
    attention outputs kept too)."""

    stages: str
    modules: str
    nodes: int
    saved_bytes: int
    recompute_s: float
    policy: str = "full"


@dataclass
class CheckpointSchedule:
    """Checkpoint regions with the seconds they recompute and the activation peak (bytes
    per device) the chain model gives them."""

    regions: tuple[Region, ...]
    recompute_s: float
    chain_peak_bytes: float

    def to_json(self) -> dict:
        return {"regions": [r.to_json() for r in self.regions], "recompute_s": self.recompute_s,
                "chain_peak_bytes": self.chain_peak_bytes}


@dataclass
class CheckpointPlan:
    """The activation checkpointing of a plan (:mod:`autoparallel.solver.remat`).

    Attributes:
        stages: node name → its stage in the chain the regions are ranges of.
        regions: the top-level regions, nested, run under non-reentrant ``torch.utils.checkpoint``.
        table: per top-level region, what it saves and recomputes.
        recompute_s: forward seconds recomputed in the backward.
        chain_peak_bytes: the activation peak of the chain model under ``regions`` (bytes per
            device; ``None`` in plans that did not record it).
        every_stage: for comparison, the schedule checkpointing every stage (``None`` when
            not recorded).
    """

    stages: dict[str, int]
    regions: tuple[Region, ...]
    table: list[RegionSummary]
    recompute_s: float
    chain_peak_bytes: float | None = None
    every_stage: CheckpointSchedule | None = None

    def to_json(self) -> dict:
        return {"stages": dict(self.stages), "regions": [r.to_json() for r in self.regions],
                "table": [asdict(r) for r in self.table], "recompute_s": self.recompute_s,
                "chain_peak_bytes": self.chain_peak_bytes,
                "every_stage": self.every_stage.to_json() if self.every_stage else {}}

    @classmethod
    def from_json(cls, d) -> "CheckpointPlan":
        """Inverse of :meth:`to_json`; ``chain_peak_bytes`` and ``every_stage`` may be absent.

        Raises:
            ValueError: a field missing, unknown or of the wrong type, or regions that are
                not ascending, disjoint stage ranges within the chain and their parent.
        """
        _fields(d, _CHECKPOINT_FIELDS, "checkpoint", optional=("chain_peak_bytes", "every_stage"))
        stages = d["stages"]
        _check(isinstance(stages, dict) and bool(stages) and all(_is_count(v) for v in stages.values()),
               "checkpoint", "stages", "an object of node name -> stage (int >= 0)", stages)
        n_stages = max(stages.values()) + 1
        regions = _regions(d["regions"], 0, n_stages, "regions")
        _check(_is_number(d["recompute_s"]), "checkpoint", "recompute_s", "a number of seconds", d["recompute_s"])
        _check(isinstance(d["table"], list), "checkpoint", "table", "a list", d["table"])
        table = [_region_summary(row, f"table[{i}]") for i, row in enumerate(d["table"])]
        peak = d.get("chain_peak_bytes")
        _check(peak is None or _is_number(peak), "checkpoint", "chain_peak_bytes", "a number of bytes", peak)
        every = d.get("every_stage") or None
        if every is not None:
            _fields(every, ("regions", "recompute_s", "chain_peak_bytes"), "checkpoint: every_stage")
            for k in ("recompute_s", "chain_peak_bytes"):
                _check(_is_number(every[k]), "checkpoint: every_stage", k, "a number", every[k])
            every = CheckpointSchedule(_regions(every["regions"], 0, n_stages, "every_stage.regions"),
                                       every["recompute_s"], every["chain_peak_bytes"])
        return cls(dict(stages), regions, table, d["recompute_s"], peak, every)


@dataclass
class NodePlan:
    """The strategy chosen for one graph node.

    Attributes:
        name / op / module_path: the fx node, its ATen op and its module.
        in_shapes / out_shapes: global shapes of the data tensor inputs and outputs.
        input_specs / output_specs: the specs the strategy needs and produces.
        compute_s: forward + backward compute seconds on one device; for a trainable
            parameter, its update by the optimizer step.
        comm_s: seconds of communication charged to the node: resharding its inputs and,
            for parameters, reducing their gradients.
        memory_bytes: bytes per device of the node's outputs (for parameters, value and gradient).
    """

    name: str
    op: str
    module_path: str
    in_shapes: list[tuple[int, ...]]
    out_shapes: list[tuple[int, ...]]
    input_specs: list[Spec]
    output_specs: list[Spec]
    compute_s: float = 0.0
    comm_s: float = 0.0
    memory_bytes: int = 0

    def specs_str(self) -> str:
        ins = ", ".join(spec_str(s, len(sh)) for s, sh in zip(self.input_specs, self.in_shapes))
        outs = ", ".join(spec_str(s, len(sh)) for s, sh in zip(self.output_specs, self.out_shapes))
        return f"{ins} → {outs}" if ins else outs

    def to_json(self) -> dict:
        d = asdict(self)
        d["input_specs"] = [spec_to_json(s) for s in self.input_specs]
        d["output_specs"] = [spec_to_json(s) for s in self.output_specs]
        return d

    @classmethod
    def from_json(cls, d: dict, where: str = "node") -> "NodePlan":
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: a field missing, unknown or of the wrong type, a bad placement, a
                spec that splits a dim the shape does not have, or specs and shapes of
                different counts (``where`` names the node in the message).
        """
        _fields(d, _NODE_FIELDS, where)
        where = f"{where} {d['name']!r}" if isinstance(d["name"], str) else where
        for k in ("name", "op", "module_path"):
            _check(isinstance(d[k], str), where, k, "a string", d[k])
        _check(bool(d["name"]), where, "name", "a non-empty string", d["name"])
        for k in ("compute_s", "comm_s"):
            _check(_is_number(d[k]), where, k, "a number of seconds", d[k])
        _check(_is_count(d["memory_bytes"]), where, "memory_bytes", "an int >= 0", d["memory_bytes"])
        shapes = {k: _shapes(d[k], where, k) for k in ("in_shapes", "out_shapes")}
        specs = {k: _specs(d[k], where, k) for k in ("input_specs", "output_specs")}
        for sk, hk in (("input_specs", "in_shapes"), ("output_specs", "out_shapes")):
            # a getitem of a non-tensor value has a spec but no shape
            if len(specs[sk]) != len(shapes[hk]) and not (d["op"] == "getitem" and not shapes[hk]):
                raise ValueError(f"{where}: {len(specs[sk])} {sk} for {len(shapes[hk])} {hk}")
            for i, (spec, shape) in enumerate(zip(specs[sk], shapes[hk])):
                _check_dims(spec, len(shape), where, f"{sk}[{i}]")
        return cls(d["name"], d["op"], d["module_path"], shapes["in_shapes"], shapes["out_shapes"],
                   specs["input_specs"], specs["output_specs"], d["compute_s"], d["comm_s"], d["memory_bytes"])


@dataclass
class Redistribution:
    """Resharding of value ``src[src_index]`` into input ``arg`` of node ``dst``
    (``dst == "output"`` for the graph's returned values, ``arg`` then their index)."""

    src: str
    src_index: int
    dst: str
    arg: int
    shape: tuple[int, ...]
    moves: list[Move]
    cost_s: float

    def to_json(self) -> dict:
        return {"src": self.src, "src_index": self.src_index, "dst": self.dst, "arg": self.arg,
                "shape": list(self.shape), "moves": [m.to_json() for m in self.moves], "cost_s": self.cost_s}

    @classmethod
    def from_json(cls, d: dict, where: str = "redistribution") -> "Redistribution":
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: a field missing, unknown or of the wrong type, or a move that is not
                ``[kind, mesh axis, src dim, dst dim, bytes]`` with a known kind and dims of
                the tensor (``where`` names the redistribution in the message).
        """
        _fields(d, _REDISTRIBUTION_FIELDS, where)
        for k in ("src", "dst"):
            _check(isinstance(d[k], str) and bool(d[k]), where, k, "a node name", d[k])
        for k in ("src_index", "arg"):
            _check(_is_count(d[k]), where, k, "an int >= 0", d[k])
        _check(_is_number(d["cost_s"]), where, "cost_s", "a number of seconds", d["cost_s"])
        shape = _shape(d["shape"], where, "shape")
        _check(isinstance(d["moves"], list), where, "moves", "a list", d["moves"])
        moves = []
        for i, m in enumerate(d["moves"]):
            at = f"{where}: moves[{i}]"
            if not (isinstance(m, list) and len(m) in (5, 6)):
                raise ValueError(f"{at} is {m!r}, expected [kind, mesh axis, src dim, dst dim, bytes] "
                                 "(and the unit of the cut, when not 1)")
            kind, axis, src_dim, dst_dim, nbytes, unit = m + [1] * (6 - len(m))
            if kind not in MOVE_KINDS:
                raise ValueError(f"{at}: kind {kind!r} is not one of {', '.join(MOVE_KINDS)}")
            if not (_is_count(axis) and _is_count(nbytes)):
                raise ValueError(f"{at}: mesh axis and bytes must be ints >= 0, got {axis!r} and {nbytes!r}")
            for what, dim in (("src dim", src_dim), ("dst dim", dst_dim)):
                if dim is not None and not (_is_count(dim) and dim < len(shape)):
                    raise ValueError(f"{at}: {what} {dim!r} is not a dim of the {len(shape)}-dim tensor")
            if not (_is_count(unit) and unit >= 1 and (unit == 1 or kind in ("slice", "reduce_scatter"))):
                raise ValueError(f"{at}: unit {unit!r} must be an int >= 1, and 1 unless the move is a slice or "
                                 "reduce-scatter")
            moves.append(Move(kind, axis, src_dim, dst_dim, nbytes, unit))
        return cls(d["src"], d["src_index"], d["dst"], d["arg"], shape, moves, d["cost_s"])


def holds_dtensors(param_placements: dict[str, Spec]) -> bool:
    """Whether a module whose parameters and buffers are placed as ``param_placements`` (name
    → spec) holds them as DTensors: unless every one is replicated on every device, in which
    case they are plain tensors, as under DDP (docs/design.md, "Plain parameters when the plan
    replicates them all")."""
    return not all(is_replicated(s) for s in param_placements.values())


@dataclass
class Plan:
    """Node → strategy, edge → collectives, estimates (see module docstring).

    Attributes:
        mesh: the MeshSpec planned for.
        nodes: per node (in graph order) its :class:`NodePlan`.
        redistributions: every resharding between nodes.
        param_placements: parameter and buffer name (tied names included) → spec.
        estimate: the predicted step and peak memory, and what priced them (:class:`~autoparallel.results.Estimate`).
        solver_stats: the ILP's size and outcome, the planning's timings (:class:`~autoparallel.results.SolverStats`).
        checkpoint: the activation checkpointing, ``None`` when nothing is recomputed.
        outputs: how outputs are returned, one of :data:`OUTPUTS` (:func:`returned_spec`);
            plans saved without the field are ``"replicated"``, as they were made.
        mp_policy: the mixed-precision policy the graph was captured and priced under
            (:mod:`autoparallel.precision`), ``None`` for none (also in plans saved without it).
        inspection: what the summary, explain and plot read (:class:`~autoparallel.results.Inspection`).
        inputs: what each rank passes, one of :data:`INPUTS`; plans saved without the field
            are ``"global"``, as they were made.
        offloaded: names of the parameters held in host memory with their gradients and
            optimizer states (:mod:`autoparallel.strategies.offload`); empty in plans saved
            without the field.
        state_placements: parameter name → the spec of the shard the optimizer holds and steps,
            for parameters whose optimizer states are sharded over axes that replicate them
            for compute (ZeRO stage 1, :mod:`autoparallel.strategies.zero`; the module's
            ``nn.Parameter`` is that shard); empty in plans saved without the field.
        sharded_gradients: names in ``state_placements`` whose gradient is reduce-scattered
            onto the shard instead of all-reduced whole (ZeRO stage 2); every axis replicating
            such a parameter splits its state.
        pipeline: the pipeline stages (:class:`~autoparallel.pipeline_plan.PipelinePlan`), or
            ``None`` (also in plans saved without the field). When set, ``mesh`` is one stage's
            submesh and the graph planned is one microbatch's.
    """

    mesh: MeshSpec
    nodes: dict[str, NodePlan]
    redistributions: list[Redistribution]
    param_placements: dict[str, Spec]
    estimate: Estimate = field(default_factory=Estimate)
    solver_stats: SolverStats = field(default_factory=SolverStats)
    checkpoint: CheckpointPlan | None = None
    outputs: str = "replicated"
    mp_policy: MixedPrecisionPolicy | None = None
    inspection: Inspection = field(default_factory=Inspection)
    inputs: str = "global"
    offloaded: tuple[str, ...] = ()
    pipeline: PipelinePlan | None = None
    state_placements: dict[str, Spec] = field(default_factory=dict)
    sharded_gradients: tuple[str, ...] = ()

    @property
    def collectives(self) -> list[dict]:
        """The forward collectives of the plan: ``kind`` (all_reduce, all_gather,
        reduce_scatter, all_to_all), ``mesh_axes``, ``bytes`` and the consuming ``node``."""
        out = []
        for c in self.redistributions:
            for m in c.moves:
                if m.kind in ("slice", "mask"):
                    continue
                out.append({"kind": m.kind, "mesh_axes": [m.axis], "bytes": m.nbytes, "node": c.dst,
                            "src": c.src})
        return out

    @property
    def holds_dtensors(self) -> bool:
        """Whether the module of this plan holds its parameters and buffers as DTensors
        (:func:`holds_dtensors`)."""
        return holds_dtensors(self.param_placements) or bool(self.state_placements)

    def table(self, by: str = "module", all_nodes: bool = False) -> str:
        """The plan as a text table (:mod:`autoparallel.table`): one row per module with the
        parameters it holds, their placements, and its compute and communication seconds and
        memory bytes per device; ``by="node"`` one row per ATen node with its input and output
        placements (bookkeeping nodes with no cost only with ``all_nodes``).

        Raises:
            ValueError: an unknown ``by``, or ``all_nodes`` without ``by="node"``.
        """
        from .table import table

        return table(self, by, all_nodes)

    def __str__(self) -> str:
        """The one-screen summary (:mod:`autoparallel.summary`); :meth:`table` lists every module."""
        from .summary import summary

        return summary(self)

    def explain(self, name: str, nodes: bool = False) -> str:
        """Why ``name`` (a parameter or buffer name, a module path or a node) is placed as it
        is: its chosen strategy and the next best alternatives with their differences in
        compute and communication (seconds) and memory (bytes per device); for a module, one
        line per parameter it holds and per direct submodule, or with ``nodes`` every node it
        runs itself (definition: :mod:`autoparallel.explain`).

        Raises:
            KeyError: ``name`` designates nothing in the plan.
        """
        from .explain import explain

        return explain(self, name, nodes)

    def plot(self, path) -> list[str]:
        """Write the plan's pictures (:func:`autoparallel.plot.plot`: per-layer step time and
        the memory timeline) next to ``path`` (a ``.png`` file name); returns the files written.

        Raises:
            ImportError: matplotlib is missing (``pip install 'autoparallel[plot]'``).
        """
        from .plot import plot

        return plot(self, path)

    def to_json(self) -> str:
        return json.dumps({
            "mesh": self.mesh.to_json(),
            "nodes": [n.to_json() for n in self.nodes.values()],
            "redistributions": [c.to_json() for c in self.redistributions],
            "param_placements": {k: spec_to_json(v) for k, v in self.param_placements.items()},
            "estimate": self.estimate.to_json(),
            "solver_stats": self.solver_stats.to_json(),
            "checkpoint": self.checkpoint.to_json() if self.checkpoint else {},
            "outputs": self.outputs,
            "mp_policy": precision.policy_to_json(self.mp_policy),
            "inspection": self.inspection.to_json(),
            "inputs": self.inputs,
            "offloaded": list(self.offloaded),
            "pipeline": self.pipeline.to_json() if self.pipeline else None,
            "state_placements": {k: spec_to_json(v) for k, v in self.state_placements.items()},
            "sharded_gradients": list(self.sharded_gradients),
        })

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        """The plan written by :meth:`to_json`. Checks the structure only (fields, types,
        placements, spec lengths against the mesh, dims against the shapes, moves, the
        checkpoint region tree); :func:`autoparallel.validate.validate_plan` checks a plan
        against a graph.

        Raises:
            ValueError: for text that is not a plan's JSON, naming the first bad field.
        """
        try:
            d = json.loads(s)
        except (TypeError, ValueError) as e:
            raise ValueError(f"a plan must be JSON text: {e}") from None
        if isinstance(d, dict) and "conversions" in d and "redistributions" not in d:
            d["redistributions"] = d.pop("conversions")  # its name in plans saved before the rename
        _fields(d, _PLAN_FIELDS, "plan",
                optional=("checkpoint", "outputs", "mp_policy", "inspection", "inputs", "offloaded",
                          "pipeline", "state_placements", "sharded_gradients"))
        try:
            mp_policy = precision.policy_from_json(d.get("mp_policy"))
        except ValueError as e:
            raise ValueError(f"plan: mp_policy: {e}") from None
        outputs = d.get("outputs", "replicated")  # plans saved before the field returned everything whole
        _check(outputs in OUTPUTS, "plan", "outputs", " or ".join(map(repr, OUTPUTS)), outputs)
        inputs = d.get("inputs", "global")  # plans saved before the field took the global batch
        _check(isinstance(inputs, str) and inputs in INPUTS, "plan", "inputs", " or ".join(map(repr, INPUTS)), inputs)
        _check(isinstance(d["mesh"], dict), "plan", "mesh", "an object", d["mesh"])
        _fields(d["mesh"], ("shape", "axis_names", "alpha", "beta"), "mesh")
        try:
            mesh = MeshSpec.from_json(d["mesh"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"mesh: {e}") from None
        for k in ("nodes", "redistributions"):
            _check(isinstance(d[k], list), "plan", k, "a list", d[k])
        _check(isinstance(d["param_placements"], dict), "plan", "param_placements", "an object", d["param_placements"])
        nodes: dict[str, NodePlan] = {}
        for i, nd in enumerate(d["nodes"]):
            n = NodePlan.from_json(nd, f"nodes[{i}]")
            if n.name in nodes:
                raise ValueError(f"nodes[{i}]: node {n.name!r} appears twice")
            for k, specs in (("input_specs", n.input_specs), ("output_specs", n.output_specs)):
                for j, spec in enumerate(specs):
                    _check_len(spec, mesh, f"node {n.name!r}", f"{k}[{j}]")
            nodes[n.name] = n
        redistributions = [Redistribution.from_json(c, f"redistributions[{i}]")
                           for i, c in enumerate(d["redistributions"])]
        for i, c in enumerate(redistributions):
            for m in c.moves:
                if m.axis >= mesh.ndim:
                    raise ValueError(f"redistributions[{i}]: a move along mesh axis {m.axis} of a {mesh.ndim}-axis mesh")
        params = {}
        for k, v in d["param_placements"].items():
            params[k] = _spec(v, "param_placements", k)
            _check_len(params[k], mesh, "param_placements", k)
        offloaded = d.get("offloaded", [])
        _check(isinstance(offloaded, list) and all(isinstance(k, str) and k in params for k in offloaded), "plan",
               "offloaded", "a list of names in param_placements", offloaded)
        states = _state_placements(d.get("state_placements", {}), params, mesh)
        scattered = d.get("sharded_gradients", [])
        _check(isinstance(scattered, list) and all(isinstance(k, str) and k in states and all(
            p != R or n == 1 or q != p for p, q, n in zip(params[k], states[k], mesh.shape)) for k in scattered),
            "plan", "sharded_gradients", "a list of names in state_placements whose state splits every axis "
            "that replicates them", scattered)
        checkpoint = d.get("checkpoint", {})
        _check(isinstance(checkpoint, dict), "plan", "checkpoint", "an object", checkpoint)
        checkpoint = CheckpointPlan.from_json(checkpoint) if checkpoint else None
        estimate, stats, inspection = d["estimate"], d["solver_stats"], d.get("inspection")
        if inspection is None:  # saved before the records: free-form estimate and solver_stats
            recompute = checkpoint.recompute_s if checkpoint else 0.0
            estimate, stats, inspection = from_old_layout(estimate, stats, recompute)
        return cls(mesh, nodes, redistributions, params, Estimate.from_json(estimate), SolverStats.from_json(stats),
                   checkpoint, outputs, mp_policy, Inspection.from_json(inspection), inputs, tuple(offloaded),
                   PipelinePlan.from_json(d["pipeline"]) if d.get("pipeline") is not None else None, states,
                   tuple(scattered))

    def __eq__(self, other) -> bool:
        return isinstance(other, Plan) and self.to_json() == other.to_json()


MOVE_KINDS = ("all_gather", "all_to_all", "slice", "all_reduce", "reduce_scatter", "mask")
"""The kinds of :class:`Move` (see :mod:`autoparallel.solver.layout`)."""
_NODE_FIELDS = ("name", "op", "module_path", "in_shapes", "out_shapes", "input_specs", "output_specs",
                "compute_s", "comm_s", "memory_bytes")
_REDISTRIBUTION_FIELDS = ("src", "src_index", "dst", "arg", "shape", "moves", "cost_s")
_PLAN_FIELDS = ("mesh", "nodes", "redistributions", "param_placements", "estimate", "solver_stats", "checkpoint",
                "outputs", "mp_policy", "inspection", "inputs", "offloaded", "pipeline", "state_placements",
                "sharded_gradients")
_CHECKPOINT_FIELDS = ("stages", "regions", "table", "recompute_s", "chain_peak_bytes", "every_stage")
_SUMMARY_FIELDS = ("stages", "modules", "nodes", "saved_bytes", "recompute_s")


def _shape(v, where: str, field_name: str) -> tuple[int, ...]:
    _check(isinstance(v, list) and all(_is_count(x) for x in v), where, field_name, "a list of ints >= 0", v)
    return tuple(v)


def _shapes(v, where: str, field_name: str) -> list[tuple[int, ...]]:
    _check(isinstance(v, list), where, field_name, "a list of shapes", v)
    return [_shape(x, where, f"{field_name}[{i}]") for i, x in enumerate(v)]


def _spec(v, where: str, field_name: str) -> Spec:
    try:
        return spec_from_json(v)
    except ValueError as e:
        raise ValueError(f"{where}: {field_name}: {e}") from None


def _specs(v, where: str, field_name: str) -> list[Spec]:
    _check(isinstance(v, list), where, field_name, "a list of specs", v)
    return [_spec(x, where, f"{field_name}[{i}]") for i, x in enumerate(v)]


def _check_dims(spec: Spec, ndim: int, where: str, field_name: str) -> None:
    for p in spec:
        if isinstance(p, Shard) and p.dim >= ndim:
            raise ValueError(f"{where}: {field_name} {spec_to_json(spec)} splits dim {p.dim} of a {ndim}-dim tensor")


def _state_placements(d, params: dict[str, Spec], mesh: MeshSpec) -> dict[str, Spec]:
    """The ``state_placements`` field: names of ``params``, each a spec that differs from the
    parameter's only where the parameter is replicated and the state is split (``Shard``),
    along one dim the parameter's spec does not split."""
    _check(isinstance(d, dict), "plan", "state_placements", "an object", d)
    states = {}
    for k, v in d.items():
        _check(k in params, "plan", "state_placements", "names in param_placements", k)
        spec = states[k] = _spec(v, "state_placements", k)
        _check_len(spec, mesh, "state_placements", k)
        held = params[k]
        diff = [(p, q) for p, q in zip(spec, held) if p != q]
        dims = {p.dim for p, _ in diff if type(p) is Shard}
        ok = (bool(diff) and all(q == R and type(p) is Shard for p, q in diff) and len(dims) == 1
              and not dims & {q.dim for q in held if isinstance(q, Shard)})
        _check(ok, "state_placements", k, f"the parameter's placements {spec_to_json(held)} with one dim they do "
               "not split split over axes they replicate", spec_to_json(spec))
    return states


def _check_len(spec: Spec, mesh: MeshSpec, where: str, field_name: str) -> None:
    if len(spec) != mesh.ndim:
        raise ValueError(f"{where}: {field_name} {spec_to_json(spec)} has {len(spec)} placements, the mesh "
                         f"{mesh.shape} has {mesh.ndim} axes")


def _regions(regions, lo: int, hi: int, where: str) -> tuple[Region, ...]:
    """The regions of a list of ``{"start", "stop", "children", "selective"}`` stage ranges,
    ascending and disjoint, within ``[lo, hi)``, children inside their parent; ``selective``
    (absent in plans saved before it: false) only on one stage without children."""
    _check(isinstance(regions, list), "checkpoint", where, "a list of regions", regions)
    out, prev = [], lo
    for i, r in enumerate(regions):
        at = f"{where}[{i}]"
        _fields(r, ("start", "stop", "children", "selective"), f"checkpoint: {at}", optional=("selective",))
        start, stop = r["start"], r["stop"]
        if not (_is_count(start) and _is_count(stop) and prev <= start < stop <= hi):
            raise ValueError(f"checkpoint: {at} covers stages [{start!r}, {stop!r}), expected ints with "
                             f"{prev} <= start < stop <= {hi} (regions ascending, disjoint, inside their parent)")
        selective = r.get("selective", False)
        _check(selective is False or (selective is True and stop == start + 1 and not r["children"]), "checkpoint",
               f"{at}.selective", "a bool, true only on a region of one stage without children", selective)
        out.append(Region(start, stop, _regions(r["children"], start, stop, f"{at}.children"), selective))
        prev = stop
    return tuple(out)


def _region_summary(row, where: str) -> RegionSummary:
    """A table row; ``policy`` is absent in plans saved before selective regions (``"full"``)."""
    ok = isinstance(row, dict) and set(_SUMMARY_FIELDS) <= set(row) <= {*_SUMMARY_FIELDS, "policy"} \
        and isinstance(row["stages"], str) and isinstance(row["modules"], str) and _is_count(row["nodes"]) \
        and _is_count(row["saved_bytes"]) and _is_number(row["recompute_s"]) \
        and row.get("policy", "full") in ("full", "selective")
    _check(ok, "checkpoint", where, "an object with stages and modules (strings), nodes and saved_bytes "
           "(ints >= 0), recompute_s (seconds) and policy ('full' or 'selective')", row)
    return RegionSummary(**row)
