"""What a plan records beside its placements, as typed records:

* :class:`Estimate`: the predicted step (seconds) and peak memory (bytes per device) of the
  plan, and what priced it;
* :class:`SolverStats`: the size and outcome of the sharding ILP that chose it, and the
  seconds each planning stage took;
* :class:`Inspection`: what the views (:mod:`autoparallel.summary`, :mod:`autoparallel.explain`,
  :mod:`autoparallel.plot`) read and nothing else does: per-node alternatives, the memory
  timeline, parameter names and reads, the recipes priced beside the plan
  (:mod:`autoparallel.solver.inspect` computes them).

Each is JSON round-trip exact (``to_json`` / ``from_json``). :func:`from_old_layout` reads the
two free-form objects (``estimate`` and ``solver_stats``) that plans saved before these records
held (plan cache 0.8.1 and earlier) into their fields.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field, fields

from . import units
from .jsonfields import _check, _fields, _is_count, _is_number


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device live at the modelled peak, by kind (the kinds of
    :mod:`autoparallel.solver.memory`, which takes them from here)."""

    parameters: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    gathered: int = 0
    temporaries: int = 0
    inputs: int = 0
    outputs: int = 0
    buffers: int = 0

    def items(self) -> list[tuple[str, int]]:
        """``(kind, bytes)`` in the order of the fields."""
        return [(f.name, getattr(self, f.name)) for f in fields(self)]

    def __repr__(self) -> str:
        return f"MemoryBreakdown({', '.join(f'{k}={units.nbytes(v)}' for k, v in self.items() if v)})"

    @classmethod
    def from_json(cls, d) -> "MemoryBreakdown":
        """Kinds absent from ``d`` are 0 (plans from before a kind existed).

        Raises:
            ValueError: an unknown kind, or bytes that are not a number.
        """
        names = [f.name for f in fields(cls)]
        _fields(d, names, "estimate: memory.breakdown", optional=names)
        for k, v in d.items():
            _check(_is_number(v), "estimate: memory.breakdown", k, "a number of bytes", v)
        return cls(**d)


@dataclass(frozen=True)
class MemoryPeak:
    """The modelled peak of the step without recomputation (:mod:`autoparallel.solver.memory`):
    ``peak_bytes`` per device at step ``peak_step`` of the ``steps`` of the forward then backward
    timeline, with what is live then by kind (``breakdown``)."""

    peak_bytes: int
    peak_step: int
    steps: int
    breakdown: MemoryBreakdown

    def __repr__(self) -> str:
        return (f"MemoryPeak(peak_bytes={units.nbytes(self.peak_bytes)}, peak_step={self.peak_step}, "
                f"steps={self.steps},\n           breakdown={self.breakdown!r})")

    @property
    def phase(self) -> str:
        """``"forward"`` or ``"backward"``: the half of the timeline the peak is in."""
        return "forward" if self.peak_step < self.steps // 2 else "backward"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d) -> "MemoryPeak":
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: a field missing, unknown or not a number.
        """
        _fields(d, ("peak_bytes", "peak_step", "steps", "breakdown"), "estimate: memory")
        for k in ("peak_bytes", "peak_step", "steps"):
            _check(_is_number(d[k]), "estimate: memory", k, "a number", d[k])
        return cls(d["peak_bytes"], d["peak_step"], d["steps"], MemoryBreakdown.from_json(d["breakdown"]))


@dataclass(frozen=True)
class Estimate:
    """The predicted cost of one training step under a plan. Seconds and bytes per device.

    Attributes:
        step_time_s: the step: ``compute_s + comm_s + recompute_s``.
        compute_s: forward and backward compute, the optimizer step included.
        comm_s: the communication the step waits for: resharding, returning outputs and the
            exposed part of the gradient reduction.
        optimizer_s: the optimizer step's part of ``compute_s``.
        grad_comm_s: every gradient all-reduce, hidden or not; ``exposed_grad_comm_s`` the part
            of it in ``comm_s`` (the rest overlaps the backward).
        recompute_s: forward seconds recomputed in the backward (activation checkpointing).
        peak_memory_bytes: the modelled peak, with recomputation when there is some; ``None``
            when memory was not modelled.
        memory: the peak without recomputation and its breakdown (:class:`MemoryPeak`).
        memory_budget_bytes: the budget planned under, ``None`` for none.
        costs: what priced the plan (:meth:`~autoparallel.solver.costs.CostModel.describe`:
            ``"preset a100"`` or a measured profile), ``""`` when not recorded.
    """

    step_time_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    optimizer_s: float = 0.0
    grad_comm_s: float = 0.0
    exposed_grad_comm_s: float = 0.0
    recompute_s: float = 0.0
    peak_memory_bytes: int | None = None
    memory: MemoryPeak | None = None
    memory_budget_bytes: int | None = None
    costs: str = ""

    def __repr__(self) -> str:
        def t(name):
            return f"{name}={units.seconds(getattr(self, name))}"

        def b(name):
            v = getattr(self, name)
            return f"{name}={units.nbytes(v) if v is not None else None}"

        return (f"Estimate({t('step_time_s')}, {t('compute_s')}, {t('comm_s')}, {t('recompute_s')},\n"
                f"         {t('optimizer_s')}, {t('grad_comm_s')}, {t('exposed_grad_comm_s')},\n"
                f"         {b('peak_memory_bytes')}, {b('memory_budget_bytes')}, costs={self.costs!r},\n"
                f"         memory={self.memory!r})")

    def to_json(self) -> dict:
        d = asdict(self)
        d["memory"] = self.memory.to_json() if self.memory is not None else None
        return d

    @classmethod
    def from_json(cls, d) -> "Estimate":
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: a field missing, unknown or of the wrong type.
        """
        _fields(d, _ESTIMATE_FIELDS, "estimate")
        for k in _ESTIMATE_FIELDS[:7]:
            _check(_is_number(d[k]), "estimate", k, "a number of seconds", d[k])
        for k in ("peak_memory_bytes", "memory_budget_bytes"):
            _check(d[k] is None or _is_number(d[k]), "estimate", k, "a number of bytes or null", d[k])
        _check(isinstance(d["costs"], str), "estimate", "costs", "text", d["costs"])
        memory = MemoryPeak.from_json(d["memory"]) if d["memory"] is not None else None
        return cls(**(d | {"memory": memory}))


_ESTIMATE_FIELDS = tuple(f.name for f in fields(Estimate))


class _Record(ABC):
    """A dataclass written to JSON as its fields and read back checked: exactly its fields,
    each of the type :meth:`_check_types` asks for."""

    _where = ""
    """The name ``from_json``'s errors give the object."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d):
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: a field missing, unknown or of the wrong type.
        """
        _fields(d, [f.name for f in fields(cls)], cls._where)
        cls._check_types(d)
        return cls(**d)

    @classmethod
    @abstractmethod
    def _check_types(cls, d: dict) -> None:
        """Raise ValueError naming the first field of ``d`` of the wrong type."""


@dataclass
class SolverStats(_Record):
    """The sharding ILP that chose a plan (:mod:`autoparallel.solver.ilp`) and the planning's
    timings.

    Attributes:
        solver / status: the solver that ran and how it ended (``"Optimal"`` or at its time
            limit); ``gap``: the relative gap to ``lp_bound_s`` (seconds, ``None`` unknown).
        objective_s: the objective at the chosen plan (seconds, without recomputation), of
            which ``exposed_s`` is exposed gradient communication.
        nodes / edges / strategies: graph nodes, ILP edges and strategies priced; groups /
            ilp_groups / shared_nodes: follower groups, groups with their own variables, nodes
            sharing a repeated layer's variables; binary_vars / edge_vars / constraints: the
            ILP's size; memory_rows / memory_rounds: memory rows priced and solves of the
            memory-budget search.
        build_s / solve_s: seconds of the last ILP's model build and solve.
        stamped_layers: layers copied rather than traced (:mod:`autoparallel.tracer.stamp`).
        cache: ``"hit"``, ``"miss"`` or ``"off"`` (the plan cache), ``""`` outside :func:`~autoparallel.plan`.
        stage_s: planning stage → seconds (``trace``, ``strategies``, ``memory``, ``costs``,
            ``stage1``, ``remat``, ``inspect``, ``baselines``; those that ran).
    """

    solver: str = ""
    status: str = ""
    gap: float = 0.0
    lp_bound_s: float | None = None
    objective_s: float = 0.0
    exposed_s: float = 0.0
    nodes: int = 0
    edges: int = 0
    strategies: int = 0
    groups: int = 0
    ilp_groups: int = 0
    shared_nodes: int = 0
    binary_vars: int = 0
    edge_vars: int = 0
    constraints: int = 0
    memory_rows: int = 0
    memory_rounds: int = 0
    build_s: float = 0.0
    solve_s: float = 0.0
    stamped_layers: int = 0
    cache: str = ""
    stage_s: dict[str, float] = field(default_factory=dict)
    _where = "solver_stats"

    @classmethod
    def _check_types(cls, d: dict) -> None:
        for f in fields(cls):
            v, default = d[f.name], cls.__dataclass_fields__[f.name].default
            if isinstance(default, str):
                _check(isinstance(v, str), "solver_stats", f.name, "text", v)
            elif isinstance(default, int) and not isinstance(default, float):
                _check(_is_count(v), "solver_stats", f.name, "an int >= 0", v)
            elif f.name != "stage_s":
                _check(_is_number(v) or (v is None and default is None), "solver_stats", f.name, "a number", v)
        _check(isinstance(d["stage_s"], dict) and all(_is_number(v) for v in d["stage_s"].values()),
               "solver_stats", "stage_s", "an object of stage -> seconds", d["stage_s"])


@dataclass
class Inspection(_Record):
    """What the views of a plan read (:mod:`autoparallel.solver.inspect` records it at solve
    time): empty in plans made by hand or priced only for their estimate (the recipes).

    Attributes:
        state_nodes: ``get_attr`` node name → every name of its parameter or buffer (tied names too).
        state_reads: such a node → the nodes it is read through (a mixed-precision cast, slices).
        alternatives: node name → its chosen strategy and next best ones (:mod:`autoparallel.explain`).
        memory_timeline: the modelled memory over the step, sampled (``steps``, ``step``,
            ``total``, ``by_kind``; bytes per device), ``None`` when not recorded.
        baselines: recipe name → its estimate beside the plan (:func:`autoparallel.recipes.baselines`),
            ``None`` when not priced.
        fallback_ops: ops planned without a sharding rule (replicated).
        placement_constraints: the user's constraints, pattern → placements as text.
    """

    state_nodes: dict[str, list[str]] = field(default_factory=dict)
    state_reads: dict[str, list[str]] = field(default_factory=dict)
    alternatives: dict[str, dict] = field(default_factory=dict)
    memory_timeline: dict | None = None
    baselines: dict[str, dict] | None = None
    fallback_ops: list[str] = field(default_factory=list)
    placement_constraints: dict[str, str] = field(default_factory=dict)
    _where = "inspection"

    def __repr__(self) -> str:
        steps = self.memory_timeline["steps"] if self.memory_timeline else 0
        return (f"Inspection({len(self.state_nodes)} state nodes, {len(self.state_reads)} read through others, "
                f"{len(self.alternatives)} nodes with alternatives, memory timeline of {steps} steps, "
                f"{len(self.baselines or {})} baselines, fallback_ops={self.fallback_ops}, "
                f"placement_constraints={self.placement_constraints})")

    @classmethod
    def _check_types(cls, d: dict) -> None:
        for k in ("state_nodes", "state_reads", "alternatives", "placement_constraints"):
            _check(isinstance(d[k], dict), "inspection", k, "an object", d[k])
        _check(d["memory_timeline"] is None or isinstance(d["memory_timeline"], dict), "inspection",
               "memory_timeline", "an object or null", d["memory_timeline"])
        _check(isinstance(d["fallback_ops"], list), "inspection", "fallback_ops", "a list", d["fallback_ops"])
        if d["baselines"] is not None:
            _check_baselines(d["baselines"])


def _check_baselines(base) -> None:
    """``Inspection.baselines`` (printed by the summary): recipe name → its estimate
    (:func:`autoparallel.recipes.baselines`), ``{"step_at_least_s": seconds}`` or
    ``{"reason": text}``."""
    _check(isinstance(base, dict), "inspection", "baselines", "an object", base)
    for name, b in base.items():
        where = f"inspection: baselines[{name!r}]"
        if isinstance(b, dict) and "reason" in b:
            _fields(b, ("reason",), where)
            _check(isinstance(b["reason"], str), where, "reason", "text", b["reason"])
            continue
        if isinstance(b, dict) and "step_at_least_s" in b:
            _fields(b, ("step_at_least_s",), where)
            _check(_is_number(b["step_at_least_s"]) and b["step_at_least_s"] >= 0, where, "step_at_least_s",
                   "seconds (a number >= 0)", b["step_at_least_s"])
            continue
        _fields(b, ("step_time_s", "comm_s", "recompute_s", "peak_memory_bytes"), where)
        for k in ("step_time_s", "comm_s", "recompute_s"):
            _check(_is_number(b[k]) and b[k] >= 0, where, k, "seconds (a number >= 0)", b[k])
        _check(b["peak_memory_bytes"] is None or _is_number(b["peak_memory_bytes"]), where, "peak_memory_bytes",
               "a number or null", b["peak_memory_bytes"])


_OLD_STAGES = ("trace", "strategies", "memory", "costs", "stage1", "remat", "inspect", "baselines")
"""Stages whose seconds old plans kept in ``solver_stats`` as ``<stage>_s``."""


def from_old_layout(estimate: dict, stats: dict, recompute_s: float) -> tuple[dict, dict, dict]:
    """The ``estimate``, ``solver_stats`` and ``inspection`` objects of today's JSON from the
    free-form ``estimate`` and ``solver_stats`` objects of a plan saved before these records
    (``recompute_s``: its checkpoint's seconds, which its step included). Keys not listed there
    are left out (``memory.phase``, which :class:`MemoryPeak` derives, and
    ``memory.checkpointed_peak_bytes``, the ``peak_memory_bytes`` of such plans); absent ones
    take the records' defaults.

    Raises:
        ValueError: ``estimate`` or ``solver_stats`` not an object.
    """
    for name, d in (("estimate", estimate), ("solver_stats", stats)):
        _check(isinstance(d, dict), "plan", name, "an object", d)
    est = {k: estimate[k] for k in _ESTIMATE_FIELDS if k in estimate} | {"recompute_s": recompute_s}
    mem = estimate.get("memory")
    if isinstance(mem, dict):
        est["memory"] = {k: mem.get(k) for k in ("peak_bytes", "peak_step", "steps", "breakdown")}
    est = asdict(Estimate()) | est
    keep = {f.name for f in fields(SolverStats)} - {"stage_s"}
    new_stats = asdict(SolverStats()) | {k: v for k, v in stats.items() if k in keep}
    new_stats["stage_s"] = {s: stats[f"{s}_s"] for s in _OLD_STAGES if f"{s}_s" in stats}
    inspection = asdict(Inspection()) | {k: stats[k] for k in ("state_nodes", "state_reads", "alternatives",
                                                               "fallback_ops", "placement_constraints") if k in stats}
    inspection |= {k: estimate[k] for k in ("memory_timeline", "baselines") if k in estimate}
    return est, new_stats, inspection
