"""Layer stamping: capture a deep stack of identical layers by tracing four of them.

``torch.export`` costs about a millisecond per op on two cores, so capture time grows
linearly with depth and dominates planning deep models (GPT-2 XL: 48 layers, ~3 s of a
4 s plan). Transformer layers are one ``nn.ModuleList`` of modules that compute the same
thing on different parameters. When a model's largest ``ModuleList`` is such a stack of
``L >= MIN_LAYERS`` layers, the tracer exports the model with the list cut down to layers
``0, 1, 2, L-1`` (:func:`truncated`) and :func:`stamp` rebuilds the full graph: layers
``3 .. L-2`` are copies of layer 2's nodes, reading their own parameters, chained output to
input; the traced layer ``L-1`` is renamed to its place. The result is the graph the full
export gives, up to node names.

Guards (any failing one means a full capture, never a wrong graph):

* before tracing (:func:`find_stack`): the layers have the same class, the same parameter
  and buffer names, shapes, dtypes and ``requires_grad``, share no tensor with each other or
  the rest of the model, and their submodules' plain attributes (numbers, strings, flags)
  are equal, except integers that differ from layer to layer (a layer index); the
  model config holds no per-layer list (``layer_types`` ...) whose entries differ;
* after tracing (:func:`stamp`): the nodes of each traced layer are contiguous, layers 1,
  2 and ``L-1`` have identical node lists (ops, argument values, shapes, dtypes, strides,
  wiring), each layer reads only its own parameters, the previous layer's values and
  values computed before the stack, and only the next layer reads a layer's values.

What the guards cannot see: a forward that branches on its layer index so that layers 1,
2 and ``L-1`` agree but another layer differs (e.g. ``if self.layer_idx % 5 == 4``).
``ColoTracer(stamp=False)`` / ``plan(..., stamp_layers=False)`` captures every layer.
"""

from __future__ import annotations

import contextlib
import re
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

from ..fqn import get_attr, set_attr

MIN_LAYERS = 6
_PLAIN = (int, float, str, bool, type(None))


@dataclass
class Stack:
    """A ``ModuleList`` of interchangeable layers.

    Attributes:
        path: its module path in the model (``"model.layers"``).
        layers: the list itself.
    """

    path: str
    layers: nn.ModuleList

    @property
    def keep(self) -> list[int]:
        """Indices of the layers that are traced: 0, 1, 2 and the last."""
        return [0, 1, 2, len(self.layers) - 1]


def _plain(v):
    if isinstance(v, _PLAIN):
        return v
    if isinstance(v, (tuple, list)) and all(isinstance(x, _PLAIN) for x in v):
        return tuple(v)
    return type(v).__name__


def _fingerprint(layer: nn.Module) -> tuple[list, dict]:
    """(tensor signature, plain attributes by (submodule, name)) of one layer."""
    tensors = [(n, tuple(t.shape), t.dtype, t.requires_grad)
               for n, t in list(layer.named_parameters(remove_duplicate=False))
               + list(layer.named_buffers(remove_duplicate=False))]
    attrs = {}
    for sub_name, sub in layer.named_modules(remove_duplicate=False):
        attrs[(sub_name, "__class__")] = type(sub).__qualname__
        attrs[(sub_name, "training")] = sub.training
        for k, v in vars(sub).items():
            if not k.startswith("_") and k != "training":
                attrs[(sub_name, k)] = _plain(v)
    return tensors, attrs


def _interchangeable(model: nn.Module, path: str, layers: nn.ModuleList) -> bool:
    prints = [_fingerprint(layer) for layer in layers]
    if any(p[0] != prints[0][0] or p[1].keys() != prints[0][1].keys() for p in prints):
        return False
    for key in prints[0][1]:
        values = [p[1][key] for p in prints]
        if len(set(map(repr, values))) > 1 and not all(type(v) is int for v in values):
            return False
    ids = [{id(t) for t in list(layer.parameters()) + list(layer.buffers())} for layer in layers]
    inside = set().union(*ids)
    if sum(map(len, ids)) != len(inside):
        return False  # a tensor shared between layers
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    if any(id(t) in inside for n, t in named if not n.startswith(path + ".")):
        return False  # a layer's tensor tied to one outside the stack
    config = getattr(model, "config", None)
    for v in (vars(config).values() if config is not None and hasattr(config, "__dict__") else ()):
        if isinstance(v, (list, tuple)) and len(v) == len(layers) and len(set(map(repr, v))) > 1:
            return False  # per-layer settings (e.g. sliding and full attention layers)
    return True


def find_stack(model: nn.Module) -> Stack | None:
    """The model's largest ``ModuleList`` of at least :data:`MIN_LAYERS` interchangeable
    layers (see the module docstring), or ``None``."""
    candidates = sorted(((len(m), path, m) for path, m in model.named_modules()
                         if isinstance(m, nn.ModuleList) and len(m) >= MIN_LAYERS), key=lambda c: -c[0])
    for _, path, layers in candidates:
        if len({type(layer) for layer in layers}) == 1 and _interchangeable(model, path, layers):
            return Stack(path, layers)
    return None


@contextlib.contextmanager
def truncated(stack: Stack):
    """Temporarily cut ``stack.layers`` down to the layers in ``stack.keep``."""
    saved = stack.layers._modules
    stack.layers._modules = OrderedDict((str(i), saved[str(k)]) for i, k in enumerate(stack.keep))
    try:
        yield
    finally:
        stack.layers._modules = saved


def _renamer(path: str, src: int, dst: int):
    pattern = re.compile(re.escape(f"{path}.{src}") + r"(?=\.|$)")
    return lambda s: pattern.sub(f"{path}.{dst}", s)


def _module_stack(meta: dict, rename) -> dict:
    stack = meta.get("nn_module_stack")
    if not stack:
        return stack
    return {rename(k): (rename(v[0]), *v[1:]) for k, v in stack.items()}


def _val_sig(val):
    return tuple((tuple(t.shape), t.dtype, t.stride()) if isinstance(t, torch.Tensor) else repr(t)
                 for t in pytree.tree_leaves(val))


def stamp(traced, stack: Stack) -> int:
    """Rebuild, in place, the full graph of ``traced`` (captured under :func:`truncated`):
    insert copies of layer 2 for layers ``3 .. L-2`` and move the traced last layer to index
    ``L-1``, registering the copies' parameters and buffers (meta tensors) on ``traced.gm``.

    Returns:
        the number of stamped layers (``L - 4``), or 0 when a guard fails; ``traced`` is
        then unchanged.
    """
    gm, graph = traced.gm, traced.gm.graph
    n_layers, prefix = len(stack.layers), stack.path + "."

    def layer_of(node: fx.Node) -> int | None:
        for path, *_ in (node.meta.get("nn_module_stack") or {}).values():
            if path.startswith(prefix) and path[len(prefix):].split(".", 1)[0].isdigit():
                return int(path[len(prefix):].split(".", 1)[0])
        return None

    def attr_rel(node: fx.Node, p: int) -> str | None:
        head = f"{prefix}{p}."
        return node.target[len(head):] if node.op == "get_attr" and node.target.startswith(head) else None

    segs: list[list[fx.Node]] = [[] for _ in stack.keep]
    order = []
    for n in graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            p = layer_of(n)
            order.append(p)
            if p is not None:
                segs[p].append(n)
    inner = [p for p in order]
    while inner and inner[0] is None:
        inner.pop(0)
    while inner and inner[-1] is None:
        inner.pop()
    if None in inner or inner != sorted(inner) or set(inner) != {0, 1, 2, 3}:
        return 0
    pos = [{n: i for i, n in enumerate(s)} for s in segs]

    def signature(p: int):
        def ref(x: fx.Node):
            if x in pos[p]:
                return ("in", pos[p][x])
            if x in pos[p - 1]:
                return ("prev", pos[p - 1][x])
            if attr_rel(x, p) is not None:
                return ("attr", attr_rel(x, p))
            if x.op == "get_attr" and x.target in traced.constants:
                c = traced.constants[x.target]
                return ("const", tuple(c.shape), c.dtype, tuple(c.flatten().tolist()) if c.numel() <= 4096 else x)
            return ("ext", x) if layer_of(x) is None and attr_rel(x, 0) is None else ("other layer", x)
        return [(n.op, n.target, pytree.tree_map_only(fx.Node, ref, (n.args, n.kwargs)), _val_sig(n.meta.get("val")))
                for n in segs[p]]

    try:
        if not signature(1) == signature(2) == signature(3):
            return 0
    except Exception:  # an argument that does not compare (e.g. a tensor): do not stamp
        return 0
    for p in range(3):  # only the next layer reads a layer's values
        allowed = set(segs[p]) | set(segs[p + 1])
        if any(u not in allowed for n in segs[p] for u in n.users):
            return 0

    attrs = {n.target: n for n in graph.nodes if n.op == "get_attr"}
    # new get_attr nodes go after the traced layer 3's, in layer order, as a full capture has them
    last_attr = [n for n in attrs.values() if attr_rel(n, 3) is not None][-1]

    def attr_node(template: fx.Node, p: int, layer: int) -> fx.Node:
        """The get_attr node of ``template``'s tensor in ``layer``; a layer's tensors are all
        registered on first use, in the template layer's order."""
        nonlocal last_attr
        if f"{prefix}{layer}.{attr_rel(template, p)}" not in attrs:
            for t in [n for n in list(attrs.values()) if attr_rel(n, p) is not None]:
                target = f"{prefix}{layer}.{attr_rel(t, p)}"
                value = get_attr(gm, t.target)
                meta = torch.empty_like(value, device="meta")
                set_attr(gm, target, nn.Parameter(meta, requires_grad=value.requires_grad)
                         if isinstance(value, nn.Parameter) else meta)
                (traced.params if t.target in traced.params else traced.buffers)[target] = [target]
                if t.target in traced.requires_grad:
                    traced.requires_grad[target] = traced.requires_grad[t.target]
                with graph.inserting_after(last_attr):
                    new = graph.get_attr(target)
                new.meta = dict(t.meta)
                attrs[target] = last_attr = new
        return attrs[f"{prefix}{layer}.{attr_rel(template, p)}"]

    def copy_layer(nodes: list[fx.Node], p: int, layer: int, prev: list[fx.Node]) -> list[fx.Node]:
        rename = _renamer(stack.path, p, layer)
        out: list[fx.Node] = []

        def arg(x: fx.Node) -> fx.Node:
            if x in pos[p]:
                return out[pos[p][x]]
            if x in pos[p - 1]:
                return prev[pos[p - 1][x]]
            if attr_rel(x, p) is not None:
                return attr_node(x, p, layer)
            return x

        with graph.inserting_before(segs[3][0]):
            for n in nodes:
                new = graph.node_copy(n, arg)
                new.meta["nn_module_stack"] = _module_stack(n.meta, rename)
                out.append(new)
        return out

    prev = segs[2]
    for layer in range(3, n_layers - 1):
        prev = copy_layer(segs[2], 2, layer, prev)
    # the traced last layer: its parameters and module paths move from index 3 to L-1
    last, rename = n_layers - 1, _renamer(stack.path, 3, n_layers - 1)
    for n in segs[3]:
        n.args, n.kwargs = pytree.tree_map_only(
            fx.Node, lambda x: prev[pos[2][x]] if x in pos[2] else attr_node(x, 3, last)
            if attr_rel(x, 3) is not None else x, (n.args, n.kwargs))
        n.meta["nn_module_stack"] = _module_stack(n.meta, rename)
    graph.eliminate_dead_code()  # layer 3's traced parameters, now read by the copy of layer 3 only
    graph.lint()
    gm.recompile()
    return n_layers - 4
