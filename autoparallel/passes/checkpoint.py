"""Wrap stage ranges of the per-device graph in nested non-reentrant checkpoint calls.

Each region of a checkpoint schedule (:class:`~autoparallel.plan.Region`, a tree)
becomes a sub-``GraphModule`` holding its ops, called through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the forward keeps only
the region's inputs, the backward recomputes the region. Children become checkpoint calls
inside their parent's sub-module, so during the parent's recompute they again keep only
their inputs and recompute at their own backward: the nested schedule of Rotor (Beaumont
et al., arXiv 1911.13214). Collectives inside a region are recomputed too; every rank
runs the same recomputation in the same order. The RNG state is restored for the
recompute (checkpoint's default), so random ops draw the same values. A selective region
(one stage) is called through
:func:`~autoparallel.runtime_kernels.recompute.selective_checkpoint` instead: it keeps the
outputs of matmuls and attention as well and recomputes the other ops.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch
import torch.fx as fx
import torch.utils.checkpoint

from ..graph import written_args
from ..plan import Region
from ..runtime_kernels.recompute import selective_checkpoint


def _writes_outside(node: fx.Node, inside: set[fx.Node]) -> bool:
    """Whether ``node`` mutates a tensor produced outside ``inside`` (it must not run twice)."""
    return any(isinstance(v, fx.Node) and v not in inside for _, v in written_args(node))


def _wrap(gm: fx.GraphModule, stage_of: dict[fx.Node, int], region: Region) -> None:
    graph = gm.graph
    ops = [n for n in graph.nodes if n.op == "call_function" and region.start <= stage_of.get(n, -1) < region.stop]
    if not ops:
        return
    inside = set(ops)
    # ops of other stages between the region's first and last op (e.g. shared index math) move
    # before it when they do not read the region; otherwise the region is not contiguous
    first, last = ops[0], ops[-1]
    between, cur = [], first
    while cur is not last:
        cur = cur.next
        if cur not in inside:
            between.append(cur)
    for n in between:
        if any(a in inside for a in n.all_input_nodes):
            raise ValueError(f"checkpoint region of stages {region.start}..{region.stop - 1} is not contiguous: "
                             f"node {n.name} ({n.target}) of another stage runs between its ops and reads them")
        first.prepend(n)
    for n in ops:
        if _writes_outside(n, inside):
            raise ValueError(f"node {n.name} ({n.target}) in checkpoint region of stages {region.start}.."
                             f"{region.stop - 1} writes into a tensor from outside the region: recomputing it "
                             "would apply the write twice")
    inputs: list[fx.Node] = []
    for n in ops:
        for a in n.all_input_nodes:
            if a not in inside and a not in inputs:
                inputs.append(a)
    outputs = [n for n in ops if any(u not in inside for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in ops:
        env[n] = sub.node_copy(n, lambda a: env[a])
    sub.output(tuple(env[o] for o in outputs))
    sub_gm = fx.GraphModule(torch.nn.Module(), sub, class_name="CheckpointRegion")
    sub_stages = {env[n]: s for n, s in stage_of.items() if n in env and n in inside}
    for child in region.children:
        _wrap(sub_gm, sub_stages, child)
    sub_gm.recompile()
    name = f"checkpoint_{region.start}_{region.stop}"
    gm.add_submodule(name, sub_gm)
    with graph.inserting_before(first):
        fn = graph.get_attr(name)
        if region.selective:
            call = graph.call_function(selective_checkpoint, (fn, *inputs))
        else:
            call = graph.call_function(torch.utils.checkpoint.checkpoint, (fn, *inputs), {"use_reentrant": False})
        results = [graph.call_function(operator.getitem, (call, i)) for i in range(len(outputs))]
    for o, r in zip(outputs, results):
        r.meta = dict(o.meta)
        o.replace_all_uses_with(r, delete_user_cb=lambda u: u not in inside)
    for n in reversed(ops):
        graph.erase_node(n)


def apply_checkpointing(gm: fx.GraphModule, stage_of: dict[fx.Node, int], regions: Sequence[Region]) -> None:
    """Replace every region of ``regions`` (a tree over stage numbers) in ``gm`` by a
    non-reentrant checkpoint call of a sub-module ``checkpoint_<start>_<stop>`` holding its
    ops (``stage_of``: op node → stage; nodes without a stage stay outside every region).

    Raises:
        ValueError: a region whose ops are interleaved with ops of other stages that read
            them, or that writes in place into a tensor from outside it.
    """
    for region in regions:
        _wrap(gm, stage_of, region)
    gm.graph.lint()
    gm.recompile()
