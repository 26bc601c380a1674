"""Stage 2 of the memory search: which activations to recompute, on the sharded graph.

The plan chosen by the sharding ILP (stage 1) is linearized into a chain of stages: the
nodes before the first of the model's repeated layers, the parts of each layer, and the
nodes after the last one. Each stage gets, under the plan's shardings and with its
collectives: forward and backward seconds (cost model), the bytes of its input (values
crossing into it from earlier stages), the bytes it saves for backward (memory model),
and its transient bytes. Rotor's dynamic program (Beaumont et al., "Optimal checkpointing
for heterogeneous chains: how to train deep neural networks with limited memory", arXiv
1911.13214, §4; :mod:`autoparallel.solver.rotor`) then picks the fastest schedule whose
activations fit what the budget leaves after parameters, gradients, optimizer states and
inputs. Its regions become nested non-reentrant ``torch.utils.checkpoint`` calls in the
emitted module (:mod:`autoparallel.passes.checkpoint`).
"""

from __future__ import annotations

import numpy as np
import torch.fx as fx

from ..graph import layers_of
from ..plan import CheckpointPlan, CheckpointSchedule, Plan, Region, RegionSummary
from ..runtime_kernels.recompute import SAVED_TARGETS
from ..strategies import Strategy
from ..tracer.annotate import node_info
from .memory import MemoryModel
from .rotor import Chain, Schedule, checkpoint_every_stage


MAX_SUB_BLOCK_STAGES = 160
"""Longest chain split by sub-layer; a longer one gets one stage per layer instead. Rotor's DP
is cubic in the stages: Llama-3-70B (80 layers, 4 children each: 322 stages) spent about
11 minutes in stage 2 under load (2 cores), one stage per layer (82 stages) about 1/60 of
that by the cube law."""


def chain_stages(nodes: list[fx.Node], per_layer: bool = False) -> dict[fx.Node, int]:
    """Stage of every op node, numbered in graph order: stage 0 before the first layer of
    the longest list of repeated layers (:func:`~autoparallel.graph.layers_of`); then,
    within each layer, one stage per run of ops in the same direct child module (e.g.
    ``ln_1``, ``attn``, ``ln_2``, ``mlp``; ops of the layer itself, such as residual adds,
    join the run before them), so that recomputation can be chosen per sub-layer (one level
    deeper, e.g. ``mlp.act``, measured worse on GPT-2: 24.4 % vs 22.3 % recompute at a 50 %
    budget, more rounding over 60 stages), those a value crosses into together then joined
    (:func:`_joined`); a last stage after the last layer. Empty when the model has fewer than
    two repeated layers or they do not run in order. With ``per_layer``, or when that makes
    more than :data:`MAX_SUB_BLOCK_STAGES` stages, one stage per layer."""
    ops = [n for n in nodes if n.op == "call_function"]
    lists = layers_of(ops)
    if not lists:
        return {}
    name, layers = max(lists.items(), key=lambda kv: len(kv[1]))
    if len(layers) < 2:
        return {}
    index = {n: i for i, members in layers.items() for n in members}
    last = max(i for i, n in enumerate(ops) if n in index)
    stages: dict[fx.Node, int] = {}
    layer_of: dict[int, int] = {}  # stage -> its layer (none for the stages before and after the layers)
    current, layer, child = 0, None, None
    for i, n in enumerate(ops):
        if i > last:
            if child != "<after>":
                current, child = current + 1, "<after>"
        elif n in index:
            if layer is not None and index[n] < layer:
                return {}  # layers interleave: no chain
            prefix = f"{name}.{index[n]}."
            path = node_info(n).module_path
            sub = path[len(prefix):].split(".")[0] if path.startswith(prefix) and not per_layer else None
            if index[n] != layer or (sub is not None and sub != child):
                current += 1
                layer, child = index[n], sub
            layer_of[current] = layer
        stages[n] = current
    stages = _joined(stages, layer_of)
    if max(stages.values()) + 1 > MAX_SUB_BLOCK_STAGES and not per_layer:
        return chain_stages(nodes, per_layer=True)
    return stages


def _joined(stages: dict[fx.Node, int], layer_of: dict[int, int]) -> dict[fx.Node, int]:
    """``stages`` renumbered with the stages of one layer that a value crosses into together
    (produced before them, read in the last) joined into one: the residual stream read by a
    layer's norm and again by its residual add. Rotor's chain has one input per stage
    boundary, so a value crossing two kept boundaries was counted at each, though held once:
    GPT-2's and Llama's checkpointed rows of ``benchmarks/memory.py --processes`` were modelled
    15 to 20 % over, a ViT's (whose residual crosses three) 37 to 40 %. Values that cross into
    several layers (rotary tables, masks made before the first layer) join nothing."""
    joins: set[int] = set()  # stages that join the one before
    for n, a in stages.items():
        last = max((stages[u] for u in n.users if u in stages), default=a)
        crossed = range(a + 1, last + 1)
        if len(crossed) > 1 and a + 1 in layer_of and {layer_of.get(k) for k in crossed} == {layer_of[a + 1]}:
            joins.update(crossed[1:])
    number, current = {}, -1
    for k in sorted(set(stages.values())):
        current += k not in joins
        number[k] = current
    return {n: number[k] for n, k in stages.items()}


def build_chain(memory: MemoryModel, choice: dict[fx.Node, Strategy], plan: Plan, forward_s: dict[str, float],
                stages: dict[fx.Node, int]) -> tuple[Chain, int]:
    """The chain of ``stages`` under ``choice`` and the bytes outside it.

    Args:
        memory: the step's memory model.
        choice: node → chosen strategy.
        plan: the plan of ``choice`` (per-node seconds).
        forward_s: node name → forward compute seconds.
        stages: node → stage (:func:`chain_stages`).

    Returns:
        ``(chain, fixed)``: per stage forward/backward seconds and input, saved and
        transient bytes (in the backward, the most it holds at once beyond what the stage
        saved, which it frees as it goes: a saved tensor once its saver's backward has run),
        and the parameter gradients each stage's backward allocates (those
        of a parameter belong to the stage of its last use); for a selective run, the
        outputs of the stage's ops in
        :data:`~autoparallel.runtime_kernels.recompute.SAVED_TARGETS` that do not leave it
        (bytes) and the forward seconds of its other ops and of every collective;
        ``fixed``: bytes live throughout (parameters, optimizer states, inputs, values of
        nodes outside the chain, values read by several later stages: a mask made before the
        layers, counted once instead of at each stage it crosses into).
    """
    n_st = max(stages.values()) + 1
    step_stage = np.array([stages.get(n, -1) for n in memory.nodes])
    fwd, bwd, sel_time = np.zeros(n_st), np.zeros(n_st), np.zeros(n_st)
    for n, st in stages.items():
        np_ = plan.nodes.get(n.name)
        if np_ is None:
            continue
        f = forward_s.get(n.name, 0.0) + np_.comm_s / 2
        fwd[st] += f
        bwd[st] += np_.compute_s + np_.comm_s - f
        sel_time[st] += np_.comm_s / 2 if n.target in SAVED_TARGETS else f  # collectives are recomputed
    x = np.zeros(n_st + 1)
    saved, sel = np.zeros(n_st), np.zeros(n_st)
    grad = np.zeros(n_st)
    fixed = 0
    n_fwd = len(memory.nodes)
    transient: list[list[tuple[int, int, int]]] = [[] for _ in range(2 * n_st)]  # fwd / bwd of each stage
    saved_until: list[list[tuple[int, int]]] = [[] for _ in range(n_st)]  # (its saver's backward step, bytes)
    for it in memory.items:
        b = it.bytes(choice)
        if it.kind == "activations" or (it.kind == "gathered" and it.start < it.end):  # saved for the backward
            st = step_stage[it.start]
            if st < 0:
                fixed += b
            elif it.value is None or stages.get(it.value, st) >= st:  # a stage's input is in x already
                saved[st] += b
                saved_until[st].append((it.end, b))
        elif it.kind == "gradients":  # allocated at the backward of the parameter's last use
            st = step_stage[2 * n_fwd - 1 - it.start]
            if st < 0:
                fixed += b
            else:
                grad[st] += b
        elif it.kind == "buffers":  # one backward step: where the parameter's first user's backward runs
            st = step_stage[2 * n_fwd - 1 - it.start]
            if st < 0:
                fixed += b
            else:
                transient[2 * st + 1].append((it.start, it.end, b))
        elif it.kind == "temporaries" and it.owner.op == "get_attr":  # the optimizer step's, after the backward:
            grad[0] += b  # held from the last stage's backward on, as its gradients
        elif it.kind not in ("temporaries", "gathered") or it.owner not in stages:
            fixed += b
        elif it.forward_value:
            s0, s1 = stages[it.owner], step_stage[min(it.end, n_fwd - 1)]
            if s1 > s0 + 1:  # read by several later stages (a mask): held once, from before to after them
                fixed += b
            elif s1 > s0:
                x[s1] += b
            else:
                transient[2 * s0].append((it.start, it.end, b))
                if it.owner.target in SAVED_TARGETS:  # a selective run keeps it
                    sel[s0] += b
        else:
            transient[2 * stages[it.owner] + 1].append((it.start, it.end, b))
    first_bwd = np.full(n_st, 2 * n_fwd)
    for i, st in enumerate(step_stage):
        if st >= 0:
            first_bwd[st] = min(first_bwd[st], 2 * n_fwd - 1 - i)
    for st in range(n_st):  # a saved tensor is freed once its saver's backward has run
        transient[2 * st + 1] += [(first_bwd[st], e, b) for e, b in saved_until[st]]
    peaks = _most_live(transient, 2 * n_fwd + 2)
    chain = Chain(fwd_time=fwd, bwd_time=bwd, x=x, xbar=x[:n_st] + saved,
                  fwd_tmp=peaks[0::2], bwd_tmp=peaks[1::2] - saved, grad=grad, sel=sel, sel_time=sel_time)
    return chain, int(fixed)


def _most_live(spans: list[list[tuple[int, int, int]]], steps: int) -> np.ndarray:
    """Per list of ``(first step, last step, bytes)`` tensors, the most bytes live at one step
    of ``range(steps)``."""
    peaks = np.zeros(len(spans))
    for k, items in enumerate(spans):
        if items:
            events = np.zeros(steps)
            for a, e, b in items:
                events[a] += b
                events[e + 1] -= b
            peaks[k] = np.cumsum(events).max()
    return peaks


def _span_modules(stages: dict[fx.Node, int], r: Region) -> str:
    """First and last module paths of the ops of region ``r``."""
    paths = [node_info(n).module_path for n, s in stages.items() if r.start <= s < r.stop]
    return paths[0] if paths[0] == paths[-1] else f"{paths[0]} … {paths[-1]}"


def checkpoint_plan(chain: Chain, schedule: Schedule, stages: dict[fx.Node, int]) -> CheckpointPlan:
    """``Plan.checkpoint`` for ``schedule``: node stages, region tree, per-region table, and
    for comparison the schedule checkpointing every stage (regions, recompute seconds,
    modelled activation peak)."""
    count = np.bincount(list(stages.values()), minlength=len(chain.fwd_time))
    table = []
    for r in schedule.regions:
        span = slice(r.start, r.stop)
        if r.selective:
            row = (max(0, int(chain.xbar[r.start] - chain.x[r.start] - chain.sel[r.start])), float(chain.sel_time[r.start]))
        else:
            row = (int(chain.xbar[span].sum() - chain.x[r.start]), float(chain.fwd_time[span].sum()))
        table.append(RegionSummary(f"{r.start}-{r.stop - 1}", _span_modules(stages, r), int(count[span].sum()), *row,
                                   "selective" if r.selective else "full"))
    every = checkpoint_every_stage(chain)
    return CheckpointPlan({n.name: int(s) for n, s in stages.items()}, tuple(schedule.regions), table,
                          float(schedule.recompute_time), float(schedule.peak_bytes),
                          CheckpointSchedule(tuple(every.regions), float(every.recompute_time),
                                             float(every.peak_bytes)))
