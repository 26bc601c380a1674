"""Optimizer states and gradients sharded over the axes that replicate a parameter: ZeRO stages 1, 2.

A trainable parameter that a strategy replicates along some mesh axes (data parallelism's
layout there) may keep the whole parameter on every device of those axes for compute while its
optimizer steps only a shard of it: the module's ``nn.Parameter`` is that shard (a DTensor
split along one dim over those axes), so ``torch.optim`` creates and updates states of the
shard's size; the gradient is all-reduced whole in the gradient buckets, as for any replicated
parameter, and each device keeps its shard's piece of it; after the optimizer step the updated
shards are all-gathered into the whole copy the forward reads, once per step, before the next
forward. This is ZeRO's stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward
Training Trillion Parameter Models", SC 2020, §5.1: optimizer-state partitioning, an all-gather
of the updated parameters after the step), and what ``torch.distributed.optim.
ZeroRedundancyOptimizer`` does beside DDP, chosen per parameter and over the axes the planner
picks. It saves ``(1 − 1/n)`` of the optimizer states and of the step's time for one all-gather
of the parameter per step. Stage 2 (§5.2, ``Strategy.zero_grad``) also reduce-scatters the
gradient onto the shard instead of all-reducing it whole: half the bytes of a ring all-reduce
and a shard's gradient held instead of the whole one.

Which axes: all those of more than one device that the strategy replicates the parameter
along, when they are one process group (a single axis, or several spanning the world), else
each alone (:func:`zero_axes`). Which dim: the first that no axis splits in the strategy and that the
axes' device count divides (:func:`zero_dim`), so the shard is a plain ``torch.chunk`` piece of
the device's local tensor and its DTensor placements say the same. A parameter with no such
dim is not offered ZeRO.
"""

from __future__ import annotations

import dataclasses
import math

import torch.fx as fx

from ..placement import R, Shard, Spec
from ..tracer.annotate import node_info
from .engine import Strategy


def _replicating_axes(spec: Spec, mesh_shape) -> list[int]:
    return [a for a, (p, n) in enumerate(zip(spec, mesh_shape)) if p == R and n > 1]


def zero_axes(spec: Spec, mesh_shape) -> list[tuple[int, ...]]:
    """The sets of mesh axes a parameter held in ``spec`` may shard its optimizer states over:
    every axis of more than one device that replicates it, when they are one process group (a
    single axis, or several spanning the mesh: the world's); else each of them alone. Fewer
    sets than every subset, to keep the ILP small: the memory search's solves over the twins
    are what a budgeted plan spends its time on (a 2-layer GPT-2 on (2, 2): 24 s without
    twins, 53 s with stage-1 twins, 81 s with both stages, with or without the single-axis
    sets)."""
    axes = _replicating_axes(spec, mesh_shape)
    if len(axes) == 1 or (axes and math.prod(mesh_shape[a] for a in axes) == math.prod(mesh_shape)):
        return [tuple(axes)]
    return [(a,) for a in axes]


def zero_dim(shape, spec: Spec, mesh_shape, axes: tuple[int, ...]) -> int | None:
    """The dim the optimizer's shard of a parameter of ``shape`` held in ``spec`` is cut along
    over ``axes``: the first dim ``spec`` does not split whose size the axes' device count
    divides; ``None`` when there is none."""
    pieces = math.prod(mesh_shape[a] for a in axes)
    split = {p.dim for p in spec if isinstance(p, Shard)}
    return next((d for d, size in enumerate(shape) if d not in split and size % pieces == 0), None)


def state_spec(spec: Spec, axes: tuple[int, ...], dim: int) -> Spec:
    """The spec of the shard the optimizer steps: ``spec`` with ``Shard(dim)`` on ``axes``."""
    return tuple(Shard(dim) if a in axes else p for a, p in enumerate(spec))


def state_spec_of(node: fx.Node, s: Strategy, mesh_shape) -> Spec:
    """The spec the optimizer holds parameter ``node`` in under ``s``: :func:`state_spec` for a
    ZeRO strategy (``s.zero``), else the parameter's own."""
    if not s.zero:
        return s.outputs[0]
    return state_spec(s.outputs[0], s.zero, zero_dim(node_info(node).outputs[0][0], s.outputs[0], mesh_shape, s.zero))


def with_zero(strategies: dict[fx.Node, list[Strategy]], mesh_shape) -> dict[fx.Node, list[Strategy]]:
    """``strategies`` with, for every trainable parameter, ZeRO twins of each of its strategies
    per set of :func:`zero_axes` that has a :func:`zero_dim` (after them, so that indices of the
    others are kept): stage 1, and stage 2 (``zero_grad``) where the axes are every axis that
    replicates the parameter, so that the reduce-scatter over them is its gradient's whole
    reduction."""
    out = {}
    for node, strats in strategies.items():
        if node.op == "get_attr" and node_info(node).requires_grad:
            shape = node_info(node).outputs[0][0]
            twins = [dataclasses.replace(s, zero=axes, zero_grad=stage2) for s in strats
                     if not s.zero and not s.offload
                     for axes in zero_axes(s.outputs[0], mesh_shape)
                     if zero_dim(shape, s.outputs[0], mesh_shape, axes) is not None
                     for stage2 in (False, True)
                     if not stage2 or axes == tuple(_replicating_axes(s.outputs[0], mesh_shape))]
            strats = list(strats) + twins
        out[node] = strats
    return out
