"""PlanOptions: every planning option, its default written once, validated on construction.

:func:`autoparallel.plan` and :func:`autoparallel.autoparallelize` build one from their
keyword arguments (or take one as ``options=``) and hand it to every stage: the capture reads
``stamp_layers`` and ``mp_policy``, the planning stage (:func:`autoparallel.solver.pipeline.
plan_traced`) the rest, and the plan cache keys a plan by :meth:`PlanOptions.cache_key`.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field

from torch.distributed.fsdp import MixedPrecisionPolicy

from . import precision
from .constraints import check_type as check_constraints_type
from .pipeline_plan import SCHEDULES
from .plan import INPUTS, OUTPUTS
from .solver.costs import CostModel, optimizer_implementation
from .solver.ilp import SOLVERS
from .solver.memory import DEFAULT_OPTIMIZER, OPTIMIZER_STATES, resolve_budget

PARALLELISM = ("auto", "data", "fsdp")
CHECKPOINTING = ("auto", "off", "full", "selective")
"""Activation checkpointing: recompute when the budget asks for it, never, every stage, or every
stage selectively (matmul and attention outputs kept)."""
PIPELINE = ("off", "auto")
"""Pipeline stages: never (unless a mesh axis is named ``"pp"``), or where they pay."""
RENAMED = {"share_blocks": "share_layers"}
"""Deprecated keyword → its name now (accepted with a DeprecationWarning)."""


@dataclass(frozen=True)
class PlanOptions:
    """The options of one planning problem.

    Attributes:
        cost_model: a :class:`~autoparallel.CostModel`, or ``None``: the A100 preset for
            :func:`~autoparallel.plan`; for :func:`~autoparallel.autoparallelize` the
            mesh it runs on, measured on first use (:func:`autoparallel.profile_mesh`).
        strict: raise on ops without a sharding rule instead of replicating them.
        solver: the ILP solver, ``"cbc"`` or ``"highs"``.
        time_limit: seconds the ILP solver may take (positive, finite).
        parallelism: ``"auto"`` (search everything), ``"data"`` (parameters replicated:
            plain data parallelism under the same cost model) or ``"fsdp"`` (parameters
            sharded along every mesh axis and all-gathered for use).
        share_layers: one set of ILP variables for identical repeated layers.
        cache_dir: plan cache folder; ``None`` for ``AUTOPARALLEL_CACHE_DIR`` or
            ``~/.cache/autoparallel``, ``False`` for no cache (:mod:`autoparallel.cache`).
        memory_budget: peak bytes per device the training step may use (a number, or text
            such as ``"12GiB"``); ``None`` for the device's memory less a 10 % reserve (the
            cost model's preset capacity for :func:`~autoparallel.plan`, the real device's
            for :func:`~autoparallel.autoparallelize`); ``"unlimited"`` for no limit. The
            peak is modelled by :mod:`autoparallel.solver.memory`; when sharding alone does
            not fit, activations are recomputed (see ``checkpointing``).
        checkpointing: activation checkpointing (recomputing activations in the backward):
            ``"auto"``: only when no sharding alone fits ``memory_budget``, the regions Rotor's
            schedule picks (:mod:`autoparallel.solver.remat`); ``"off"``: never (a budget no
            sharding fits raises InfeasiblePlanError); ``"full"``: every stage of the repeated
            layers (each sub-layer, e.g. ``attn``, ``mlp``) is a region, whatever the budget
            (a model without two repeated layers has no stages: nothing is recomputed);
            ``"selective"``: every stage keeps the outputs of its matmuls and attention and
            recomputes the other ops (:mod:`autoparallel.runtime_kernels.recompute`). Under
            ``"auto"`` the schedule chooses per stage among the three.
        offload: when no plan fits ``memory_budget`` otherwise, let parameters sharded over
            every mesh axis be held in host memory with their gradients and optimizer states,
            stepped there (:mod:`autoparallel.strategies.offload`); ``False``: never.
        zero: when the fastest plan does not fit ``memory_budget``, let parameters replicated
            along mesh axes shard their optimizer states (and the shard the optimizer steps)
            over those axes, all-gathered after each step (ZeRO stage 1), and their gradients
            too, reduce-scattered (stage 2; :mod:`autoparallel.strategies.zero`); ``False``:
            never. Not offered to pipeline stages.
        optimizer: ``"adamw"``, ``"adam"``, ``"sgd_momentum"`` or ``"sgd"``: the optimizer
            whose states the memory model counts and whose step the estimate prices.
        optimizer_foreach: the ``foreach=`` the optimizer is built with: ``True``, its foreach
            implementation (one dispatch per tensor list; a whole state-sized list of
            temporaries at the step), ``False``, the per-tensor loop, ``None``, what
            ``torch.optim`` picks for ``device`` (foreach on CUDA, the loop on CPU:
            :func:`~autoparallel.solver.costs.optimizer_implementation`).
        device: the device type the module runs on (``"cpu"``, ``"cuda"``): which kernels'
            saved tensors the memory model measures; :func:`~autoparallel.autoparallelize`
            sets the mesh's.
        stamp_layers: capture a deep stack of identical layers by tracing four of them and
            copying the rest (:mod:`autoparallel.tracer.stamp`); ``False`` traces them all.
        outputs: ``"sharded"``: each output in the placement its producer computes it in
            (a loss whole, split logits as a DTensor); ``"replicated"``: every output whole.
        constraints: ``{glob pattern: placements}`` for parameters, buffers, module outputs,
            inputs or outputs to place as given (:mod:`autoparallel.constraints`).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` or ``None``
            (:mod:`autoparallel.precision`).
        baselines: also price the hand-written recipes (DDP, FSDP, Megatron TP, FSDP + TP)
            beside the plan (:func:`autoparallel.recipes.price`; one ILP solve each), into
            ``plan.estimate`` baselines. Off by default: :func:`autoparallel.compare` and the
            CLI's ``--compare`` ask for them.
        replicate_buffers: plan every buffer replicated, not only those the forward writes
            (set for a model planned in eval mode, which training may write back whole).
        inputs: ``"global"``: every rank passes the whole batch and ``meta_inputs`` have its
            shapes; ``"local"``: every rank passes its own batch (DDP, a ``DistributedSampler``),
            ``meta_inputs`` have one rank's shapes, and the module computes on the ranks'
            batches concatenated along dim 0 in rank order (:data:`autoparallel.plan.INPUTS`).
        pipeline: ``"auto"``: the planner may split the repeated layers into pipeline stages
            over a mesh axis where that is faster (:mod:`autoparallel.solver.stages`);
            ``"off"``: no stages, unless a mesh axis is named ``"pp"``, which always carries
            them (:class:`~autoparallel.pipeline_plan.PipelinePlan`).
        microbatches: pin the number of microbatches of a pipelined plan (``None``: chosen).
        schedule: pin the schedule of a pipelined plan, one of
            :data:`autoparallel.pipeline_plan.SCHEDULES` (``None``: chosen).

    Raises (on construction):
        TypeError: an option of the wrong type (named, with the value given).
        ValueError: an unknown ``solver``, ``parallelism``, ``checkpointing``, ``optimizer``, ``outputs``, ``inputs``,
            ``pipeline`` or ``schedule``; ``microbatches`` not a positive int; a
            ``time_limit`` that is not positive and finite; an unreadable ``memory_budget``.
    """

    cost_model: CostModel | None = None
    strict: bool = False
    solver: str = "cbc"
    time_limit: float = 60.0
    parallelism: str = "auto"
    share_layers: bool = True
    cache_dir: str | os.PathLike | bool | None = None
    memory_budget: int | float | str | None = None
    checkpointing: str = "auto"
    optimizer: str = DEFAULT_OPTIMIZER
    optimizer_foreach: bool | None = None
    device: str = "cpu"
    stamp_layers: bool = True
    outputs: str = "sharded"
    constraints: dict | None = field(default=None, hash=False)
    mp_policy: MixedPrecisionPolicy | None = None
    baselines: bool = False
    replicate_buffers: bool = False
    inputs: str = "global"
    offload: bool = True
    zero: bool = True
    pipeline: str = "off"
    microbatches: int | None = None
    schedule: str | None = None

    def __post_init__(self):
        _check(self)
        object.__setattr__(self, "mp_policy", precision.check_policy(self.mp_policy))

    @classmethod
    def build(cls, options: "PlanOptions | None" = None, caller: str = "plan", **keywords) -> "PlanOptions":
        """``options`` (default: every default) with ``keywords`` replacing its fields.

        Raises:
            TypeError: ``options`` not a PlanOptions, or a keyword that is no option (the
                message names the closest ones).
            ValueError: a deprecated keyword given with its new name.
        """
        if options is not None and not isinstance(options, PlanOptions):
            raise TypeError(f"options must be an autoparallel.PlanOptions, not {type(options).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        for old, new in RENAMED.items():
            if old in keywords:
                warnings.warn(f"{caller}({old}=...) is deprecated; pass {new}=", DeprecationWarning, stacklevel=3)
                if new in keywords:
                    raise ValueError(f"{caller}(): give {new}= only ({old}= is its deprecated name)")
                keywords[new] = keywords.pop(old)
        for key in keywords:
            if key not in names:
                close = difflib.get_close_matches(key, sorted(names), n=3)
                hint = f"; did you mean {' or '.join(close)}?" if close else f"; options are {', '.join(sorted(names))}"
                raise TypeError(f"{caller}() got an unknown option {key!r}{hint}")
        return dataclasses.replace(options or cls(), **keywords)

    def optimizer_implementation(self) -> str:
        """The optimizer's implementation the step is priced and counted for: ``"foreach"``
        or ``"for-loop"`` (``optimizer_foreach``, else torch's default for ``device``)."""
        if self.optimizer_foreach is None:
            return optimizer_implementation(self.device)
        return "foreach" if self.optimizer_foreach else "for-loop"

    def cache_key(self, budget) -> dict:
        """The options that change the plan, as JSON-ready values (``budget``: the resolved
        memory budget in bytes or ``None``). The cost model is keyed on its own
        (:meth:`CostModel.key`); ``time_limit`` and ``cache_dir`` change no plan of a solve
        that finishes."""
        return {"strict": self.strict, "solver": self.solver, "parallelism": self.parallelism,
               "share_layers": self.share_layers, "memory_budget": budget, "optimizer": self.optimizer,
               "optimizer_foreach": self.optimizer_foreach, "device": self.device, "replicate_buffers": self.replicate_buffers, "outputs": self.outputs,
               "mp_policy": precision.policy_to_json(self.mp_policy), "baselines": self.baselines,
               "inputs": self.inputs, "checkpointing": self.checkpointing, "offload": self.offload,
                "zero": self.zero, "pipeline": self.pipeline, "microbatches": self.microbatches, "schedule": self.schedule}


def _check(o: PlanOptions) -> None:
    """The checks of :class:`PlanOptions` (raises as its docstring lists)."""
    if o.cost_model is not None and not isinstance(o.cost_model, CostModel):
        raise TypeError(f"cost_model must be an autoparallel.CostModel (or None for the default), not {o.cost_model!r}")
    for name in ("strict", "share_layers", "stamp_layers", "baselines", "replicate_buffers", "offload", "zero"):
        if not isinstance(getattr(o, name), bool):
            raise TypeError(f"{name} must be True or False, not {getattr(o, name)!r}")
    if o.solver not in SOLVERS:
        raise ValueError(f"solver must be one of {', '.join(map(repr, SOLVERS))}, not {o.solver!r}")
    if not isinstance(o.time_limit, numbers.Real) or isinstance(o.time_limit, bool):
        raise TypeError(f"time_limit must be a number of seconds, not {o.time_limit!r}")
    if not (math.isfinite(o.time_limit) and o.time_limit > 0):
        raise ValueError(f"time_limit must be a positive, finite number of seconds, not {o.time_limit!r}")
    if o.parallelism not in PARALLELISM:
        raise ValueError(f"parallelism must be 'auto', 'data' or 'fsdp', not {o.parallelism!r}")
    if o.cache_dir is not None and o.cache_dir is not False and not isinstance(o.cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a folder (str or path), None for the default or False for no cache, "
                        f"not {o.cache_dir!r}")
    _check_budget(o.memory_budget)
    if o.checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be {', '.join(map(repr, CHECKPOINTING))}, not {o.checkpointing!r}")
    if o.optimizer not in OPTIMIZER_STATES:
        choices = ", ".join(map(repr, sorted(OPTIMIZER_STATES)))
        raise ValueError(f"optimizer must be one of {choices}, not {o.optimizer!r}")
    if o.optimizer_foreach is not None and not isinstance(o.optimizer_foreach, bool):
        raise TypeError(f"optimizer_foreach must be True, False or None (torch's default), not {o.optimizer_foreach!r}")
    if o.outputs not in OUTPUTS:
        raise ValueError(f"outputs must be {' or '.join(map(repr, OUTPUTS))}, not {o.outputs!r}")
    if not isinstance(o.inputs, str) or o.inputs not in INPUTS:
        raise ValueError(f"inputs must be {' or '.join(map(repr, INPUTS))}, not {o.inputs!r}")
    if o.constraints is not None:
        check_constraints_type(o.constraints)
    if o.pipeline not in PIPELINE:
        raise ValueError(f"pipeline must be {' or '.join(map(repr, PIPELINE))}, not {o.pipeline!r}")
    if o.microbatches is not None and (isinstance(o.microbatches, bool) or not isinstance(o.microbatches, int)
                                       or o.microbatches < 1):
        raise ValueError(f"microbatches must be a positive int or None, not {o.microbatches!r}")
    if o.schedule is not None and o.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(map(repr, SCHEDULES))} or None, not {o.schedule!r}")
    if not isinstance(o.device, str):
        raise TypeError(f"device must be a device type string such as 'cuda' or 'cpu', not {o.device!r}")


def _check_budget(budget) -> None:
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (numbers.Real, str)):
        raise TypeError(f"memory_budget must be bytes (a number) or a string such as '12GiB', not {budget!r}")
    if isinstance(budget, numbers.Real) and not math.isfinite(budget):
        raise ValueError(f"memory_budget must be a finite number of bytes, not {budget!r}")
    resolve_budget(budget, lambda: 0)
