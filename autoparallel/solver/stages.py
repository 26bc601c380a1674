"""Pipeline stages: which mesh axis carries them, where the layers are cut, how many
microbatches and which schedule (:class:`~autoparallel.pipeline_plan.PipelinePlan`), each
stage planned on its submesh by :func:`~autoparallel.solver.pipeline.plan_traced`.

The search (:func:`plan_stages`) is Alpa's inter-operator pass (Zheng et al., OSDI'22, §5)
specialised to a model of identical layers, with the intra-operator plan shared by every
stage:

1. candidates: the pipeline axis (the one named ``"pp"``; under ``pipeline="auto"`` every
   axis of two or more devices, and no pipeline at all, solved first so that it bounds the
   rest), microbatch counts ``M`` (divisors of the batch among ``pp, 2pp, 4pp, 8pp``, or the
   pinned one) and schedules (the pinned one, else GPipe, 1F1B, and Interleaved1F1B with two
   stages per device where the layers allow). Counts are tried from the largest down (the
   smallest bubble first) and an axis stops at the first count that (a) has no fitting
   pipeline, or cannot beat the best candidate so far (below): fewer microbatches hold as many
   activations in flight or more (1F1B: ``min(p, M)`` microbatches of ``batch / M`` each;
   GPipe: the whole batch), so they fit no better; or (b) is no faster than the next larger count:
   a heuristic (the step is taken to be unimodal in ``M``: the bubble shrinks as ``M`` grows
   and the per-microbatch work grows, its fixed costs, weight gathers and latencies, repeated
   ``M`` times);
2. per (axis, ``M``): the model captured for one microbatch (once per ``M``, shared by the
   axes), its strategies on the submesh (the mesh less the axis) and their planner built once
   (:func:`~autoparallel.solver.pipeline.prepare`), and at most a few ILP solves on it
   (:func:`_search_at`): the fastest plan; the same with every layer checkpointed
   (selectively, fully) when the fastest plan's split is slowed or blocked by memory; a
   re-solve under a budget when neither fits. Every stage runs its layers with that plan's
   strategies, so the solve prices every layer range; its nodes are aggregated into
   *pieces* (:class:`Pieces`): ``pre`` (what runs before the first layer: embeddings),
   each layer, and ``post`` (final norm, head, loss): per-microbatch seconds (forward,
   backward, their communication and recomputation), per-step seconds (optimizer step and
   exposed gradient reduction), bytes held for the step (parameters, gradients, optimizer
   states), bytes saved per microbatch (activations; a checkpoint region's inputs) and
   transient bytes. A candidate whose fastest plan, split with no memory limit, is no faster
   than the best so far is not checkpointed or re-solved (its steps can only be slower);
3. per schedule: the boundaries by a dynamic program over cut points (the linear-partition
   DP, Alpa's §5.2 recurrence with one device group per stage): ``f[s][j]`` the smallest
   slowest-stage time of ``s`` stages over layers ``[0, j)``, each stage within the memory
   budget with the activations of its microbatches in flight. ``pre`` belongs to stage 0 and
   ``post`` to the last, so uneven splits pay when those pieces are heavy. Each stage runs the
   fastest of the plan's checkpointing choices (:class:`PricedPlan`) that fits it (:func:`split`), so
   checkpointing is chosen per stage. ``O(K · S · L²)`` per schedule (``S`` stages, ``L``
   layers, ``K`` priced plans), each transition O(1) from prefix sums. A device running
   several stages (Interleaved1F1B, LoopedBFS) holds them all: where the stages that fit
   alone overflow it together, its stages move to more recomputation one at a time, the
   fewest seconds added per byte saved first (:func:`fit_ranks`);
4. the step of each candidate by the schedule's model (:func:`step_model`), and the fastest
   candidate that fits is kept; its plan's ``estimate`` holds the pipelined step, so that it
   compares fairly with unpipelined plans.

The step model (Narayanan et al., SC'21, §2.2): with ``p`` devices along the axis, ``v``
stages per device, ``t`` the per-microbatch forward + backward of the slowest device's
stages and ``c`` the point-to-point sends of the boundary activations (forward) and their
gradients (backward) over the pipeline axis,
``step = (M + (p − 1) / v) · (t + v · c) + u`` where ``u`` is the slowest device's
once-per-step work (optimizer step and the exposed part of its gradient reduction); the
bubble fraction is ``((p − 1) / v) / (M + (p − 1) / v)``. A zero-bubble schedule keeps
:data:`ZERO_BUBBLE_IDLE` of that idle time and pays its whole gradient reduction once per step
(reduced after the schedule, not hidden in the backward). Activations in flight per device:
GPipe and LoopedBFS all ``M``; 1F1B stage ``s`` ``min(p − s, M)``; Interleaved1F1B device
``r`` ``min(M·v, (v − 1)·p + 2·(p − 1 − r) + 1)`` chunks (torch's warm-up), each ``1/v`` of
its stages' activations, and so InterleavedZeroBubble (ZB-H1 keeps 1F1B's peak).
"""

from __future__ import annotations

import copy
import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np
import torch

from .. import units
from ..errors import AutoParallelError, InfeasiblePlanError
from ..graph import tensor_inputs
from ..mesh import MeshSpec
from ..options import PlanOptions
from ..pipeline_plan import MULTI_STAGE, ZERO_BUBBLE, PipelinePlan, submesh
from ..placement import local_shape
from ..plan import CheckpointPlan, Plan
from ..strategies.engine import Strategy
from ..tracer.annotate import node_info
from .costs import CostModel
from .memory import MemoryModel, preset_capacity, resolve_budget
from .pipeline import plan_traced, prepare
from .pricing import written_back_outputs
from ..runtime_kernels.recompute import SAVED_TARGETS

log = logging.getLogger("autoparallel")

ZERO_BUBBLE_IDLE = 1 / 3
"""A zero-bubble schedule's idle time as a share of the same interleaved 1F1B's: Qi et al.,
"Zero Bubble Pipeline Parallelism" (ICLR 2024), §3.1: ZB-H1's bubble is ``(p − 1)(T_F + T_B − T_W)``
against 1F1B's ``(p − 1)(T_F + T_B + T_W)``, 1/3 with the input and the weight halves of the
backward each as long as the forward."""

PP_AXIS = "pp"
"""The mesh axis name that always carries pipeline stages."""

MICROBATCH_FACTORS = (1, 2, 4, 8)
"""Microbatch counts tried, as multiples of the devices along the pipeline axis."""

STATE_KINDS = ("parameters", "gradients", "optimizer")
SAVED_KINDS = ("activations", "gathered")


def pipeline_axis(mesh: MeshSpec, options: PlanOptions) -> int | None:
    """The mesh axis that carries stages when it is pinned: the one named :data:`PP_AXIS`;
    ``None`` when none is (the search decides under ``pipeline="auto"``)."""
    return mesh.axis_names.index(PP_AXIS) if PP_AXIS in mesh.axis_names else None


@dataclass
class Pieces:
    """The intra-stage plan aggregated into pieces: index 0 ``pre``, ``1..L`` the layers,
    ``L + 1`` ``post``. Seconds and bytes per device of the submesh.

    Attributes:
        micro_s: per microbatch: forward + backward compute, their communication and recomputation.
        comm_s / recompute_s: the communication and recomputation parts of ``micro_s``.
        step_s: once per step: the optimizer step and the exposed gradient reduction.
        hidden_grad_s: once per step: the gradient reduction's part hidden behind the
            backward, exposed under a zero-bubble schedule (which reduces after the step).
        state: bytes held all step: parameters, gradients, optimizer states.
        saved: bytes saved from forward to backward per microbatch in flight.
        transient: the largest bytes of temporaries live at once within the piece (with a
            checkpointed region's recomputed activations).
        cross: per layer boundary ``b`` (``1..L-1``: between layers ``b-1`` and ``b``), bytes
            per device sent forward, and ``cross_grad`` sent back (their gradients).
        region_piece: per top-level checkpoint region of the plan, the piece it is counted in.
    """

    micro_s: np.ndarray
    comm_s: np.ndarray
    recompute_s: np.ndarray
    step_s: np.ndarray
    hidden_grad_s: np.ndarray
    state: np.ndarray
    saved: np.ndarray
    transient: np.ndarray
    cross: np.ndarray
    cross_grad: np.ndarray
    region_piece: tuple[int, ...] = ()

    @property
    def layers(self) -> int:
        return len(self.micro_s) - 2

    def stage(self, a: int, b: int) -> list[int]:
        """The pieces of the stage running layers ``[a, b)``."""
        return ([0] if a == 0 else []) + list(range(a + 1, b + 1)) + ([self.layers + 1] if b == self.layers else [])


@dataclass
class PricedPlan:
    """One intra-stage plan, priced as pieces: ``policy`` its checkpointing, one of
    :data:`~autoparallel.pipeline_plan.CHECKPOINTING`."""

    policy: str
    plan: Plan
    pieces: Pieces


def priced_plan(plan: Plan, pieces: Pieces, checkpointing: str) -> PricedPlan:
    """``plan`` solved under ``checkpointing`` as a :class:`PricedPlan`: ``"off"`` when it recomputes nothing."""
    return PricedPlan("off" if plan.checkpoint is None else checkpointing, plan, pieces)


def mixable(a: PricedPlan, b: PricedPlan) -> bool:
    """Whether stages may run ``a`` and ``b`` side by side: the same strategies on every node
    (so activations cross every boundary in the same placements) and, where both checkpoint,
    the same chain stages (so their regions are ranges of one numbering)."""
    pa, pb = a.plan, b.plan
    if pa.nodes.keys() != pb.nodes.keys() or any(
            (x.input_specs, x.output_specs) != (pb.nodes[n].input_specs, pb.nodes[n].output_specs)
            for n, x in pa.nodes.items()):
        return False
    return pa.checkpoint is None or pb.checkpoint is None or pa.checkpoint.stages == pb.checkpoint.stages


@dataclass
class Candidate:
    """One priced pipeline: its record, the intra-stage plan and the peak over stages."""

    pipeline: PipelinePlan
    inner: Plan
    peak: int
    comm_s: float = 0.0
    recompute_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def _layer_of(path: str, layers: str) -> int | None:
    prefix = layers + "."
    if not path.startswith(prefix):
        return None
    head = path[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def piece_of_nodes(gm, layers: str, num_layers: int) -> dict:
    """fx node → piece (0 ``pre``, ``1..L`` layer ``i-1``, ``L+1`` ``post``): a node in a
    layer's module is that layer's; another op is ``pre`` before the first layer's first op,
    ``post`` after the last layer's last op, and the current layer's in between; a parameter,
    buffer or input belongs to the earliest piece that reads it (a tied embedding is stage 0's)."""
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    ops = [n for n in nodes if n.op == "call_function"]
    layer = {n: _layer_of(node_info(n).module_path, layers) if "autoparallel" in n.meta else None for n in ops}
    inside = [i for i, n in enumerate(ops) if layer[n] is not None]
    piece = {}
    if not inside:
        raise AutoParallelError(f"no op of the captured graph runs in the layers {layers}")
    first, last = inside[0], inside[-1]
    current = 1
    for i, n in enumerate(ops):
        if layer[n] is not None:
            current = layer[n] + 1
            piece[n] = current
        elif i < first:
            piece[n] = 0
        elif i > last:
            piece[n] = num_layers + 1
        else:
            piece[n] = current
    for n in reversed(nodes):  # parameters read through casts: resolve users first
        if n.op in ("get_attr", "placeholder") or n not in piece:
            users = [piece[u] for u in n.users if u in piece]
            own = _layer_of(node_info(n).module_path, layers) if "autoparallel" in n.meta else None
            piece[n] = own + 1 if own is not None and n.op == "get_attr" else (min(users) if users else 0)
    return piece


def aggregate(inner: Plan, traced, layers: str, num_layers: int, options: PlanOptions,
              memory: MemoryModel | None = None) -> Pieces:
    """The pieces of the intra-stage plan ``inner`` of ``traced`` (:class:`Pieces`): its nodes'
    seconds (``NodePlan.compute_s``, ``comm_s``; a parameter's are its optimizer update and
    gradient reduction, once per step), the exposed fraction of the gradient reduction and the
    DTensor overhead of the estimate spread over the pieces by their parameters, the checkpoint
    regions' recomputation, and the memory model's items under the plan's strategies (``memory``:
    the planner's model of ``traced`` on the plan's mesh, else built here)."""
    gm = traced.gm
    piece = piece_of_nodes(gm, layers, num_layers)
    P = num_layers + 2
    z = lambda: np.zeros(P)  # noqa: E731
    micro, comm, recompute, step, grad, params = z(), z(), z(), z(), z(), z()
    by_name = {n.name: n for n in gm.graph.nodes}
    node_compute = 0.0
    for name, np_ in inner.nodes.items():
        n = by_name.get(name)
        if n is None or np_.op == "getitem":
            continue
        k = piece[n]
        node_compute += np_.compute_s
        if n.op == "get_attr":
            step[k] += np_.compute_s
            grad[k] += np_.comm_s
            params[k] += 1 if np_.comm_s or np_.compute_s else 0
        else:
            micro[k] += np_.compute_s + np_.comm_s
            comm[k] += np_.comm_s
    for r in inner.redistributions:
        if r.dst == "output":
            micro[P - 1] += r.cost_s
            comm[P - 1] += r.cost_s
    est = inner.estimate
    share = params / params.sum() if params.sum() else np.full(P, 1 / P)
    step += max(0.0, est.compute_s - node_compute) * share  # DTensor overhead of the optimizer step
    exposed = est.exposed_grad_comm_s / est.grad_comm_s if est.grad_comm_s else 0.0
    step += exposed * grad
    # latency terms of the gradient reduction, not in any node: spread as the parameters
    step += max(0.0, est.exposed_grad_comm_s - exposed * grad.sum()) * share

    region_piece = []  # per top-level checkpoint region, the piece most of its nodes are in
    ck = inner.checkpoint
    if ck is not None:
        for reg, row in zip(ck.regions, ck.table):
            names = [nm for nm, st in ck.stages.items() if reg.start <= st < reg.stop]
            ks = [piece[by_name[nm]] for nm in names if nm in by_name]
            k = max(set(ks), key=ks.count) if ks else 0
            recompute[k] += row.recompute_s
            region_piece.append(k)
    micro += recompute

    state, saved, transient, cross, cross_grad = _memory(inner, traced, piece, P, options, region_piece, memory)
    return Pieces(micro, comm, recompute, step, (1 - exposed) * grad, state, saved, transient, cross, cross_grad,
                  tuple(region_piece))


def _choice(inner: Plan, gm) -> dict:
    """fx node → a :class:`Strategy` with the plan's specs (what the memory model sizes)."""
    out = {}
    for n in gm.graph.nodes:
        np_ = inner.nodes.get(n.name)
        if np_ is not None and np_.op != "getitem":
            out[n] = Strategy(tuple(np_.input_specs), tuple(np_.output_specs))
    return out


def _memory(inner: Plan, traced, piece, P: int, options: PlanOptions, region_piece, model: MemoryModel | None = None):
    """Per piece: state, saved and transient bytes, and per layer boundary the bytes crossing
    it (:class:`Pieces`). Under the plan's checkpoint regions, as the chain model of
    :func:`~autoparallel.solver.remat.build_chain` counts them: what an op of a region saves is
    recomputed, not kept; a region keeps its inputs (the forward values made before its first
    stage and read from it on; one read by several regions, such as an attention mask or the
    rotary tables, counted once, at the first) and, run selectively, the outputs of its matmuls and attention
    that do not leave it."""
    gm = traced.gm
    aliases = {n: (n.args[0], n.args[1]) for n in gm.graph.nodes
               if n.op == "call_function" and n.target is __import__("operator").getitem}
    shape = inner.mesh.shape
    if model is None:
        whole = written_back_outputs(gm, traced.buffer_mutations)
        model = MemoryModel(gm, aliases, shape, optimizer=options.optimizer,
                            optimizer_impl=options.optimizer_implementation(), device=options.device,
                            traced_on=traced.device, outputs=options.outputs, whole_outputs=whole,
                            cost_model=options.cost_model, inputs=options.inputs)
    choice = _choice(inner, gm)
    state, saved, dropped = np.zeros(P), np.zeros(P), np.zeros(P)
    live = np.zeros((P, model.steps + 1))
    ck = inner.checkpoint
    n_fwd = len(model.nodes)
    if ck is not None:
        stage_of = ck.stages
        region_of = np.full(max(stage_of.values(), default=0) + 2, -1)
        for i, reg in enumerate(ck.regions):
            region_of[reg.start:reg.stop] = i
        step_stage = np.array([stage_of.get(n.name, -1) for n in model.nodes] + [-1])
        kept = np.zeros(len(ck.regions))
        starts = np.array([reg.start for reg in ck.regions])
        selective = [reg.selective for reg in ck.regions]
    for it in model.items:
        if it.owner not in choice or (it.held_by is not None and it.held_by not in choice):
            continue
        b = it.bytes(choice)
        if not b:
            continue
        k = piece.get(it.owner, 0)
        if it.kind in STATE_KINDS:
            state[k] += b
        elif it.kind in SAVED_KINDS and it.end > it.start:
            st = step_stage[min(it.start, n_fwd)] if ck is not None else -1
            if st >= 0 and region_of[st] >= 0:  # saved in a region: recomputed in the backward, not kept
                dropped[k] += b
            else:
                saved[k] += b
        else:
            live[k, it.start] += b
            live[k, it.end + 1] -= b
            if ck is not None and it.forward_value and it.owner.name in stage_of:
                s0, s1 = stage_of[it.owner.name], step_stage[min(it.end, n_fwd - 1)]
                entered = np.flatnonzero((starts > s0) & (starts <= s1))
                if len(entered):  # an input of the regions starting after s0 up to s1: kept once, by the first
                    kept[entered[0]] += b  # (one tensor however many regions read it, as a value saved by several ops)
                elif region_of[s0] >= 0 and selective[region_of[s0]] and it.owner.target in SAVED_TARGETS:
                    kept[region_of[s0]] += b
    if ck is not None:
        for k, b in zip(region_piece, kept):
            saved[k] += b
    transient = np.cumsum(live, axis=1).max(axis=1) + dropped / np.maximum(1, _regions_per_piece(region_piece, P))
    # values produced in earlier pieces and read in later ones cross the boundaries between
    cross, cross_grad = np.zeros(P), np.zeros(P)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n not in choice or not node_info(n).outputs:
            continue
        users = [piece[u] for u in n.users if u in piece]
        for u in n.users:  # through getitem
            if u in aliases:
                users += [piece[w] for w in u.users if w in piece]
        far = max(users, default=piece[n])
        if far <= piece[n]:
            continue
        info = node_info(n)
        nbytes = sum(math.prod(local_shape(sh, sp, shape)) * dt.itemsize
                     for (sh, dt), sp in zip(info.outputs, choice[n].outputs))
        lo, hi = max(piece[n], 1), min(far - 1, P - 3)  # boundaries b with piece ≤ b < far, b in 1..L-1
        for b in range(lo, hi + 1):
            cross[b] += nbytes
            if info.requires_grad and info.dtype is not None and info.dtype.is_floating_point:
                cross_grad[b] += nbytes
    return state, saved, transient, cross, cross_grad


def _regions_per_piece(region_piece, P):
    c = np.zeros(P)
    for k in region_piece:
        c[k] += 1
    return c


def in_flight(schedule: str, pp: int, v: int, microbatches: int) -> list[float]:
    """Per device along the pipeline axis, the microbatches whose activations it holds at its
    peak, in units of its stages' activations of one microbatch (module docstring)."""
    M = microbatches
    if schedule in ("GPipe", "LoopedBFS"):
        return [float(M)] * pp
    if schedule == "1F1B":
        return [float(min(pp - r, M)) for r in range(pp)]
    return [min(M * v, (v - 1) * pp + 2 * (pp - 1 - r) + 1) / v for r in range(pp)]


def step_model(schedule: str, pp: int, v: int, microbatches: int, rank_s: list[float], p2p_s: float,
               update_s: list[float], core_share: float = 1.0) -> tuple[float, float]:
    """``(step seconds, bubble fraction)`` of a schedule (module docstring): ``rank_s`` per
    device the forward + backward of one microbatch over its stages, ``p2p_s`` one boundary's
    sends (forward and backward), ``update_s`` per device its once-per-step work.

    ``core_share`` (:attr:`~.costs.DevicePreset.core_share`): below 1, ranks share CPU cores
    and ``rank_s`` was priced at rates measured with every rank busy. The step is then
    ``M·v + p − 1`` slots of one chunk (``t / v``) each, slot ``k`` with
    ``n = min(k, p, M·v + p − k)`` of the ``p`` devices busy as the pipeline fills and drains;
    a device idle in a slot lends its core, so the busy ones run at
    ``min(1, core_share · p / n) / core_share`` times the calibrated speed. With a core each
    (``core_share`` 1) this is the formula above. (Four ranks on two cores, pp = 4, 4
    microbatches: 4.5 slots' time for 7, where measured steps took 0.63 of the calibrated
    estimate.)"""
    fill = (pp - 1) / v
    chunks = microbatches * v + pp - 1
    busy = (min(k, pp, chunks + 1 - k) for k in range(1, chunks + 1))
    slots = sum(core_share / min(1.0, core_share * pp / n) for n in busy)
    kept = ZERO_BUBBLE_IDLE if schedule in ZERO_BUBBLE else 1.0  # the share of the idle time left
    t = max(rank_s)
    step = (microbatches + kept * (slots / v - microbatches)) * t + (microbatches + fill) * v * p2p_s + max(update_s)
    return step, kept * fill / (microbatches + kept * fill)


class _Priced:
    """The pieces of one intra-stage plan with prefix sums, and the boundary search."""

    def __init__(self, pieces: Pieces, alpha: float, beta: float):
        self.p = pieces
        self.L = pieces.layers
        self.alpha, self.beta = alpha, beta
        # a stage's pieces are contiguous (pre, its layers, post): sums from prefix sums, the
        # largest transient from a table of range maxima; O(1) per stage in the DP
        self._cum: dict[int, np.ndarray] = {}
        t = np.asarray(pieces.transient, dtype=float)
        self._tmax = np.zeros((len(t), len(t)))
        for lo in range(len(t)):
            self._tmax[lo, lo:] = np.maximum.accumulate(t[lo:])
        self._state, self._saved = self._prefix(pieces.state), self._prefix(pieces.saved)

    def _span(self, a: int, b: int) -> tuple[int, int]:
        """The first and last piece of the stage running layers ``[a, b)`` (:meth:`Pieces.stage`)."""
        return (0 if a == 0 else a + 1), (self.L + 1 if b == self.L else b)

    def _prefix(self, arr) -> np.ndarray:
        c = self._cum.get(id(arr))
        if c is None:
            c = self._cum[id(arr)] = np.concatenate(([0.0], np.cumsum(np.asarray(arr, dtype=float))))
        return c

    def sum(self, arr, a, b) -> float:
        lo, hi = self._span(a, b)
        c = self._prefix(arr)
        return float(c[hi + 1] - c[lo])

    def p2p(self, b: int) -> float:
        if b <= 0 or b >= self.L:
            return 0.0
        c = self.p
        return (self.alpha + c.cross[b] * self.beta) + ((self.alpha + c.cross_grad[b] * self.beta)
                                                         if c.cross_grad[b] else 0.0)

    def stage_peak(self, a: int, b: int, flight: float) -> float:
        lo, hi = self._span(a, b)
        return float(self._state[hi + 1] - self._state[lo] + flight * (self._saved[hi + 1] - self._saved[lo])
                     + self._tmax[lo, hi])


def split(priced: list[_Priced], stages: int, fits: Callable[[int, int, int, int], bool]
          ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """The cut points of ``stages`` stages minimizing the slowest stage's per-microbatch
    seconds (its sends included), and per stage the priced plan it runs: of ``priced`` (one
    intra-stage plan's strategies under each checkpointing, fastest first), the first that fits
    (``fits(k, stage, a, b)``, ``k`` an index into ``priced``). ``None`` when no split fits. The DP of the module
    docstring, O(stages · L²) stage prices: choosing each stage's apart is exact, the
    slowest stage being a maximum over stages, and first-fit is the fastest fitting one
    because they differ only in recomputation, which adds seconds to every piece."""
    L, S = priced[0].L, stages
    if S > L:
        return None
    cost = {}

    def c(s, a, b):
        key = (s, a, b)
        if key not in cost:
            k = next((k for k in range(len(priced)) if fits(k, s, a, b)), None)
            cost[key] = (math.inf, -1) if k is None else (
                priced[k].sum(priced[k].p.micro_s, a, b) + max(priced[0].p2p(a), priced[0].p2p(b)), k)
        return cost[key][0]

    INF = math.inf
    f = [[INF] * (L + 1) for _ in range(S + 1)]
    arg = [[-1] * (L + 1) for _ in range(S + 1)]
    f[0][0] = 0.0
    for s in range(1, S + 1):
        lo, hi = s, L - (S - s)
        for j in range(lo, hi + 1):
            best, bi = INF, -1
            for i in range(s - 1, j):
                if f[s - 1][i] == INF:
                    continue
                val = max(f[s - 1][i], c(s - 1, i, j))
                if val == INF:
                    continue
                if val < best - 1e-15 or (abs(val - best) <= 1e-15 and abs(j - 2 * i) < abs(j - 2 * bi)):
                    best, bi = val, i
            f[s][j], arg[s][j] = best, bi
    if f[S][L] == INF:
        return None
    cuts, j = [L], L
    for s in range(S, 0, -1):
        j = arg[s][j]
        cuts.append(j)
    cuts = tuple(reversed(cuts))
    return cuts, tuple(cost[s, a, b][1] for s, (a, b) in enumerate(zip(cuts, cuts[1:])))


def price_schedule(priced: list[_Priced], pp: int, schedule: str, microbatches: int, budget: int | None,
                   boundaries: tuple[int, ...] | None = None, core_share: float = 1.0):
    """The pipeline of one schedule and microbatch count over ``priced`` (:func:`split`):
    its boundaries (searched, or given), each stage's priced plan, per-stage seconds and
    peaks, step and bubble (:func:`step_model`, with ``core_share``). ``None`` when no split
    fits ``budget`` (with the smallest peak reached, for the error)."""
    v = 2 if schedule in MULTI_STAGE else 1
    S = pp * v
    flight = in_flight(schedule, pp, v, microbatches)

    def peak(k, s, a, b):
        return priced[k].stage_peak(a, b, flight[s % pp])

    def fits(k, s, a, b):
        return budget is None or peak(k, s, a, b) <= budget

    def lowest(cuts):  # the smallest peak reachable with these cuts, for the error
        return max(min(peak(k, s, a, b) for k in range(len(priced))) for s, (a, b) in enumerate(zip(cuts, cuts[1:])))

    if boundaries is None:
        found = split(priced, S, fits)
        if found is None:
            even = even_boundaries(priced[0].L, S)
            return None, (lowest(even) if even else math.inf)
        boundaries, choice = found
    else:
        choice = tuple(next((k for k in range(len(priced)) if fits(k, s, a, b)), -1)
                       for s, (a, b) in enumerate(zip(boundaries, boundaries[1:])))
        if -1 in choice:  # given boundaries that do not fit
            return None, lowest(boundaries)
    spans = list(zip(boundaries, boundaries[1:]))
    if v > 1:  # a device holds all its stages' state, and its chunks in flight
        fitted = fit_ranks(priced, choice, spans, flight, budget)
        if fitted is None:  # a peak these cuts reach: every stage on one priced plan, the best
            return None, min(max(rank_peaks(priced, [k] * S, spans, flight)) for k in range(len(priced)))
        choice = fitted
    stage = [(priced[k], a, b) for k, (a, b) in zip(choice, spans)]
    stage_s = [p.sum(p.p.micro_s, a, b) for p, a, b in stage]
    peaks = [int(peak(k, s, a, b)) for s, (k, (a, b)) in enumerate(zip(choice, spans))]
    rank_s = [sum(stage_s[r::pp]) for r in range(pp)]
    zero_bubble = schedule in ZERO_BUBBLE  # the gradients reduced after the step, not hidden in the backward
    update = [sum(p.sum(p.p.step_s, a, b) + (p.sum(p.p.hidden_grad_s, a, b) if zero_bubble else 0.0)
                  for p, a, b in stage[r::pp]) for r in range(pp)]
    p2p = max((priced[0].p2p(b) for b in boundaries[1:-1]), default=0.0)
    step, bubble = step_model(schedule, pp, v, microbatches, rank_s, p2p, update, core_share)
    if v > 1:
        rank_peak = rank_peaks(priced, choice, spans, flight)
        peaks = [rank_peak[s % pp] for s in range(S)]
    slow = max(range(S), key=lambda s: stage_s[s])
    p, a, b = stage[slow]
    comm = microbatches * (p.sum(p.p.comm_s, a, b) + v * p2p)
    recompute = microbatches * p.sum(p.p.recompute_s, a, b) * v
    return (boundaries, choice, tuple(stage_s), tuple(peaks), p2p, bubble, step, comm, recompute), max(peaks)


def rank_peaks(priced: list[_Priced], choice, spans, flight: list[float]) -> list[int]:
    """Per device along the pipeline axis, its modelled peak (bytes) when it runs stages
    ``s, s + pp, ...`` (``spans[s]`` the layers ``[a, b)`` of stage ``s``, ``choice[s]`` its
    index into ``priced``): every stage's state and its chunks in flight (``flight[r]``
    microbatches of its activations), and the largest transient among them."""
    pp = len(flight)
    out = []
    for r in range(pp):
        mine = [(priced[k], a, b) for k, (a, b) in list(zip(choice, spans))[r::pp]]
        out.append(int(sum(p.sum(p.p.state, a, b) + flight[r] * p.sum(p.p.saved, a, b) for p, a, b in mine)
                       + max(p.p.transient[i] for p, a, b in mine for i in p.p.stage(a, b))))
    return out


def fit_ranks(priced: list[_Priced], choice, spans, flight: list[float], budget: int | None
              ) -> tuple[int, ...] | None:
    """``choice`` (per stage an index into ``priced``, each stage fitting ``budget`` alone:
    :func:`split`) made to fit ``budget`` on every device that runs several stages: while a
    device is over, one of its stages moves to a later priced plan (more recomputation), the
    move adding the fewest seconds per byte it saves (greedy, at most ``S · K`` moves), so a
    device may keep one stage unrecomputed and recompute another. ``None`` when no move is
    left and a device is still over."""
    pp, choice = len(flight), list(choice)
    while budget is not None:
        peaks = rank_peaks(priced, choice, spans, flight)
        over = [r for r in range(pp) if peaks[r] > budget]
        if not over:
            break
        r = over[0]
        best = None
        for s in range(r, len(spans), pp):
            a, b = spans[s]
            now = priced[choice[s]].sum(priced[choice[s]].p.micro_s, a, b)
            for k in range(choice[s] + 1, len(priced)):
                saved = peaks[r] - rank_peaks(priced, choice[:s] + [k] + choice[s + 1:], spans, flight)[r]
                if saved > 0:
                    ratio = (priced[k].sum(priced[k].p.micro_s, a, b) - now) / saved
                    if best is None or ratio < best[0]:
                        best = (ratio, s, k)
        if best is None:
            return None
        choice[best[1]] = best[2]
    return tuple(choice)


def even_boundaries(num_layers: int, stages: int) -> tuple[int, ...] | None:
    if stages > num_layers:
        return None
    return tuple(round(s * num_layers / stages) for s in range(stages + 1))


def _link(cost_model: CostModel, mesh: MeshSpec, axis: int) -> tuple[float, float]:
    """``(alpha, beta)`` of one link of the pipeline axis: a point-to-point send of ``B``
    bytes costs ``alpha + B · beta``. The axis' latency is a whole collective's (a ring
    all-reduce's line fitted by the profile, or the mesh's per-collective alpha); a ring
    all-reduce over ``n`` devices is ``2(n − 1)`` sends in sequence (Thakur et al., "Optimization
    of Collective Communication Operations in MPICH", IJHPCA 2005, §4), so one send pays
    ``alpha / (2(n − 1))`` (4 gloo processes: a 6.5 ms all-reduce latency against 0.3-0.5 ms
    measured for one send)."""
    try:
        alpha, beta = copy.copy(cost_model).bind(mesh)._link(axis)
    except ValueError:  # a profile of another shape
        alpha, beta = mesh.alpha[axis], mesh.beta[axis]
    n = mesh.shape[axis]
    return alpha / (2 * (n - 1)) if n > 1 else alpha, beta


def _microbatch_counts(pp: int, batch: int, options: PlanOptions) -> list[int]:
    if options.microbatches is not None:
        return [options.microbatches]
    return [pp * f for f in MICROBATCH_FACTORS if batch % (pp * f) == 0]


def _schedules(pp: int, num_layers: int, microbatches: int, options: PlanOptions) -> list[str]:
    if options.schedule is not None:
        return [options.schedule]
    out = ["1F1B", "GPipe"]
    if 2 * pp <= num_layers and microbatches % pp == 0:
        out.append("Interleaved1F1B")  # not InterleavedZeroBubble: run only when pinned (docs/design.md)
    return out


def finish(cand: Candidate, budget: int | None) -> Plan:
    """The intra-stage plan with the pipeline attached and its estimate the pipelined step."""
    plan, pl = cand.inner, cand.pipeline
    est = plan.estimate
    comm = cand.comm_s + est.exposed_grad_comm_s / pl.pp
    plan.estimate = replace(est, step_time_s=pl.step_s, comm_s=comm, recompute_s=cand.recompute_s,
                            compute_s=max(0.0, pl.step_s - comm - cand.recompute_s),
                            optimizer_s=est.optimizer_s / pl.pp, grad_comm_s=est.grad_comm_s / pl.pp,
                            exposed_grad_comm_s=est.exposed_grad_comm_s / pl.pp,
                            peak_memory_bytes=cand.peak, memory_budget_bytes=budget)
    plan.pipeline = pl
    return plan


def price_pipeline(plans: list[PricedPlan], mesh: MeshSpec, axis: int, options: PlanOptions, *, layers: str,
                   num_layers: int, microbatches: int, budget: int | None, schedules: list[str],
                   boundaries: tuple[int, ...] | None = None) -> tuple[Candidate | None, float]:
    """The fastest pipeline over ``schedules`` of an intra-stage plan for one of
    ``microbatches`` microbatches on the mesh less ``axis``, each stage running one of
    ``plans`` (the plan with different checkpointing, :func:`mixable`), its boundaries
    searched (or ``boundaries``), and the smallest peak seen (bytes)."""
    cost_model = options.cost_model or CostModel()
    plans = sorted(plans, key=lambda pr: float(pr.pieces.micro_s.sum()))
    link = _link(cost_model, mesh, axis)
    priced = [_Priced(pr.pieces, *link) for pr in plans]
    pp = mesh.shape[axis]
    best, low = None, math.inf
    for schedule in schedules:
        v = 2 if schedule in MULTI_STAGE else 1
        if pp * v > num_layers:
            continue
        found, peak = price_schedule(priced, pp, schedule, microbatches, budget, boundaries,
                                     cost_model.device.core_share)
        low = min(low, peak)
        if found is None:
            continue
        bnd, choice, stage_s, peaks, p2p, bubble, step, comm, recompute = found
        if best is not None and step >= best.pipeline.step_s:
            continue
        pl = PipelinePlan(mesh, axis, layers, tuple(int(b) for b in bnd), microbatches, schedule,
                          tuple(float(x) for x in stage_s), tuple(int(x) for x in peaks), float(p2p), float(bubble),
                          float(step), tuple(plans[k].policy for k in choice))
        best = Candidate(pl, _stage_plan(plans, choice, pl), max(peaks), comm, recompute)
    return best, low


def _stage_plan(plans: list[PricedPlan], choice: tuple[int, ...], pl: PipelinePlan) -> Plan:
    """The intra-stage plan of a pipeline whose stage ``s`` runs ``plans[choice[s]]``: that
    plan when every stage runs the same, else a copy of the first with each one's
    checkpoint regions that fall in its stages (each region in the stage of the
    piece it is counted in, :attr:`Pieces.region_piece`)."""
    if len(set(choice)) == 1:
        return plans[choice[0]].plan
    regions = []
    for k, pr in enumerate(plans):
        ck = pr.plan.checkpoint
        if ck is None:
            continue
        for reg, row, piece in zip(ck.regions, ck.table, pr.pieces.region_piece):
            layer = min(max(piece - 1, 0), pl.boundaries[-1] - 1)  # pre: the first layer's stage, post: the last's
            if choice[pl.stage_of_layer(layer)] == k:
                regions.append((reg, row, ck.stages))
    plan = copy.copy(plans[0].plan)
    plan.checkpoint = None
    if regions:
        regions.sort(key=lambda r: r[0].start)
        plan.checkpoint = CheckpointPlan(dict(regions[0][2]), tuple(r[0] for r in regions), [r[1] for r in regions],
                                         sum(r[1].recompute_s for r in regions))
    return plan


def plan_stages(capture_at: Callable[[int], object], mesh: MeshSpec, options: PlanOptions, *, layers: str,
                num_layers: int, batch: int) -> Plan:
    """The pipelined plan of a model whose repeated layers are the ``num_layers`` layers of the
    ``ModuleList`` at ``layers`` (module docstring): the fastest fitting candidate over the
    pipeline axis, the microbatches, the schedule and the boundaries; under ``pipeline="auto"``
    it may be the plan without pipeline stages (``plan.pipeline is None``).

    Args:
        capture_at: microbatches ``m`` → the model captured for one microbatch (the global
            batch's dim 0 divided by ``m``).
        batch: the global batch's dim 0.

    Raises:
        AutoParallelError: no axis named ``"pp"`` without ``pipeline="auto"``, more stages than
            layers, or a batch the microbatches do not divide.
        InfeasiblePlanError: no candidate fits the memory budget (naming the smallest peak).
    """
    t0 = time.perf_counter()
    cost_model = options.cost_model or CostModel()
    budget = resolve_budget(options.memory_budget, lambda: preset_capacity(cost_model.device))
    pinned = pipeline_axis(mesh, options)
    if pinned is not None:
        axes = [pinned]
    elif options.pipeline == "auto":
        axes = [a for a, n in enumerate(mesh.shape) if n >= 2 and n <= num_layers]
    else:
        raise AutoParallelError("pipeline stages need a mesh axis named 'pp' or pipeline='auto'")
    if pinned is not None:
        v = 2 if options.schedule in MULTI_STAGE else 1
        if v * mesh.shape[pinned] > num_layers:
            how = f" ({v} per device under {options.schedule})" if v > 1 else ""
            raise AutoParallelError(f"{v * mesh.shape[pinned]} pipeline stages{how} need as many layers, but "
                                    f"{layers} has {num_layers}: choose a schedule of one stage per device "
                                    "(1F1B, GPipe) or a shorter pipeline axis")
    if options.microbatches is not None and batch % options.microbatches:
        raise AutoParallelError(f"the batch of {batch} does not split into {options.microbatches} microbatches")
    inner_options = replace(options, pipeline="off", baselines=False, microbatches=None, schedule=None, zero=False)
    candidates: list[tuple[float, Plan]] = []
    lowest = math.inf
    if pinned is None:  # no pipeline: the whole mesh plans the whole batch
        try:
            flat = plan_traced(capture_at(1), mesh, inner_options)
            candidates.append((flat.estimate.step_time_s, flat))
        except InfeasiblePlanError as e:
            log.info("without pipeline stages: %s", e)
    for axis in axes:
        pp = mesh.shape[axis]
        sub = submesh(mesh, axis)
        stage_options = _on_submesh(inner_options, axis)
        best_axis = None
        for micro in sorted(_microbatch_counts(pp, batch, options), reverse=True):
            if micro < pp:
                raise AutoParallelError(f"{micro} microbatches are fewer than the {pp} pipeline devices")
            bound = min((c[0] for c in candidates), default=math.inf)
            traced = capture_at(micro)
            cand, low = _search_at(traced, mesh, sub, axis, options, stage_options, budget, layers, num_layers,
                                   micro, bound=bound)
            lowest = min(lowest, low)
            if cand is None:
                log.info("pipeline over %s (%d), %d microbatches: none kept; fewer microbatches are not tried",
                         mesh.axis_names[axis], pp, micro)
                break  # fewer microbatches hold as many activations or more in flight: none fits either
            log.info("pipeline over %s (%d), %d microbatches: %s, step %s", mesh.axis_names[axis], pp, micro,
                     cand.pipeline.schedule, units.seconds(cand.pipeline.step_s))
            candidates.append((cand.pipeline.step_s, finish(cand, budget)))
            if best_axis is not None and cand.pipeline.step_s >= best_axis.pipeline.step_s:
                break  # fewer microbatches stopped paying: the bubble grows faster than the per-microbatch work shrinks
            best_axis = cand
    if not candidates:
        raise InfeasiblePlanError(f"no pipeline fits the {units.nbytes(budget)} budget per device: the smallest "
                                  f"stage peak reached is {units.nbytes(lowest)}")
    step, plan = min(candidates, key=lambda c: c[0])
    plan.solver_stats.stage_s["stages"] = time.perf_counter() - t0
    return plan


def replan_stages(traced, plan: Plan, options: PlanOptions) -> Plan:
    """The plan of another capture ``traced`` of a pipelined model (in another mode, or with
    other module attributes; one microbatch's, its ties untied as the plan's) that runs
    ``plan``'s pipeline: the same axis, stages, schedule and microbatches, every parameter and
    buffer pinned where ``plan`` holds it on the stage submesh, solved on that submesh as
    :func:`plan_stages` solves a stage's plan, without recomputation or a memory budget (an
    evaluation keeps no activations for a backward).

    Raises:
        AutoParallelError: ``traced`` reads a parameter or buffer ``plan`` has no placement
            for; InfeasiblePlanError, ShardingRuleError as :func:`plan_stages`.
    """
    pl = plan.pipeline
    inner_options = replace(options, pipeline="off", baselines=False, microbatches=None, schedule=None, zero=False,
                            memory_budget="unlimited", checkpointing="off")
    inner = plan_traced(traced, submesh(pl.mesh, pl.axis), _on_submesh(inner_options, pl.axis),
                        pinned=dict(plan.param_placements))
    inner.pipeline = replace(pl, checkpointing=("off",) * pl.stages)
    return inner


def _on_submesh(options: PlanOptions, axis: int) -> PlanOptions:
    """``options`` for a stage's solve on the mesh less ``axis``: a cost model profiled on the
    whole mesh priced by its profile of the submesh (:meth:`~.costs.CostModel.submesh`)."""
    if options.cost_model is None or options.cost_model.profile is None:
        return options
    return replace(options, cost_model=options.cost_model.submesh(axis))


LAYER_CHECKPOINTING = ("selective", "full")
"""The per-layer activation checkpointing a stage's plan may take (:func:`_search_at`): each
layer run selectively (its matmul and attention outputs kept), or each layer keeping only its
input (torchtitan's selective and full activation checkpointing)."""


def _search_at(traced, mesh, sub, axis, options, inner_options, budget, layers, num_layers, micro, *,
               schedules=None, boundaries=None, bound=math.inf):
    """The best pipeline at ``micro`` microbatches over ``axis`` and the smallest stage peak
    seen. All solves share one :func:`~autoparallel.solver.pipeline.prepare` (strategies,
    memory model, built problem) and the ILP's fastest plan:

    1. the intra-stage plan without a budget (the fastest strategies), its split searched under
       the budget;
    2. under ``checkpointing="auto"``, the same strategies with every layer checkpointed
       (:data:`LAYER_CHECKPOINTING`, each a solve without a budget and a split search), unless
       step 1's split is already its fastest split without a memory limit (``free``): the same
       strategies plus recomputation take no less per microbatch in any piece, so no split of
       theirs beats ``free`` (exact). They let a split that memory unbalanced in step 1 even
       out, or fit where step 1 does not. Where the solves kept step 1's strategies
       (:func:`mixable`), a split whose every stage picks its own checkpointing among the three
       is searched too (:func:`split`): under 1F1B the first stage holds ``pp`` microbatches in
       flight and the last one, so the last may run without recomputation where the first needs it;
    3. only when neither fits, the plan solved again under the budget that leaves a stage its
       share, ``budget + state · (pp − 1) / pp`` (the whole model's parameters, gradients and
       optimizer states, of which a stage holds ``1/pp``), once. The memory search sizes its
       recomputation for one pass of one microbatch (Rotor's nested schedule), which a stage
       holding several microbatches in flight does not follow: hence step 2 first.

    Steps 2 and 3 are skipped when ``free`` is no faster than ``bound`` (the best candidate so
    far): a budget or recomputation only adds sharding or seconds to the fastest plan, so no
    plan of theirs is taken to be faster (exact for step 2; for step 3 but for the ILP pricing
    one microbatch's work and the step's once)."""
    pp = mesh.shape[axis]
    schedules = schedules or _schedules(pp, num_layers, micro, options)
    prepared = prepare(traced, sub, inner_options)
    low = math.inf

    def solve(inner_budget, checkpointing, per_layer=False):
        prepared.planner.checkpoint_per_layer = per_layer
        try:
            inner = plan_traced(traced, sub, replace(inner_options, memory_budget=inner_budget,
                                                     checkpointing=checkpointing), prepared=prepared)
        except InfeasiblePlanError as e:
            log.info("intra-stage plan at %d microbatches: %s", micro, e)
            return None, None
        finally:
            prepared.planner.checkpoint_per_layer = False
        pr = priced_plan(inner, aggregate(inner, traced, layers, num_layers, options, memory=prepared.planner.memory),
                         checkpointing)
        return price(pr, budget=budget), pr

    def price(*plans, budget):
        nonlocal low
        cand, peak = price_pipeline(list(plans), mesh, axis, options, budget=budget, layers=layers,
                                    num_layers=num_layers, microbatches=micro, schedules=schedules,
                                    boundaries=boundaries)
        low = min(low, peak)
        return cand

    cand, fastest = solve("unlimited", inner_options.checkpointing)
    if fastest is None or budget is None:
        return cand, low
    free = price(fastest, budget=None)
    target = min(bound, cand.pipeline.step_s if cand is not None else math.inf)
    if free is None or free.pipeline.step_s >= target * (1 - 1e-9):
        if cand is None:
            log.info("%d microbatches: no split fits, and without a memory limit the step would be %s, no "
                     "faster than %s: neither checkpointed nor solved again under the budget", micro,
                     units.seconds(free.pipeline.step_s) if free else "-", units.seconds(bound))
        return cand, low
    if inner_options.checkpointing == "auto":
        alts, mixed = [], [fastest]
        for policy in LAYER_CHECKPOINTING:
            alt, pr = solve("unlimited", policy, per_layer=True)
            alts.append(alt)
            if pr is not None and mixable(fastest, pr):
                mixed.append(pr)
        if len(mixed) > 1:  # first: of equal steps, the one recomputing only where a stage needs it
            alts.insert(0, price(*mixed, budget=budget))
        for alt in alts:
            if alt is not None and (cand is None or alt.pipeline.step_s < cand.pipeline.step_s):
                cand = alt
    if cand is not None:
        return cand, low
    alt, _ = solve(int(budget + float(fastest.pieces.state.sum()) * (pp - 1) / pp), inner_options.checkpointing)
    return alt, low


RECIPE = "PP × FSDP × TP"


def recipe_row(capture_at: Callable[[int], object], mesh: MeshSpec, options: PlanOptions, *, layers: str,
               num_layers: int, batch: int, plan: Plan | None = None):
    """The hand-written 3-D recipe (torchtitan's layout) as a :class:`~autoparallel.recipes.Row`:
    the pipeline axis of ``plan`` (else the one named ``"pp"``, else the first axis), an even
    split of the layers, 1F1B, ``plan``'s microbatches (else the most the search tries, ``8 · pp``
    where the batch allows: torchtitan's one sequence per microbatch), and within a stage the
    FSDP + TP recipe of :func:`autoparallel.recipes.recipes` on the submesh (Megatron TP where
    the submesh has one axis), priced by the same step and memory model as the search. As
    torchtitan, no activation checkpointing when every stage fits without it, else full
    per-layer checkpointing (``checkpointing="full"`` with one region per layer,
    :attr:`~autoparallel.solver.planner.Planner.checkpoint_per_layer`: each layer keeps its
    input and recomputes its forward in the backward); the row says which. Its plan's
    ``solver_stats.stage_s["recipe"]`` holds the seconds it took (the capture is the search's)."""
    from ..recipes import Row, recipes

    pl = plan.pipeline if plan is not None else None
    axis = pl.axis if pl is not None else pipeline_axis(mesh, options)
    axis = 0 if axis is None else axis
    pp = mesh.shape[axis]
    # without the plan's: torchtitan's default of one sequence per microbatch, as far as the search's counts go
    micro = pl.microbatches if pl is not None else (options.microbatches or max(_microbatch_counts(pp, batch, options),
                                                                                default=pp))
    name = f"{RECIPE} (1F1B, even split over {mesh.axis_names[axis]}, {micro} microbatches)"
    if pp < 2 or pp > num_layers or batch % micro or micro < pp:
        return Row(name, None, f"{pp} stages over {num_layers} layers with {micro} microbatches of a batch of "
                               f"{batch} cannot be written")
    cost_model = options.cost_model or CostModel()
    budget = resolve_budget(options.memory_budget, lambda: preset_capacity(cost_model.device))
    sub = submesh(mesh, axis)
    traced = capture_at(micro)
    listed = {r.name: r for r in recipes(traced, sub)}
    inner_recipe = listed.get("FSDP + TP")
    if inner_recipe is None or inner_recipe.constraints is None:
        inner_recipe = next((r for r in listed.values() if r.name.startswith("Megatron TP")), inner_recipe)
    if inner_recipe is None or inner_recipe.constraints is None:
        return Row(name, None, inner_recipe.reason if inner_recipe else "no FSDP + TP recipe for the stage")
    t0 = time.perf_counter()
    inner_options = _on_submesh(replace(options, pipeline="off", baselines=False, microbatches=None, schedule=None, zero=False,
                                        constraints=inner_recipe.constraints, memory_budget="unlimited"), axis)
    even = even_boundaries(num_layers, pp)
    low = math.inf
    try:
        prepared = prepare(traced, sub, inner_options)
        for ck in ("off", "full"):  # torchtitan: no activation checkpointing when it fits, else every block's
            prepared.planner.checkpoint_per_layer = ck == "full"
            inner = plan_traced(traced, sub, replace(inner_options, checkpointing=ck), prepared=prepared)
            pieces = aggregate(inner, traced, layers, num_layers, options, memory=prepared.planner.memory)
            cand, peak = price_pipeline([priced_plan(inner, pieces, ck)], mesh, axis, options, layers=layers,
                                        num_layers=num_layers, microbatches=micro, budget=budget, schedules=["1F1B"],
                                        boundaries=even)
            low = min(low, peak)
            if cand is not None:
                break
    except AutoParallelError as e:
        return Row(name, None, f"{type(e).__name__}: {e}")
    if cand is None:
        return Row(name, None, f"no stage fits the {units.nbytes(budget)} budget, even with full activation "
                               f"checkpointing (smallest peak {units.nbytes(low)})")
    plan = finish(cand, budget)
    plan.solver_stats.stage_s["recipe"] = time.perf_counter() - t0
    ac = "full activation checkpointing" if ck == "full" else "no activation checkpointing"
    return Row(name, plan, notes=[f"{inner_recipe.name} within a stage, {ac}"])

