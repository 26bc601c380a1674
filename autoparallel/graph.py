"""Helpers over fx graph nodes shared by every stage: a node's tensor inputs, its arguments
bound by name through the op's schema, what an op writes into and which input its output
aliases (read from the schema's alias annotations), the repeated layer a node belongs to,
and the tensors a graph returns."""

from __future__ import annotations

import operator
import re
import weakref
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

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
    """The tensors the graph returns, in order (the output's redistributions are indexed by this)."""
    return [x for x in pytree.tree_leaves(out.args[0]) if isinstance(x, fx.Node)
            and isinstance(x.meta.get("val"), torch.Tensor)]


def _annotated_args(node: fx.Node) -> list[tuple[int, Any, Any, int]]:
    """``(schema position, schema argument, value, first pytree leaf)`` of every argument of
    ``node``'s ATen op that carries an alias annotation (``Tensor(a)``, ``Tensor(a!)``) and
    is given in the call; leaves count over ``(args, kwargs)`` as :func:`tensor_inputs` does."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None:
        return []
    given, leaf = {}, 0
    for a, v in zip([a for a in schema.arguments if not a.kwarg_only], node.args):
        given[a.name], leaf = (v, leaf), leaf + len(pytree.tree_leaves(v))
    for k, v in node.kwargs.items():
        given[k], leaf = (v, leaf), leaf + len(pytree.tree_leaves(v))
    return [(i, a, *given[a.name]) for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.name in given]


def written_args(node: fx.Node) -> list[tuple[int, Any]]:
    """``(schema position, value)`` of every argument ``node`` writes into: the ``self`` of
    an in-place op (``add_``, ``copy_``), the ``out`` of an out= op, the tensor list of a
    ``_foreach_*_`` op (the value is then the list). Empty for ops that write nothing and
    for targets without a schema."""
    return [(i, v) for i, a, v, _ in _annotated_args(node) if a.alias_info.is_write]


def written_inputs(node: fx.Node) -> dict[int, list[int]]:
    """Position in :func:`tensor_inputs` of every data input ``node`` writes into → the
    indices of the op's outputs that are that same tensor (``add_``: ``{0: [0]}``)."""
    args = _annotated_args(node)
    if not args:
        return {}
    position = {leaf: j for j, (leaf, _) in enumerate(tensor_inputs(node))}
    returns = node.target._schema.returns
    return {position[leaf]: [o for o, r in enumerate(returns) if r.alias_info is not None
                             and r.alias_info.before_set & a.alias_info.before_set]
            for _, a, _, leaf in args if a.alias_info.is_write and leaf in position}


def _output_alias(node: fx.Node) -> tuple[Any, int] | None:
    """``(value, first leaf)`` of the argument whose storage ``node``'s first output shares."""
    args = _annotated_args(node)
    if not args:
        return None
    returns = node.target._schema.returns
    if not returns or returns[0].alias_info is None:
        return None
    sets = returns[0].alias_info.before_set
    return next(((v, leaf) for _, a, v, leaf in args if not sets or a.alias_info.before_set & sets), None)


def alias_source(node: fx.Node) -> fx.Node | None:
    """The node whose storage the first output of ``node`` shares (the input a view or an
    in-place op returns, per its schema), or ``None`` when the output is a new tensor."""
    found = _output_alias(node)
    return found[0] if found is not None and isinstance(found[0], fx.Node) else None


def aliased_input(node: fx.Node) -> int | None:
    """Position in :func:`tensor_inputs` of :func:`alias_source`, or ``None``."""
    found = _output_alias(node)
    if found is None:
        return None
    return next((j for j, (leaf, _) in enumerate(tensor_inputs(node)) if leaf == found[1]), None)


def is_view(node: fx.Node) -> bool:
    """Whether ``node`` is a view: its output aliases an input it does not write into
    (``view``, ``transpose``, ``slice``, ``expand``, ``detach``, ...)."""
    return alias_source(node) is not None and not written_args(node)


# Views whose backward is a view of the gradient too (``slice``, ``select``, ``expand`` and the
# split getitems are not: their backward writes zeros around the gradient, or sums it).
_VIEWS_BOTH_WAYS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.transpose.int,
                    aten.permute.default, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
                    aten.squeeze.dims, aten.squeeze.default, aten.alias.default, aten.detach.default,
                    aten.to.dtype, aten.to.dtype_layout, aten.unflatten.int, aten.flatten.using_ints}


def moves_no_data(node: fx.Node) -> bool:
    """Whether ``node`` and its backward only re-describe memory: a view of its input in both
    directions whose traced output shares its input's storage (so not a ``reshape`` that had to
    copy, nor a ``to`` that changed the dtype)."""
    if node.op != "call_function" or node.target not in _VIEWS_BOTH_WAYS or not is_view(node):
        return False
    out, src = node.meta.get("val"), alias_source(node).meta.get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor)):
        return False
    return StorageWeakRef(out.untyped_storage()) == StorageWeakRef(src.untyped_storage())


def alias_base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node`` uses: itself, or the end of the chain of getitems,
    views and in-place ops it is the output of."""
    while node.op == "call_function":
        if node.target is operator.getitem:
            node = node.args[0]
            continue
        src = alias_source(node)
        if src is None:
            return node
        node = src
    return node


_INDEXED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def layer_of(node: fx.Node, within: str | None = None) -> tuple[str, int] | None:
    """The repeated layer ``node`` belongs to: ``(module path of its list, index in it)``.

    A layer is an element of an ``nn.ModuleList`` (or any container whose children are
    named by index). An op belongs to the layer whose module is on its call stack
    (``meta["nn_module_stack"]``), a parameter or buffer (``get_attr``) to the layer its
    name is under. Without ``within`` it is the outermost indexed element
    (``h.3.attn.c_attn`` → ``("h", 3)``); with ``within``, an element of the list at that
    path (``("encoder.blocks.1.layers", 2)`` for a list nested in another). ``None`` for a
    node outside every layer.
    """
    if node.op == "get_attr":
        paths = [str(node.target)]
    else:
        paths = [str(path) for path, *_ in (node.meta.get("nn_module_stack") or {}).values()]
    for path in paths:
        if within is None:
            m = _INDEXED.match(path)
            if m:
                return m.group(1), int(m.group(2))
        elif path.startswith(within + "."):
            head = path[len(within) + 1:].split(".", 1)[0]
            if head.isdigit():
                return within, int(head)
    return None


def layers_of(nodes, within: str | None = None) -> dict[str, dict[int, list[fx.Node]]]:
    """The ``nodes`` of every repeated layer (:func:`layer_of`), in the order given:
    module path of the list → layer index → its nodes. Lists and layers appear in the
    order of their first node."""
    out: dict[str, dict[int, list[fx.Node]]] = {}
    for n in nodes:
        key = layer_of(n, within)
        if key is not None:
            out.setdefault(key[0], {}).setdefault(key[1], []).append(n)
    return out
