"""The lowering stage: a captured graph and its :class:`Plan` in, the per-device graph out.

The pass list, in the order the passes run, is :func:`_lowered`'s body then :func:`_finish`'s,
and nowhere else; a pipelined plan's graph is cut into its stages between the two
(:func:`lower_stages`).
"""

from __future__ import annotations

import torch.distributed as dist
import torch.fx as fx

from ..pickling import ParallelGraph
from ..plan import Plan
from .apply_plan import apply_plan, process_groups
from ..rewrites import apply_rewrites
from .checkpoint import apply_checkpointing
from .dropout import shard_random_ops
from .overlap import overlap_collectives
from .stages import loss_index, split_stages, traced_stages


def lower(traced, plan: Plan, device_mesh, root, bucket_cap_bytes: int) -> fx.GraphModule:
    """The per-device graph of ``plan`` for ``traced`` (see :func:`_lowered`)."""
    gm = _lowered(traced, plan, device_mesh, root, bucket_cap_bytes)
    _finish(gm, plan)
    return gm


def lower_stages(traced, plan: Plan, device_mesh, root, bucket_cap_bytes: int) -> list[fx.GraphModule]:
    """The per-device graphs of a pipelined ``plan``'s stages (:mod:`autoparallel.passes.stages`),
    every stage's: ``device_mesh`` is one stage's submesh, ``root`` holds every parameter (other
    stages' as fake tensors, :func:`~autoparallel.codegen.pipeline.stand_in`). The passes of :func:`lower`,
    gradient buckets holding one stage's parameters each, the graph cut before activation
    checkpointing and the overlap of collectives, which then run per stage."""
    source_stage = traced_stages(traced.gm, plan.pipeline)
    gm = _lowered(traced, plan, device_mesh, root, bucket_cap_bytes, source_stage)
    graphs = split_stages(gm, source_stage, plan.pipeline.stages, loss_index(traced.gm))
    for g in graphs:
        _finish(g, plan)
    return graphs


def _lowered(traced, plan: Plan, device_mesh, root, bucket_cap_bytes: int,
             stage_of: dict[str, int] | None = None) -> fx.GraphModule:
    """The per-device graph of ``plan`` for ``traced`` (a
    :class:`~autoparallel.tracer.capture.TracedModel`) on ``device_mesh``, as a GraphModule
    over ``root`` (a module or a dict: where its ``get_attr`` nodes read parameters, buffers
    and constants).

    The passes, in order: :func:`apply_plan` (local shapes, collectives, gradient buckets of
    at most ``bucket_cap_bytes`` bytes, one stage's parameters each when ``stage_of`` gives the
    traced nodes' pipeline stages), per-shard random ops, the emit-time rewrites of
    :data:`autoparallel.rewrites.REWRITES` in their order; then :func:`_finish`: activation
    checkpointing and the forward's collectives scheduled for overlap.
    """
    groups = process_groups(device_mesh.mesh_dim_names or plan.mesh.axis_names,
                            [device_mesh.get_group(a).group_name for a in range(device_mesh.ndim)])
    targets = set(traced.params) | set(traced.buffers)
    offloaded = frozenset(t for t, names in traced.params.items() if set(names) & set(plan.offloaded))
    graph = apply_plan(traced.gm, plan, groups, device_mesh.device_type, targets, device_mesh.size(),
                       traced_on=traced.device, bucket_cap_bytes=bucket_cap_bytes, offloaded=offloaded,
                       stage_of=stage_of, world_group=_row_major_world_group(device_mesh))
    shard_random_ops(graph, plan)  # one mask per distinct shard, drawn before checkpoint regions exist
    apply_rewrites(graph, traced.gm.graph, plan)  # the registry the memory model reads too
    return ParallelGraph(root, graph, class_name="ParallelGraph")  # refuses pickling (pickling.py)


def _row_major_world_group(device_mesh) -> str | None:
    """The world's process-group name when ``device_mesh`` holds the world's ranks in row-major
    order (``init_device_mesh``'s layout), so that rank ``r`` of the world group is the device
    at flat mesh index ``r``; else ``None``. Decided from the mesh tensor, the same on every rank."""
    if not dist.is_initialized() or device_mesh.mesh.flatten().tolist() != list(range(dist.get_world_size())):
        return None
    return dist.group.WORLD.group_name


def _finish(gm: fx.GraphModule, plan: Plan) -> None:
    """Activation checkpointing and the overlap of the forward's collectives, in place."""
    if plan.checkpoint:
        stages = plan.checkpoint.stages
        stage_of = {n: stages[n.meta["source"]] for n in gm.graph.nodes if n.meta.get("source") in stages}
        apply_checkpointing(gm, stage_of, plan.checkpoint.regions)
    overlap_collectives(gm.graph)
