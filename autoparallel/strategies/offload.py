"""Host-memory offload of parameters as strategies.

A trainable parameter held sharded along every mesh axis of more than one device (FSDP's
layout) may instead be held in host memory: its shard, its gradient and its optimizer states
live there, the optimizer steps it there, each forward copies the shard to the device (then
all-gathers it as the plan says) and each backward copies the reduce-scattered gradient back.
This is the layout of FSDP2's ``CPUOffloadPolicy`` and of ZeRO-Offload (Ren et al.,
"ZeRO-Offload: Democratizing Billion-Scale Model Training", USENIX ATC 2021, §4: optimizer
states and the step on the CPU, parameters and gradients moved over PCIe once per step), per
parameter. A parameter replicated along an axis is not offered it: its gradient is
all-reduced on the device after the backward, which a host-held gradient would leave to the
host.

The planner adds these strategies only when no plan fits device memory without them
(:meth:`autoparallel.solver.planner.Planner.with_offload`): the copies cost host-link time
that a plan which fits never pays.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from ..placement import R
from ..tracer.annotate import node_info
from .engine import Strategy


def offload_ok(spec, mesh_shape) -> bool:
    """Whether a parameter held in ``spec`` may be offloaded: no mesh axis of more than one
    device replicates it (its gradient reaches it reduce-scattered, none all-reduced)."""
    return not any(p == R and n > 1 for p, n in zip(spec, mesh_shape))


def with_offload(strategies: dict[fx.Node, list[Strategy]], mesh_shape) -> dict[fx.Node, list[Strategy]]:
    """``strategies`` with, for every trainable parameter, an offloaded twin of each of its
    strategies that :func:`offload_ok` allows (after them, so that indices of the others are
    kept)."""
    out = {}
    for node, strats in strategies.items():
        if node.op == "get_attr" and node_info(node).requires_grad:
            twins = [dataclasses.replace(s, offload=True) for s in strats
                     if not s.offload and offload_ok(s.outputs[0], mesh_shape)]
            strats = list(strats) + twins
        out[node] = strats
    return out
