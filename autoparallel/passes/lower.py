"""The lowering stage: a captured graph and its :class:`Plan` in, the per-device graph out.

The pass list, in the order the passes run, is :func:`lower`'s body and nowhere else.
"""

from __future__ import annotations

import torch.fx as fx

from ..pickling import ParallelGraph
from ..plan import Plan
from .apply_plan import apply_plan, process_groups
from .causal_mask import causal_masks_as_flags
from .checkpoint import apply_checkpointing
from .cross_entropy import fuse_cross_entropy
from .dropout import shard_random_ops
from .fused_parts import rejoin_projection_parts
from .gqa import fold_repeated_kv
from .overlap import overlap_collectives


def lower(traced, plan: Plan, device_mesh, root, bucket_cap_bytes: int) -> fx.GraphModule:
    """The per-device graph of ``plan`` for ``traced`` (a
    :class:`~autoparallel.tracer.capture.TracedModel`) on ``device_mesh``, as a GraphModule
    over ``root`` (a module or a dict: where its ``get_attr`` nodes read parameters, buffers
    and constants).

    The passes, in order: :func:`apply_plan` (local shapes, collectives, gradient buckets of
    at most ``bucket_cap_bytes`` bytes), per-shard random ops, the emit-time rewrites (fused
    projections rejoined where a device computes them from one whole weight, grouped-query
    attention given to SDPA unrepeated, constant causal masks as ``is_causal``,
    cross-entropies over whole classes with a one-pass backward), activation checkpointing,
    then the forward's collectives scheduled for overlap.
    """
    groups = process_groups(device_mesh.mesh_dim_names or plan.mesh.axis_names,
                            [device_mesh.get_group(a).group_name for a in range(device_mesh.ndim)])
    targets = set(traced.params) | set(traced.buffers)
    graph = apply_plan(traced.gm, plan, groups, device_mesh.device_type, targets, device_mesh.size(),
                       traced_on=traced.device, bucket_cap_bytes=bucket_cap_bytes)
    shard_random_ops(graph, plan)  # one mask per distinct shard, drawn before checkpoint regions exist
    rejoin_projection_parts(graph, traced.gm.graph)
    fold_repeated_kv(graph, traced.gm.graph)
    causal_masks_as_flags(graph, traced.gm.graph, plan)
    fuse_cross_entropy(graph, traced.gm.graph)
    gm = ParallelGraph(root, graph, class_name="ParallelGraph")  # refuses pickling (pickling.py)
    if plan.checkpoint:
        stages = plan.checkpoint.stages
        stage_of = {n: stages[n.meta["source"]] for n in gm.graph.nodes if n.meta.get("source") in stages}
        apply_checkpointing(gm, stage_of, plan.checkpoint.regions)
    overlap_collectives(gm.graph)
    return gm
