"""Records of the ops mixture-of-experts layers route tokens with: the token count per
expert (``histc``), scatter-adds of tokens into their rows (``scatter_add``,
``index_add``), and Hugging Face's grouped matmul over experts
(``transformers::grouped_mm_fallback``). The router's choice of experts (``topk``) and the
sort of tokens by expert are ops along one dim (:func:`.rules.along_dim_rule`). And the
routed experts captured as one op (:mod:`autoparallel.tracer.experts`), with expert
parallelism: :func:`routed_experts_rule`.

``bincount`` has no record: its output length is the largest value plus one, which capture
cannot know before the run (:mod:`autoparallel.tracer.annotate` rejects such a node), so no
captured graph holds it; routers count tokens with ``histc`` over a fixed range instead.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch.distributed.tensor import Partial, Shard

from ..graph import op_args, tensor_inputs
from ..placement import R, local_shape
from ..runtime_kernels.experts import ROUTED_EXPERTS, exchanges_over_the_mesh, expert_hops, routed_experts
from ..tracer.annotate import node_info
from .engine import DimMap, Strategy
from .records import LocalCall, record
from .rules import _labels, _norm

aten = torch.ops.aten


@record(aten.histc.default)
def histc_rule(node, in_shapes, out_shapes):
    """``histc(x, bins, min, max)`` counts the elements of ``x`` (any shape, flattened) in
    ``bins`` equal bins over ``[min, max]``, each element on its own: a split ``x`` counts
    to the sum of its pieces' counts, so every dim of ``x`` may be split, leaving a
    ``Partial`` histogram (the bins stay whole). Only when ``max > min``: with ``min ==
    max`` (the default ``0, 0``) torch takes the range from the data's own minimum and
    maximum, which each piece would take from its own values, so nothing is split.
    (DTensor's registry offers the split whenever ``min`` and ``max`` are passed, ``0, 0``
    too.)"""
    a = op_args(node)
    nd = len(in_shapes[0])
    labs = _labels(nd) if a["max"] > a["min"] else (None,) * nd
    return DimMap([labs], [(None,)], list(in_shapes), list(out_shapes),
                  reduce=frozenset(lab for lab in labs if lab is not None))


@record(aten.scatter_add.default, aten.scatter_add_.default)
def scatter_add_rule(node, in_shapes, out_shapes):
    """``scatter_add(self, dim, index, src)``: the output is ``self`` with each
    ``src[..., j, ...]`` (``j`` along ``dim``) added at row ``index[..., j, ...]`` of ``dim``.

    - A dim other than ``dim`` on which ``self``, ``index`` and ``src`` have one size is
      parallel: each device scatters its own slices (``index`` and ``src`` may be smaller
      than ``self`` there, and ``src`` larger than ``index``: such a dim stays whole, as the
      pieces would not correspond).
    - ``dim`` of ``index`` and ``src`` (when of one size) may be split together: each device
      adds its share of the terms, a partial sum, so ``self`` is ``Partial`` (added once over
      the devices) and so is the output. ``dim`` of ``self`` stays whole: the indices
      address all of it.
    - The op is linear in ``self`` and ``src`` jointly: both ``Partial`` (``index`` whole)
      give a ``Partial`` output.

    The in-place ``scatter_add_`` writes its output into ``self``, with its spec."""
    x, idx, src = in_shapes
    nd = len(x)
    if nd == 0 or len(idx) != nd or len(src) != nd:  # 0-d operands: nothing to split
        return DimMap([(None,) * len(s) for s in in_shapes], [(None,) * nd], list(in_shapes), list(out_shapes))
    dim = _norm(op_args(node)["dim"], nd)
    labs = _labels(nd)
    lx = tuple(labs[d] if d != dim and x[d] == idx[d] == src[d] else None for d in range(nd))
    terms = "j" if idx[dim] == src[dim] else None
    li = tuple(terms if d == dim else lx[d] for d in range(nd))
    return DimMap([lx, li, li], [lx], list(in_shapes), list(out_shapes),
                  reduce=frozenset({terms} - {None}), partial=[frozenset({0, 2})])


@record(aten.scatter.value, aten.scatter_.value, aten.scatter.src, aten.scatter_.src)
def scatter_rule(node, in_shapes, out_shapes):
    """``scatter(self, dim, index, value | src)``: ``self`` with ``value`` (or
    ``src[..., j, ...]``) written at row ``index[..., j, ...]`` of ``dim`` (a router's mask of
    the chosen expert groups). A dim other than ``dim`` on which ``self``, ``index`` (and
    ``src``) have one size is parallel: each device writes its own slices; ``dim`` stays
    whole, as the indices address all of it, and so does a dim where ``index`` is smaller
    than ``self``. The in-place ``scatter_`` writes its output into ``self``, with its spec."""
    x, idx = in_shapes[0], in_shapes[1]
    nd = len(x)
    if nd == 0 or len(idx) != nd or any(len(s) != nd for s in in_shapes[2:]):
        return DimMap([(None,) * len(s) for s in in_shapes], [(None,) * nd], list(in_shapes), list(out_shapes))
    dim = _norm(op_args(node)["dim"], nd)
    labs = _labels(nd)
    lx = tuple(labs[d] if d != dim and all(s[d] == x[d] for s in in_shapes) else None for d in range(nd))
    return DimMap([lx] * len(in_shapes), [lx], list(in_shapes), list(out_shapes))


@record(aten.index_add.default, aten.index_add_.default)
def index_add_rule(node, in_shapes, out_shapes):
    """``index_add(self, dim, index, source, alpha=a)``: the output is ``self`` with
    ``a · source.select(dim, j)`` added at ``self.select(dim, index[j])``.

    - Every dim other than ``dim`` is parallel (``source`` has ``self``'s size there).
    - ``index`` and ``dim`` of ``source`` may be split together: each device adds its share
      of the terms, a partial sum, so ``self`` is ``Partial`` and so is the output. ``dim``
      of ``self`` stays whole: the indices address all of it.
    - The op is linear in ``self`` and ``source`` jointly (``alpha`` scales ``source``
      only): both ``Partial`` (``index`` whole) give a ``Partial`` output.

    The in-place ``index_add_`` writes its output into ``self``, with its spec."""
    x, idx, src = in_shapes
    nd = len(x)
    if nd == 0 or len(idx) != 1 or len(src) != nd:  # 0-d operands: nothing to split
        return DimMap([(None,) * len(s) for s in in_shapes], [(None,) * nd], list(in_shapes), list(out_shapes))
    dim = _norm(op_args(node)["dim"], nd)
    lx = tuple(None if d == dim else lab for d, lab in enumerate(_labels(nd)))
    lsrc = tuple("j" if d == dim else lab for d, lab in enumerate(lx))
    return DimMap([lx, ("j",), lsrc], [lx], list(in_shapes), list(out_shapes),
                  reduce=frozenset({"j"}), partial=[frozenset({0, 2})])


@record("transformers.grouped_mm_fallback.default")
def grouped_mm_rule(node, in_shapes, out_shapes):
    """Hugging Face's grouped matmul, ``grouped_mm_fallback(input (S, K), weight (E, K, N),
    offs (E,))`` (transformers 5's experts where ``torch._grouped_mm`` does not run, e.g. on
    CPU or in float32): the rows of ``input`` come sorted by expert, rows ``offs[e-1]`` to
    ``offs[e]`` are multiplied by ``weight[e]``, rows from ``offs[-1]`` on are zeros.

    ``N`` may be split with the output (each expert column-parallel) and ``K`` contracted
    (row-parallel: partial sums; the zero rows sum to zero), as Megatron-LM splits an MLP
    (Shoeybi et al. 2019, §3). The rows and the experts stay whole: ``offs`` counts global
    rows and covers every expert."""
    return DimMap([(None, "k"), (None, "k", "n"), (None,)], [(None, "n")], list(in_shapes), list(out_shapes),
                  reduce=frozenset({"k"}))


# ---------------------------------------------------------------- routed experts
_ROLES = {  # per mesh axis: (tokens split, experts split); the output follows
    "replicate": (False, False),  # every device of the axis computes every pair of its tokens
    "data": (True, False),  # the tokens split, every expert on every device
    "exchange": (True, True),  # expert parallelism: pairs sent to their expert's device and back
    "mask": (False, True),  # experts split, tokens whole: each device its experts' pairs, Partial
}


def _role_strategy(roles, mesh_shape) -> Strategy:
    """The strategy of ``routed_experts`` whose mesh axis ``a`` plays ``roles[a]``."""
    tok = tuple(Shard(0) if _ROLES[r][0] else R for r in roles)
    exp = tuple(Shard(0) if _ROLES[r][1] else R for r in roles)
    out = tuple(Partial() if r == "mask" else t for r, t in zip(roles, tok))
    split = math.prod(n for n, r in zip(mesh_shape, roles) if r != "replicate")
    return Strategy((tok, tok, tok, exp, exp), (out,), split=split)


def routed_experts_rule(node, in_shapes, out_shapes):
    """``routed_experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k), gate_up_proj
    (E, 2I, H), down_proj (E, H, I), act)``: each mesh axis plays one role (``_ROLES``): the
    tokens (``hidden`` and its routing, dim 0) split or whole, the experts (dim 0 of both
    weights) split or whole. Tokens and experts split along one axis is expert parallelism
    with all-to-all dispatch and combine (the ``"exchange"`` hop of
    :func:`~autoparallel.runtime_kernels.experts.routed_experts`); experts split over tokens
    whole leaves a ``Partial`` output (``"mask"``). The tokens must split evenly over the axes
    splitting them, the experts over theirs; the hidden and intermediate dims stay whole (the
    weights may still be held split along them, FSDP's layout, and gathered for the op)."""
    tokens, experts = in_shapes[0][0], in_shapes[3][0]

    def strategies(mesh_shape):
        found = []
        for roles in itertools.product(_ROLES, repeat=len(mesh_shape)):
            if any(n == 1 and r != "replicate" for n, r in zip(mesh_shape, roles)):
                continue
            tok = math.prod(n for n, r in zip(mesh_shape, roles) if _ROLES[r][0])
            exp = math.prod(n for n, r in zip(mesh_shape, roles) if _ROLES[r][1])
            if tokens % tok == 0 and experts % exp == 0:
                found.append(_role_strategy(roles, mesh_shape))
        return found

    return strategies


def local_routed_experts(call: LocalCall):
    """The per-device form: :func:`~autoparallel.runtime_kernels.experts.routed_experts` on the
    local tokens and experts, one hop per mesh axis splitting the experts, or one over the
    world's group where they exchange over the whole mesh (:func:`~autoparallel.runtime_kernels.experts.exchanges_over_the_mesh`) and
    the mesh is the world's ranks in order."""
    found = expert_hops(call.input_specs, call.mesh_shape)
    if exchanges_over_the_mesh(found, call.mesh_shape) and call.group(None) is not None:
        hops = (("exchange", math.prod(call.mesh_shape), None, call.group(None)),)
    else:
        hops = tuple((kind, call.mesh_shape[a], call.coord(a), call.group(a)) for kind, a in found)
    return call.call(routed_experts, tuple(call.args[:6]) + (hops,))


def routed_experts_cost(node, strategy, cost_model) -> float:
    """Seconds of the all-to-alls of each ``"exchange"`` axis: per axis, the counts (one int64
    per expert of the range the axis divides) once, the pairs' hidden rows four times
    (dispatch and combine, forward and backward; GShard, Lepikhin et al. 2020, §2.2), each
    device sending its share of the pairs times ``cost_model.expert_imbalance`` (1: balanced
    routing). A ``"mask"`` axis before it leaves a device ``1/n`` of its pairs to send. Hops
    that exchange over the whole mesh are priced as the one all-to-all over the world's group
    the runtime makes of them (:func:`~autoparallel.runtime_kernels.experts.exchanges_over_the_mesh`; a mesh not in the world's rank
    order runs them per axis, priced as one all the same)."""
    mesh_shape = cost_model.mesh.shape
    hidden, idx, _, gate_up, _ = (x for _, x in tensor_inputs(node))
    shape, dtype = node_info(hidden).outputs[0]
    pairs = math.prod(local_shape(tuple(idx.meta["val"].shape), strategy.inputs[1], mesh_shape))
    pairs *= cost_model.expert_imbalance
    row = shape[1] * dtype.itemsize
    passes = 4 if node_info(node).requires_grad else 2
    span, cost = node_info(gate_up).outputs[0][0][0], 0.0
    hops = expert_hops(strategy.inputs, mesh_shape)
    if exchanges_over_the_mesh(hops, mesh_shape):
        return (cost_model.collective_time("all_to_all", None, 8 * span)
                + passes * cost_model.collective_time("all_to_all", None, pairs * row))
    for kind, a in hops:
        n = mesh_shape[a]
        if kind == "exchange":
            cost += cost_model.collective_time("all_to_all", a, 8 * span)
            cost += passes * cost_model.collective_time("all_to_all", a, pairs * row)
        else:
            pairs /= n
        span //= n
    return cost


def routed_experts_load(node, strategy, mesh_shape, cost_model) -> float:
    """The busiest device's share of the routed pairs over an even one: ``cost_model.
    expert_imbalance`` where a mesh axis splits the experts (each device computes the pairs
    routed to its own experts, as many as the router sends there), else 1 (every device
    computes every pair of its own tokens)."""
    return cost_model.expert_imbalance if expert_hops(strategy.inputs, mesh_shape) else 1.0


def routed_experts_saved(node):
    """What :func:`~autoparallel.runtime_kernels.experts.routed_experts` keeps for the backward,
    per (token, expert) pair ``S = T·k``: the gathered tokens ``(S, H)``, the gate and up
    projections ``(S, 2I)``, the activation and the gated product ``(S, I)`` each, the
    experts' outputs ``(S, H)`` (in the weights' dtype); and the pairs' order and routing
    weights ``(S,)``."""
    hidden, idx, weights, gate_up, _ = (x.meta["val"] for _, x in tensor_inputs(node))
    s, h, two_i, dt = idx.numel(), hidden.shape[1], gate_up.shape[1], gate_up.dtype
    return [((s, h), dt), ((s, two_i), dt), ((s, two_i // 2), dt), ((s, two_i // 2), dt), ((s, h), dt),
            ((s,), torch.int64), ((s,), weights.dtype)]


record(ROUTED_EXPERTS, local=local_routed_experts, cost=routed_experts_cost,
       saved=routed_experts_saved, load=routed_experts_load)(routed_experts_rule)
