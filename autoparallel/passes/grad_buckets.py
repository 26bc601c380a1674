"""Which parameters share a gradient all-reduce: DDP's bucketing on the traced graph.

A parameter whose placement is ``Replicate`` along mesh axes of more than one device needs
its gradient all-reduced over them (DESIGN §2). Parameters replicated along the same axes
and of one dtype are packed into buckets of at most ``bucket_cap_bytes`` in the reverse
order of their first use in the forward, the order in which the backward produces their
gradients, so that each bucket's all-reduce can start while the backward of the earlier
layers still runs (Li et al., VLDB 2020, §3.2; DDP's default cap is 25 MiB). A parameter
larger than the cap is a bucket of its own. Under a mixed-precision policy a bucket is
all-reduced in the policy's reduce dtype (:func:`autoparallel.precision.reduce_dtype`), and
the cap counts its bytes in that dtype. Gradients reduce-scattered onto optimizer shards
(ZeRO stage 2) go in buckets of at most :data:`SCATTER_BUCKET_CAP_BYTES`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from .. import precision
from ..placement import R, local_shape
from ..plan import Plan

DEFAULT_BUCKET_CAP_BYTES = 25 * 2**20
SCATTER_BUCKET_CAP_BYTES = 4 * 2**20
"""The largest flat buffer of a bucket whose gradients are reduce-scattered (ZeRO stage 2), in
bytes per device. Until its bucket launches, each whole gradient is held beside the shards;
at the launch, the flat copy too: twice the bucket over the shards, the memory stage 2 is
chosen to save. With DDP's 25 MiB, the reference GPT-2 (4 x 512, 4 gloo processes, ZeRO-2 on
its blocks' parameters) peaked at 179.0 MiB against 155 modelled (the memory model counts a
parameter's whole gradient and flat copy at its own backward step: ``MemoryModel``'s
``buffers`` item); with 4 MiB at 155.0. Smaller buckets cost one reduce-scatter latency each."""


@dataclass
class GradBucket:
    """Parameters whose gradients are all-reduced together.

    Attributes:
        axes: mesh axes the parameters are replicated along (more than one device each).
        members: their ``get_attr`` nodes in the traced graph, in reverse order of first use.
        nbytes: bytes of the flat gradient buffer on one device, in ``dtype``.
        dtype: the dtype the buffer is all-reduced in (the parameters' own without a policy).
        scatter: the gradients are reduce-scattered onto the parameters' optimizer shards
            instead (ZeRO stage 2: ``Plan.sharded_gradients``).
    """

    axes: tuple[int, ...]
    members: list[fx.Node]
    nbytes: int
    dtype: torch.dtype
    scatter: bool = False


def _local_nbytes(node: fx.Node, spec, mesh_shape, dtype: torch.dtype) -> int:
    return math.prod(local_shape(tuple(node.meta["val"].shape), spec, mesh_shape)) * dtype.itemsize


def grad_buckets(gm: fx.GraphModule, plan: Plan, param_targets: set[str],
                 bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES,
                 stage_of: dict[str, int] | None = None) -> list[GradBucket]:
    """The gradient buckets of ``gm`` under ``plan``, in the order the backward fills them.

    Args:
        gm: the traced graph (``get_attr`` nodes annotated with ``meta["autoparallel"]``).
        plan: its plan (placements of the ``get_attr`` nodes, mixed-precision policy).
        param_targets: ``get_attr`` targets that are parameters or buffers.
        bucket_cap_bytes: the largest flat buffer, in bytes per device.
        stage_of: ``get_attr`` node name → its pipeline stage, for a pipelined plan: a bucket
            holds the parameters of one stage (each stage's devices reduce their own).

    Raises:
        ValueError: ``bucket_cap_bytes`` is not a positive integer.
    """
    if not isinstance(bucket_cap_bytes, int) or isinstance(bucket_cap_bytes, bool) or bucket_cap_bytes <= 0:
        raise ValueError(f"bucket_cap_bytes must be a positive integer, got {bucket_cap_bytes!r}")
    ms = plan.mesh.shape
    reduce_in = precision.reduce_dtype(plan.mp_policy)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}

    def first_use(node: fx.Node) -> int:
        return min((order[u] for u in node.users), default=len(order))

    params = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target in param_targets
              and n.meta["autoparallel"].requires_grad]
    scattered = set(plan.sharded_gradients)
    open_: dict[tuple, GradBucket] = {}
    done: list[GradBucket] = []
    for node in sorted(params, key=first_use, reverse=True):
        spec = plan.nodes[node.name].output_specs[0]
        axes = tuple(a for a, p in enumerate(spec) if p == R and ms[a] > 1)
        if not axes:
            continue
        dtype = node.meta["val"].dtype
        reduced_in = reduce_in if reduce_in is not None and dtype.is_floating_point else dtype
        nbytes = _local_nbytes(node, spec, ms, reduced_in)
        scatter = node.target in scattered
        key = (axes, dtype, reduced_in, (stage_of or {}).get(node.name, 0), scatter)
        b = open_.get(key)
        cap = min(bucket_cap_bytes, SCATTER_BUCKET_CAP_BYTES) if scatter else bucket_cap_bytes
        if b is not None and b.nbytes + nbytes > cap:
            done.append(open_.pop(key))
            b = None
        if b is None:
            b = open_[key] = GradBucket(axes, [], 0, reduced_in, scatter)
        b.members.append(node)
        b.nbytes += nbytes
    return done + list(open_.values())
