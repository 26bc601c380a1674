"""Plan: the chosen strategy of every node, the conversions between them, and estimates.

A plan is data: printable as a table, JSON round-trip exact, and identical on every rank
(rank 0 solves, the others receive its JSON).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from tabulate import tabulate

from .mesh import MeshSpec
from .placement import Spec, spec_from_json, spec_str, spec_to_json
from .solver.layout import Move


@dataclass
class NodePlan:
    """The strategy chosen for one graph node.

    Attributes:
        name / op / module_path: the fx node, its ATen op and its module.
        in_shapes / out_shapes: global shapes of the data tensor inputs and outputs.
        input_specs / output_specs: the specs the strategy needs and produces.
        compute_s: forward + backward compute seconds on one device.
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
    def from_json(cls, d: dict) -> "NodePlan":
        d = dict(d)
        d["in_shapes"] = [tuple(s) for s in d["in_shapes"]]
        d["out_shapes"] = [tuple(s) for s in d["out_shapes"]]
        d["input_specs"] = [spec_from_json(s) for s in d["input_specs"]]
        d["output_specs"] = [spec_from_json(s) for s in d["output_specs"]]
        return cls(**d)


@dataclass
class Conversion:
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
    def from_json(cls, d: dict) -> "Conversion":
        return cls(d["src"], d["src_index"], d["dst"], d["arg"], tuple(d["shape"]),
                   [Move.from_json(m) for m in d["moves"]], d["cost_s"])


@dataclass
class Plan:
    """Node → strategy, edge → collectives, estimates (see module docstring).

    Attributes:
        mesh: the MeshSpec planned for.
        nodes: per node (in graph order) its :class:`NodePlan`.
        conversions: every resharding between nodes.
        param_placements: parameter and buffer name (tied names included) → spec.
        estimate: ``step_time_s`` (predicted seconds of one forward+backward, recomputation
            included), ``compute_s``, ``comm_s``, ``peak_memory_bytes`` (per device, with
            recomputation when there is some) and ``memory`` (the peak without recomputation,
            its step and breakdown, see :mod:`autoparallel.solver.memory`; with recomputation
            also ``checkpointed_peak_bytes``).
        solver_stats: ILP size, times (s), status.
        checkpoint: activation checkpointing (empty when none): ``stages`` (node name →
            chain stage), ``regions`` (nested ``{"start", "stop", "children"}`` stage ranges
            run under ``torch.utils.checkpoint``), ``table`` (per top-level region: stages,
            bytes saved, recompute seconds) and ``recompute_s``.
    """

    mesh: MeshSpec
    nodes: dict[str, NodePlan]
    conversions: list[Conversion]
    param_placements: dict[str, Spec]
    estimate: dict = field(default_factory=dict)
    solver_stats: dict = field(default_factory=dict)
    checkpoint: dict = field(default_factory=dict)

    @property
    def collectives(self) -> list[dict]:
        """The forward collectives of the plan: ``kind`` (all_reduce, all_gather,
        reduce_scatter, all_to_all), ``mesh_axes``, ``bytes`` and the consuming ``node``."""
        out = []
        for c in self.conversions:
            for m in c.moves:
                if m.kind in ("slice", "mask"):
                    continue
                out.append({"kind": m.kind, "mesh_axes": [m.axis], "bytes": m.nbytes, "node": c.dst,
                            "src": c.src})
        return out

    def table(self, all_nodes: bool = False) -> str:
        """The plan as a text table; bookkeeping nodes with no cost are left out unless ``all_nodes``."""
        rows = []
        for n in self.nodes.values():
            if not all_nodes and n.op in ("placeholder", "getitem") and not n.comm_s:
                continue
            rows.append([n.name, n.op, n.module_path, n.specs_str(), f"{n.compute_s:.3g}", f"{n.comm_s:.3g}",
                         n.memory_bytes])
        hdr = ["node", "op", "module", "input specs → output spec", "compute s", "comm s", "memory B"]
        est = self.estimate
        foot = (f"mesh {self.mesh.shape}: estimated step {est.get('step_time_s', 0):.4g} s "
                f"(compute {est.get('compute_s', 0):.4g} s, communication {est.get('comm_s', 0):.4g} s), "
                f"peak memory {est.get('peak_memory_bytes', 0) / 2**20:.1f} MiB per device; "
                f"{len(self.collectives)} forward collectives")
        out = tabulate(rows, hdr, tablefmt="simple") + "\n" + foot
        if self.checkpoint:
            regions = [[r["stages"], r["modules"], r["nodes"], f"{r['saved_bytes'] / 2**20:.1f}",
                        f"{r['recompute_s']:.3g}"] for r in self.checkpoint["table"]]
            out += "\n\nactivation checkpointing (recomputed in backward):\n" + tabulate(
                regions, ["stages", "modules", "nodes", "memory saved MiB", "recompute s"], tablefmt="simple")
        return out

    def __str__(self) -> str:
        return self.table()

    def to_json(self) -> str:
        return json.dumps({
            "mesh": self.mesh.to_json(),
            "nodes": [n.to_json() for n in self.nodes.values()],
            "conversions": [c.to_json() for c in self.conversions],
            "param_placements": {k: spec_to_json(v) for k, v in self.param_placements.items()},
            "estimate": self.estimate,
            "solver_stats": self.solver_stats,
            "checkpoint": self.checkpoint,
        })

    @classmethod
    def from_json(cls, s: str) -> "Plan":
        d = json.loads(s)
        nodes = [NodePlan.from_json(n) for n in d["nodes"]]
        return cls(MeshSpec.from_json(d["mesh"]), {n.name: n for n in nodes},
                   [Conversion.from_json(c) for c in d["conversions"]],
                   {k: spec_from_json(v) for k, v in d["param_placements"].items()},
                   d["estimate"], d["solver_stats"], d.get("checkpoint", {}))

    def __eq__(self, other) -> bool:
        return isinstance(other, Plan) and self.to_json() == other.to_json()
