"""Composite ops that capture keeps whole, rewritten into ops with exact sharding rules.

``F.mse_loss`` captures as ``broadcast_tensors`` followed by ``aten.mse_loss``; neither has a
rule of ours nor a split strategy in DTensor's registry, so both ran replicated: a model
trained with a regression loss gathered its whole output on every device.
:func:`decompose_composites` rewrites them, on the captured graph, into ops our rules split:

* ``broadcast_tensors([a, b, ...])[i]`` → ``expand(a_i, shape)`` (a view; the expand rule
  keeps broadcast dims whole on the input side);
* ``mse_loss(x, y, reduction)`` → ``d = x - y``; ``d * d``, then ``mean`` (reduction 1, the
  default), ``sum`` (2) or nothing (0): the definition of the loss, (x − y)² reduced, which is
  how torch's kernel computes it. A split reduced dim leaves a
  pending sum that the planner all-reduces where a consumer needs the whole loss.

The values equal the fused op's up to rounding of the final reduction's order; autograd
derives the backward (``2 · d · grad / n`` for mean) from the primitive ops.

Ops whose second tensor argument supplies only metadata are rewritten into the op that
takes that metadata as a constant, so that the argument is no data input (the planner
neither converts it nor forces its layout) and the per-device graph gets local values:

* ``view_as(x, y)``, ``reshape_as(x, y)``, ``expand_as(x, y)`` → ``view``, ``reshape``,
  ``expand`` of ``x`` to the (static) output shape, a shape argument that codegen rewrites
  to the local shape (as ``y``'s local tensor would not be when ``x`` is split and ``y`` is
  not); ``unflatten(x, dim, sizes)`` → ``view`` for the same reason (its global ``sizes``
  do not divide a split dim's local size);
* ``type_as(x, y)`` → ``x.to(dtype=y.dtype, device=y.device)`` (``aten.to.dtype_layout``,
  which like ``type_as`` returns ``x`` itself when nothing changes); ``y`` may have any shape;
* ``x.new_empty(size)``, ``new_zeros``, ``new_ones``, ``new_full`` → ``torch.empty(size)``,
  ``zeros``, ``ones``, ``full`` with ``x``'s dtype and device where the call gives none, whose
  output the planner may split (:func:`autoparallel.strategies.rules.filled_rule`): DeepSeek's
  attention builds its ``(B, heads, S, D)`` query in a ``new_empty``, 96 GiB at batch 512 × 4096,
  which a replicated creation held whole on every device.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import op_args
from .mutations import call_like

aten = torch.ops.aten
_REDUCE = {0: None, 1: aten.mean.default, 2: aten.sum.default}
_NEW_LIKE = {aten.new_empty.default: aten.empty.memory_format, aten.new_zeros.default: aten.zeros.default,
             aten.new_ones.default: aten.ones.default, aten.new_full.default: aten.full.default}
_TO_SHAPE_ARG = {aten.view_as.default: aten.view.default, aten.reshape_as.default: aten.reshape.default,
                 aten.expand_as.default: aten.expand.default, aten.unflatten.int: aten.view.default}


def decompose_composites(graph: fx.Graph) -> int:
    """Rewrite every ``broadcast_tensors``, ``mse_loss``, ``view_as``, ``reshape_as``,
    ``expand_as``, ``unflatten``, ``type_as`` and ``new_*`` node of ``graph`` (module docstring);
    returns how many were rewritten."""
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten.broadcast_tensors.default:
            count += _broadcast(graph, node)
        elif node.target is aten.mse_loss.default:
            count += _mse_loss(graph, node)
        elif node.target in _TO_SHAPE_ARG:
            count += _replace(graph, node, _TO_SHAPE_ARG[node.target], node.args[0],
                              list(node.meta["val"].shape))
        elif node.target is aten.type_as.default:
            other = node.args[1].meta["val"]
            count += _replace(graph, node, aten.to.dtype_layout, node.args[0], dtype=other.dtype,
                              device=other.device)
        elif node.target in _NEW_LIKE:
            count += _new_like(graph, node)
    return count


def _new_like(graph: fx.Graph, node: fx.Node) -> bool:
    """``x.new_*(size, [fill_value,] dtype=, device=, ...)`` as the creation op of :data:`_NEW_LIKE`."""
    a = op_args(node)
    like = a["self"].meta["val"]
    kwargs = {"dtype": a.get("dtype") or like.dtype, "device": a.get("device") or like.device}
    kwargs.update({k: a[k] for k in ("layout", "pin_memory") if a.get(k) is not None})
    args = (a["size"], a["fill_value"]) if "fill_value" in a else (a["size"],)
    return _replace(graph, node, _NEW_LIKE[node.target], *args, **kwargs)


def _replace(graph: fx.Graph, node: fx.Node, target, *args, **kwargs) -> bool:
    """Replace ``node`` by a call of ``target`` on ``args``/``kwargs``."""
    with graph.inserting_before(node):
        new = call_like(graph, node, target, *args, **kwargs)
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return True


def _broadcast(graph: fx.Graph, node: fx.Node) -> bool:
    inputs = node.args[0]
    for user in list(node.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            return False  # the list itself is used: keep the op (it runs replicated)
    for user in list(node.users):
        i = user.args[1]
        with graph.inserting_before(user):
            new = call_like(graph, user, aten.expand.default, inputs[i], list(user.meta["val"].shape))
        user.replace_all_uses_with(new)
        graph.erase_node(user)
    graph.erase_node(node)
    return True


def _mse_loss(graph: fx.Graph, node: fx.Node) -> bool:
    x, y = node.args[0], node.args[1]
    reduction = node.args[2] if len(node.args) > 2 else node.kwargs.get("reduction", 1)
    with graph.inserting_before(node):
        d = call_like(graph, node, aten.sub.Tensor, x, y)
        out = call_like(graph, node, aten.mul.Tensor, d, d)
        if _REDUCE[reduction] is not None:
            out = call_like(graph, node, _REDUCE[reduction], out)
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return True
