"""Random ops of the per-device graph draw one independent stream per distinct shard.

:func:`shard_random_ops` replaces every random op of the graph :func:`apply_plan` emitted
(``dropout``, ``native_dropout``, ``bernoulli``, ``rand_like``, ``randn_like`` and
``scaled_dot_product_attention`` with ``dropout_p > 0``) by the function of
:mod:`autoparallel.runtime_kernels.random` that draws the values of this device's shard from a
generator seeded with (the forward's seed, the op's number, the shard's index). The seed is
drawn once per forward by a node placed before every op (so outside every checkpoint region:
a recomputed region gets the same seed as an input and redraws the same masks). The shard index
follows the plan's output spec of the op: mesh axes along which the output is replicated (or a
pending sum) do not change it, so replicated tensors get one mask on every device.

Dropout with ``p == 0`` or ``train=False`` draws nothing and is left as it is. Any other op
tagged ``nondeterministic_seeded`` stays too; when its output is split, it draws the same
values on every shard and a warning names it.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

from ..graph import op_args
from ..plan import Plan
from ..runtime_kernels import random as rk

log = logging.getLogger("autoparallel")
aten = torch.ops.aten

KERNELS = {
    aten.dropout.default: rk.dropout,
    aten.native_dropout.default: rk.native_dropout,
    aten.bernoulli.default: rk.bernoulli,
    aten.bernoulli.p: rk.bernoulli,
    aten.rand_like.default: rk.rand_like,
    aten.randn_like.default: rk.randn_like,
    aten.scaled_dot_product_attention.default: rk.scaled_dot_product_attention,
}
_SDPA_MASK_DIMS = (0, 1, 2)  # the attention weights [b, h, q, k] share the output's [b, h, q] split


def _draws(node: fx.Node) -> bool:
    """Whether the op draws random numbers (dropout with p > 0 in training, SDPA with dropout)."""
    t = node.target
    if t in (aten.dropout.default, aten.native_dropout.default):
        a = op_args(node)
        return a["train"] is not False and a["p"] != 0
    if t == aten.scaled_dot_product_attention.default:
        return op_args(node)["dropout_p"] != 0
    return t in KERNELS


def shard_random_ops(graph: fx.Graph, plan: Plan) -> int:
    """Replace the random ops of ``graph`` (emitted by :func:`apply_plan` for ``plan``; its nodes
    carry ``meta["source"]``, the traced node they were emitted for) by per-shard draws, and add
    the node drawing the forward's seed. Returns the number of ops replaced."""
    coord = next(n for n in graph.nodes if n.op == "placeholder" and n.name == "mesh_coord")
    mesh_shape = tuple(plan.mesh.shape)
    todo, warned = [], set()
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        np_ = plan.nodes.get(n.meta.get("source", ""))
        if n.target in KERNELS and _draws(n) and np_ is not None and np_.output_specs:
            todo.append((n, np_))
        elif getattr(n.target, "tags", None) and torch.Tag.nondeterministic_seeded in n.target.tags \
                and n.target not in KERNELS:
            split = np_ is not None and np_.output_specs and any(rk.shard_strides(np_.output_specs[0], mesh_shape))
            if split and n.target not in warned:
                warned.add(n.target)
                log.warning("random op %s (node %s) runs on split data: every shard draws the same values",
                            n.target, np_.name)
    if not todo:
        return 0
    first = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))
    with graph.inserting_before(first):
        seed = graph.call_function(rk.draw_seed, ())
    for stream, (n, np_) in enumerate(todo):
        dims = _SDPA_MASK_DIMS if n.target == aten.scaled_dot_product_attention.default else None
        strides = rk.shard_strides(np_.output_specs[0], mesh_shape, dims)
        kwargs = {k: v for k, v in n.kwargs.items() if k != "generator"}
        with graph.inserting_before(n):
            new = graph.call_function(KERNELS[n.target], (seed, stream, coord, strides, *n.args), kwargs)
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        graph.erase_node(n)
    graph.lint()
    return len(todo)
