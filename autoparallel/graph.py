"""Helpers over fx graph nodes shared by every stage: a node's tensor inputs, its arguments
bound by name through the op's schema, and the tensors a graph returns."""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

aten = torch.ops.aten

# ops whose tensor argument supplies only dtype/device (never resharded)
NO_DATA_INPUT = {aten.new_ones.default, aten.new_zeros.default, aten.new_full.default,
                 aten.new_empty.default}


_TENSOR_INPUTS: "weakref.WeakKeyDictionary[fx.Node, tuple]" = weakref.WeakKeyDictionary()


def tensor_inputs(node: fx.Node) -> list[tuple[int, fx.Node]]:
    """``(leaf index, node)`` of every data tensor input, in pytree-leaf order of (args, kwargs).

    Memoized per node for as long as its ``args``/``kwargs`` objects stay the same
    (planning asks for every node's inputs many times)."""
    memo = _TENSOR_INPUTS.get(node)
    if memo is not None and memo[0] is node.args and memo[1] is node.kwargs:
        return memo[2]
    out = []
    if node.target not in NO_DATA_INPUT:
        for i, leaf in enumerate(pytree.tree_leaves((node.args, node.kwargs))):
            if isinstance(leaf, fx.Node) and isinstance(leaf.meta.get("val"), torch.Tensor):
                out.append((i, leaf))
    _TENSOR_INPUTS[node] = (node.args, node.kwargs, out)
    return out


def op_args(node: fx.Node) -> dict[str, Any]:
    """:func:`bind_args` of ``node``'s op, arguments and kwargs."""
    return bind_args(node.target, node.args, node.kwargs, where=f" (node {node.name})")


def bind_args(op, args, kwargs, where: str = "") -> dict[str, Any]:
    """Every argument of the ATen ``op`` called with ``args`` and ``kwargs``, by its schema
    name, defaults filled in.

    ``args`` bind to the schema's positional arguments in order and ``kwargs`` by name, as
    the dispatcher binds them; an argument given neither way takes the schema's default.
    Rules and passes read scalar arguments only through this, never by position: where an
    argument sits differs between ops (``flip(self, dims)`` but ``roll(self, shifts, dims)``;
    ``norm(self, p, dim)`` but ``sum(self, dim)``). ``where`` is appended to ``op`` in errors.

    Raises:
        TypeError: ``op`` has no schema, or the call passes an argument the schema does not
            have, or omits a required one.
    """
    schema = getattr(op, "_schema", None)
    if schema is None:
        raise TypeError(f"{op}{where} is not an ATen op with a schema")
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise TypeError(f"{op}{where}: {len(args)} positional arguments, the schema has {len(positional)}")
    out = {a.name: v for a, v in zip(positional, args)}
    names = {a.name for a in schema.arguments}
    for k, v in kwargs.items():
        if k not in names or k in out:
            raise TypeError(f"{op}{where}: unexpected or repeated argument {k!r}")
        out[k] = v
    for a in schema.arguments:
        if a.name not in out:
            if not a.has_default_value():
                raise TypeError(f"{op}{where}: required argument {a.name!r} missing")
            out[a.name] = a.default_value
    return out


def output_leaves(out: fx.Node) -> list[fx.Node]:
    """The tensors the graph returns, in order (the output's conversions are indexed by this)."""
    return [x for x in pytree.tree_leaves(out.args[0]) if isinstance(x, fx.Node)
            and isinstance(x.meta.get("val"), torch.Tensor)]
