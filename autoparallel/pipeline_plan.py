"""The pipeline stages of a plan (:class:`PipelinePlan`): which mesh axis carries stages, which
layers each stage runs, the microbatches and the schedule of ``torch.distributed.pipelining``
that runs them, and what they were priced at.

A pipelined :class:`~autoparallel.plan.Plan` is the plan of one stage's submesh (the whole
mesh less the pipeline axis) for one microbatch (the global batch's dim 0 divided by
``microbatches``): every stage runs its layers with that plan's strategies, and activations
cross stage boundaries in the placements the plan gives them there, so a boundary needs no
redistribution, only a point-to-point send between the two stages' devices of the same
submesh coordinate.
"""

from __future__ import annotations

from dataclasses import dataclass

from .jsonfields import _check, _fields, _is_count, _is_number
from .mesh import MeshSpec

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
"""The schedules of ``torch.distributed.pipelining`` a pipelined module runs, by the names
``torch.distributed.pipelining.schedules.get_schedule_class`` takes. The last three hold several
stages per device (``stages_per_rank``), stage ``s`` on the device of pipeline rank
``s % pp``. The V-shaped zero-bubble schedules (``ZBVZeroBubble``, ``DualPipeV``) place stages
``r`` and ``2·pp − 1 − r`` on rank ``r``, which the stages' placement here does not; they are
not offered."""

MULTI_STAGE = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")

ZERO_BUBBLE = ("InterleavedZeroBubble",)
"""Schedules that split each backward into its input and weight halves, running the weights'
later to fill the bubble (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024); run when
pinned, not chosen by the search (measured slower on CPU: docs/design.md)."""

CHECKPOINTING = ("off", "selective", "full", "auto")
"""A stage's activation checkpointing: none, each layer run selectively (its matmul and
attention outputs kept) or fully recomputed (its input kept), or the memory search's own
regions (``"auto"``)."""


@dataclass(frozen=True)
class PipelinePlan:
    """Pipeline stages over the layers of one ``ModuleList``.

    Attributes:
        mesh: the whole mesh; the plan's own ``mesh`` is a stage's submesh, this less ``axis``.
        axis: the mesh axis that carries stages (``pp`` devices along it).
        layers: module path of the repeated layers (``"transformer.h"``).
        boundaries: ``stages + 1`` layer indices, from 0 to the number of layers: stage ``s``
            runs layers ``boundaries[s]`` to ``boundaries[s + 1] - 1``; what runs before the
            first layer (embeddings) is stage 0's, what runs after the last (final norm, head,
            loss) the last stage's.
        microbatches: how many microbatches the global batch is split into along dim 0.
        schedule: one of :data:`SCHEDULES`.
        stage_s: per stage, the forward and backward of one microbatch, seconds.
        stage_peak_bytes: per stage, its devices' modelled peak with the schedule's activations
            in flight, bytes.
        p2p_s: one microbatch's activations sent to the next stage and their gradient sent
            back, over the pipeline axis, seconds.
        bubble: the fraction of the step a device idles in the schedule (0 to 1).
        step_s: the estimated step, seconds.
        checkpointing: per stage, its activation checkpointing, one of :data:`CHECKPOINTING`
            (empty when not recorded); the plan's checkpoint regions are those of each
            stage's layers.
    """

    mesh: MeshSpec
    axis: int
    layers: str
    boundaries: tuple[int, ...]
    microbatches: int
    schedule: str
    stage_s: tuple[float, ...] = ()
    stage_peak_bytes: tuple[int, ...] = ()
    p2p_s: float = 0.0
    bubble: float = 0.0
    step_s: float = 0.0
    checkpointing: tuple[str, ...] = ()

    def __post_init__(self):
        self.check()

    @property
    def pp(self) -> int:
        """Devices along the pipeline axis."""
        return self.mesh.shape[self.axis]

    @property
    def stages(self) -> int:
        return len(self.boundaries) - 1

    @property
    def stages_per_rank(self) -> int:
        return self.stages // self.pp

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        """The stages the devices at ``pp_rank`` along the pipeline axis run (loop order)."""
        return list(range(pp_rank, self.stages, self.pp))

    def stage_of_layer(self, layer: int) -> int:
        """The stage that runs layer ``layer`` (0-based index into the ``ModuleList``)."""
        for s in range(self.stages):
            if layer < self.boundaries[s + 1]:
                return s
        raise IndexError(f"layer {layer} is past the last boundary {self.boundaries[-1]}")

    def check(self) -> None:
        """Raises:
            ValueError: a field out of range, naming it (boundaries not ascending from 0, a
                stage without layers, a schedule not in :data:`SCHEDULES`, stages not a
                multiple of ``pp``, one stage per device with a multi-stage schedule or the
                reverse, fewer microbatches than ``pp``)."""
        where = "pipeline"
        _check(_is_count(self.axis) and self.axis < self.mesh.ndim, where, "axis", f"a mesh axis < {self.mesh.ndim}",
               self.axis)
        b = self.boundaries
        _check(len(b) >= 2 and all(_is_count(x) for x in b) and b[0] == 0
               and all(x < y for x, y in zip(b, b[1:])), where, "boundaries",
               "ascending layer indices from 0, each stage with at least one layer", list(b))
        _check(self.schedule in SCHEDULES, where, "schedule", " or ".join(SCHEDULES), self.schedule)
        pp = self.pp
        _check(pp >= 2 and self.stages % pp == 0, where, "boundaries",
               f"a multiple of the {pp} devices along mesh axis {self.axis} in stages", self.stages)
        multi = self.schedule in MULTI_STAGE
        _check(multi == (self.stages > pp), where, "schedule",
               "a multi-stage schedule (" + ", ".join(MULTI_STAGE) + ") exactly when a device runs several stages",
               self.schedule)
        _check(_is_count(self.microbatches) and self.microbatches >= pp, where, "microbatches",
               f"an int >= the {pp} pipeline devices", self.microbatches)
        for name in ("stage_s", "stage_peak_bytes"):
            v = getattr(self, name)
            _check(len(v) in (0, self.stages) and all(_is_number(x) and x >= 0 for x in v), where, name,
                   f"{self.stages} numbers >= 0 (or none)", list(v))
        _check(len(self.checkpointing) in (0, self.stages) and all(c in CHECKPOINTING for c in self.checkpointing),
               where, "checkpointing", f"{self.stages} of " + ", ".join(CHECKPOINTING) + " (or none)",
               list(self.checkpointing))
        for name in ("p2p_s", "bubble", "step_s"):
            _check(_is_number(getattr(self, name)) and getattr(self, name) >= 0, where, name, "a number >= 0",
                   getattr(self, name))

    def to_json(self) -> dict:
        return {"mesh": self.mesh.to_json(), "axis": self.axis, "layers": self.layers,
                "boundaries": list(self.boundaries), "microbatches": self.microbatches, "schedule": self.schedule,
                "stage_s": list(self.stage_s), "stage_peak_bytes": list(self.stage_peak_bytes),
                "p2p_s": self.p2p_s, "bubble": self.bubble, "step_s": self.step_s,
                "checkpointing": list(self.checkpointing)}

    @classmethod
    def from_json(cls, d) -> "PipelinePlan":
        """Inverse of :meth:`to_json`; ``checkpointing`` may be absent.

        Raises:
            ValueError: a field missing, unknown or out of range (named)."""
        _check(isinstance(d, dict), "plan", "pipeline", "an object", d)
        _fields(d, _FIELDS, "pipeline", optional=("checkpointing",))
        d = {"checkpointing": []} | d
        _check(isinstance(d["layers"], str), "pipeline", "layers", "a module path", d["layers"])
        for k in ("boundaries", "stage_s", "stage_peak_bytes", "checkpointing"):
            _check(isinstance(d[k], list), "pipeline", k, "a list", d[k])
        try:
            mesh = MeshSpec.from_json(d["mesh"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"pipeline: mesh: {e}") from None
        return cls(mesh, d["axis"], d["layers"], tuple(d["boundaries"]), d["microbatches"], d["schedule"],
                   tuple(d["stage_s"]), tuple(d["stage_peak_bytes"]), d["p2p_s"], d["bubble"], d["step_s"],
                   tuple(d["checkpointing"]))


_FIELDS = ("mesh", "axis", "layers", "boundaries", "microbatches", "schedule", "stage_s", "stage_peak_bytes",
           "p2p_s", "bubble", "step_s", "checkpointing")


def submesh(mesh: MeshSpec, axis: int) -> MeshSpec:
    """``mesh`` less mesh axis ``axis``: the mesh one pipeline stage runs on (one device,
    ``MeshSpec((1,), ("stage",))``, when ``axis`` is the only axis)."""
    keep = [a for a in range(mesh.ndim) if a != axis]
    if not keep:
        return MeshSpec((1,), ("stage",))
    return MeshSpec(tuple(mesh.shape[a] for a in keep), tuple(mesh.axis_names[a] for a in keep),
                    tuple(mesh.alpha[a] for a in keep), tuple(mesh.beta[a] for a in keep))
