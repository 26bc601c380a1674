"""Tied parameters read by several pieces of a pipelined model, each piece given its own name.

Pipeline stages hold their own parameters, so a parameter read before the repeated layers and
after them (GPT-2's token embedding, tied to its head) lives twice: on the first stage and on
the last. :func:`untie_pieces` gives each piece that reads a tied parameter a ``get_attr`` of
its own, under another of the parameter's names (``lm_head.weight`` beside
``transformer.wte.weight``), so that the plan places, and the stages hold, one parameter per
name; the runtime sums their gradients after the backward and keeps their values equal
(:mod:`autoparallel.codegen.pipeline`).
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn

from ..fqn import get_attr, set_attr
from .annotate import node_info


def piece_of(module_path: str, layers: str) -> int | None:
    """The layer index of an op run in ``module_path`` under the ``ModuleList`` at ``layers``
    (``"transformer.h.3.attn"`` → 3), or ``None`` for an op outside the layers."""
    prefix = layers + "."
    if not module_path.startswith(prefix):
        return None
    head = module_path[len(prefix):].split(".", 1)[0]
    return int(head) if head.isdigit() else None


def _piece(user: fx.Node, layers: str):
    layer = piece_of(node_info(user).module_path, layers)
    return ("layer", layer) if layer is not None else ("outside", node_info(user).module_path)


def untie_pieces(traced, layers: str) -> dict[str, str]:
    """In ``traced`` (a :class:`~autoparallel.tracer.capture.TracedModel`, changed in place),
    each tied parameter read by ops of several module paths gets one ``get_attr`` per module
    path that reads it, each under the next of its names (the first keeps the original).
    Returns new name → the name it was tied to. A parameter with fewer names than readers is
    left as it is (a stage split between its readers then raises).
    """
    graph = traced.gm.graph
    untied: dict[str, str] = {}
    for node in [n for n in graph.nodes if n.op == "get_attr" and len(traced.params.get(n.target, ())) > 1]:
        names = traced.params[node.target]
        by_piece: dict[tuple, list[fx.Node]] = {}
        for user in node.users:
            by_piece.setdefault(_piece(user, layers), []).append(user)
        if len(by_piece) < 2 or len(by_piece) > len(names):
            continue
        value = get_attr(traced.gm, node.target)
        pieces = list(by_piece.values())
        traced.params[node.target] = [names[0]] + names[len(pieces):]  # names no piece takes stay tied
        for users, name in zip(pieces[1:], names[1:]):
            set_attr(traced.gm, name, nn.Parameter(torch.empty_like(value, device="meta"),
                                                   requires_grad=value.requires_grad))
            traced.params[name] = [name]
            if node.target in traced.requires_grad:
                traced.requires_grad[name] = traced.requires_grad[node.target]
            with graph.inserting_after(node):
                new = graph.get_attr(name)
            new.meta = dict(node.meta)
            for user in users:
                user.replace_input_with(node, new)
            untied[name] = names[0]
    traced.gm.recompile()
    return untied
