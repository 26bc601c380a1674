"""Layer stamping: capture a deep list of identical layers by tracing four of them.

``torch.export`` costs about a millisecond per op on two cores, so capture time grows
linearly with depth and dominates planning deep models (GPT-2 XL: 48 layers, ~3 s of a
4 s plan). Transformer layers are one ``nn.ModuleList`` of modules that compute the same
thing on different parameters. When a model's largest ``ModuleList`` is such a list of
``L >= MIN_LAYERS`` layers, the tracer exports the model with the list cut down to layers
``0, 1, 2, L-1`` (:func:`truncated`) and :func:`stamp` rebuilds the full graph: layers
``3 .. L-2`` are copies of layer 2's nodes, reading their own parameters, chained output to
input; the traced layer ``L-1`` is renamed to its place. The result is the graph the full
export gives, up to node names.

A list whose first ``k`` layers differ from the rest (DeepSeek-V3's three dense layers before
58 mixture-of-experts ones) is stamped over its interchangeable tail of ``L - k >=
MIN_LAYERS`` layers: layers ``0 .. k+2`` and ``L-1`` are traced and ``k+3 .. L-2`` copied
from layer ``k+2``; the first ``k`` are traced like any op before the list.

Guards (any failing one means a full capture, never a wrong graph):

* before tracing (:func:`find_layer_list`): the layers of the tail have the same class, the same parameter
  and buffer names, shapes, dtypes and ``requires_grad``, share no tensor with each other or
  the rest of the model, and their submodules' plain attributes (numbers, strings, flags)
  are equal, except integers that differ from layer to layer (a layer index); the
  model config holds no per-layer list (``layer_types`` ...) whose entries differ;
* after tracing (:func:`stamp`): the nodes of each traced layer are contiguous, layers
  ``k+1``, ``k+2`` and ``L-1`` have identical node lists (ops, argument values, shapes,
  dtypes, strides, wiring), each layer reads only its own parameters, the previous layer's
  values and values computed before the list, and only the next layer reads a layer's values.

What the guards cannot see: a forward that branches on its layer index so that layers
``k+1``, ``k+2`` and ``L-1`` agree but another layer differs (e.g. ``if self.layer_idx % 5 == 4``).
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
from ..graph import layer_of

MIN_LAYERS = 6
_PLAIN = (int, float, str, bool, type(None))


@dataclass
class LayerList:
    """A ``ModuleList`` of interchangeable layers.

    Attributes:
        path: its module path in the model (``"model.layers"``).
        layers: the list itself.
        start: the first layer of the interchangeable tail (0: every layer); the layers
            before it are traced as they are.
    """

    path: str
    layers: nn.ModuleList
    start: int = 0

    @property
    def keep(self) -> list[int]:
        """Indices of the layers that are traced: those before ``start``, ``start``,
        ``start + 1``, ``start + 2`` and the last."""
        return list(range(self.start + 3)) + [len(self.layers) - 1]


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


def _tail_start(prints: list[tuple[list, dict]]) -> int:
    """The first index from which every layer's tensor signature and attribute names equal
    the last layer's (``prints``: :func:`_fingerprint` of each layer)."""
    start = len(prints) - 1
    while start > 0 and prints[start - 1][0] == prints[-1][0] and prints[start - 1][1].keys() == prints[-1][1].keys():
        start -= 1
    return start


def _interchangeable(model: nn.Module, path: str, layers: list[nn.Module], prints: list[tuple[list, dict]],
                     total: int) -> bool:
    """Whether ``layers`` (the tail of the ``total`` layers of the list at ``path``, with
    their ``prints``) compute the same thing: the guards before tracing (module docstring)."""
    for key in prints[0][1]:
        values = [p[1][key] for p in prints]
        if len(set(map(repr, values))) > 1 and not all(type(v) is int for v in values):
            return False
    ids = [{id(t) for t in list(layer.parameters()) + list(layer.buffers())} for layer in layers]
    inside = set().union(*ids)
    if sum(map(len, ids)) != len(inside):
        return False  # a tensor shared between layers
    tail = tuple(f"{path}.{i}." for i in range(total - len(layers), total))
    named = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
    if any(id(t) in inside for n, t in named if not n.startswith(tail)):
        return False  # a layer's tensor tied to one outside the tail
    config = getattr(model, "config", None)
    for v in (vars(config).values() if config is not None and hasattr(config, "__dict__") else ()):
        if isinstance(v, (list, tuple)) and len(v) == total and len(set(map(repr, v[total - len(layers):]))) > 1:
            return False  # per-layer settings (e.g. sliding and full attention layers)
    return True


def find_layer_list(model: nn.Module) -> LayerList | None:
    """The model's largest ``ModuleList`` whose tail of at least :data:`MIN_LAYERS` layers
    is interchangeable (see the module docstring), or ``None``. The tail is the longest run
    ending at the last layer whose layers have the last one's class, tensor signature and
    attribute names; the guards then decide on it as a whole."""
    candidates = sorted(((len(m), path, m) for path, m in model.named_modules()
                         if isinstance(m, nn.ModuleList) and len(m) >= MIN_LAYERS), key=lambda c: -c[0])
    for n, path, layers in candidates:
        if len({type(layer) for layer in layers[n - MIN_LAYERS:]}) > 1:
            continue
        prints = [_fingerprint(layer) if type(layer) is type(layers[-1]) else ([None], {}) for layer in layers]
        start = _tail_start(prints)
        if n - start >= MIN_LAYERS and _interchangeable(model, path, list(layers)[start:], prints[start:], n):
            return LayerList(path, layers, start)
    return None


@contextlib.contextmanager
def truncated(layer_list: LayerList):
    """Temporarily cut ``layer_list.layers`` down to the layers in ``layer_list.keep``."""
    saved = layer_list.layers._modules
    layer_list.layers._modules = OrderedDict((str(i), saved[str(k)]) for i, k in enumerate(layer_list.keep))
    try:
        yield
    finally:
        layer_list.layers._modules = saved


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


def stamp(traced, layer_list: LayerList) -> int:
    """Rebuild, in place, the full graph of ``traced`` (captured under :func:`truncated`):
    with ``k = layer_list.start``, insert copies of layer ``k+2`` for layers ``k+3 .. L-2``
    and move the traced last layer to index ``L-1``, registering the copies' parameters and
    buffers (meta tensors) on ``traced.gm``.

    Returns:
        the number of stamped layers (``L - k - 4``), or 0 when a guard fails; ``traced`` is
        then unchanged.
    """
    segs = _traced_layers(traced.gm.graph, layer_list.path, len(layer_list.keep))
    if segs is None:
        return 0
    stamper = _Stamper(traced, layer_list, segs)
    if not stamper.layers_match():
        return 0
    stamper.rebuild()
    return len(layer_list.layers) - len(layer_list.keep)


def _traced_layers(graph: fx.Graph, path: str, count: int) -> list[list[fx.Node]] | None:
    """The op nodes of each of the ``count`` traced layers of the list at ``path``, or
    ``None`` when they are not ``count`` contiguous runs in layer order."""
    segs: dict[int, list[fx.Node]] = {}
    order = []
    for n in graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            key = layer_of(n, path)
            order.append(key[1] if key else None)
            if key:
                segs.setdefault(key[1], []).append(n)
    while order and order[0] is None:
        order.pop(0)
    while order and order[-1] is None:
        order.pop()
    if None in order or order != sorted(order) or set(order) != set(range(count)):
        return None
    return [segs[p] for p in range(count)]


class _Stamper:
    """The state of one :func:`stamp`: the traced layers' nodes and positions (indices in
    the cut-down list: ``template`` the layer copied, ``last`` the traced last layer), the
    graph's ``get_attr`` nodes by target, and where new ones go."""

    def __init__(self, traced, layer_list: LayerList, segs: list[list[fx.Node]]):
        self.traced, self.gm, self.graph = traced, traced.gm, traced.gm.graph
        self.path, self.n_layers, self.prefix = layer_list.path, len(layer_list.layers), layer_list.path + "."
        self.template, self.last = layer_list.start + 2, layer_list.start + 3
        self.segs = segs
        self.pos = [{n: i for i, n in enumerate(seg)} for seg in segs]
        self.attrs: dict[str, fx.Node] = {}
        self.last_attr: dict[bool, fx.Node | None] = {}  # is a parameter → where the next one goes

    def attr_rel(self, node: fx.Node, p: int) -> str | None:
        """The name of ``node``'s tensor inside layer ``p`` when it is a ``get_attr`` of it."""
        head = f"{self.prefix}{p}."
        return node.target[len(head):] if node.op == "get_attr" and node.target.startswith(head) else None

    def signature(self, p: int) -> list:
        """Layer ``p``'s nodes as data: ops, argument values, wiring and output metadata."""
        pos, constants = self.pos, self.traced.constants

        def ref(x: fx.Node):
            if x in pos[p]:
                return ("in", pos[p][x])
            if x in pos[p - 1]:
                return ("prev", pos[p - 1][x])
            if self.attr_rel(x, p) is not None:
                return ("attr", self.attr_rel(x, p))
            if x.op == "get_attr" and x.target in constants:
                c = constants[x.target]
                return ("const", tuple(c.shape), c.dtype, tuple(c.flatten().tolist()) if c.numel() <= 4096 else x)
            outside = layer_of(x, self.path) is None and self.attr_rel(x, 0) is None
            return ("ext", x) if outside else ("other layer", x)
        return [(n.op, n.target, pytree.tree_map_only(fx.Node, ref, (n.args, n.kwargs)), _val_sig(n.meta.get("val")))
                for n in self.segs[p]]

    def layers_match(self) -> bool:
        """The guards after tracing: the layer before the template, the template and the
        last have the same signature, and only the next layer reads a layer's values."""
        t = self.template
        try:
            if not self.signature(t - 1) == self.signature(t) == self.signature(self.last):
                return False
        except Exception:  # an argument that does not compare (e.g. a tensor): do not stamp
            return False
        for p in range(self.last):
            allowed = set(self.segs[p]) | set(self.segs[p + 1])
            if any(u not in allowed for n in self.segs[p] for u in n.users):
                return False
        return True

    def rebuild(self) -> None:
        """Copy the template into layers ``template+1 .. L-2``, then move the traced last
        layer to ``L-1``."""
        self.attrs = {n.target: n for n in self.graph.nodes if n.op == "get_attr"}
        # new get_attr nodes go after the traced last layer's, in layer order, parameters after its
        # parameters and buffers after its buffers, as a full capture has them (export lists every
        # parameter before the buffers; layers without parameters or buffers need none)
        mine = [n for n in self.attrs.values() if self.attr_rel(n, self.last) is not None]
        self.last_attr = {kind: next((n for n in reversed(mine) if (n.target in self.traced.params) == kind), None)
                          for kind in (True, False)}
        prev = self.segs[self.template]
        for layer in range(self.last, self.n_layers - 1):
            prev = self.copy_layer(self.template, layer, prev)
        self.move_last(prev)
        # the traced last layer's parameters under its index in the cut-down list, now read by
        # the copy of the layer at that index only
        self.graph.eliminate_dead_code()
        self.graph.lint()
        self.gm.recompile()

    def attr_node(self, template: fx.Node, p: int, layer: int) -> fx.Node:
        """The get_attr node of ``template``'s tensor (in layer ``p``) in ``layer``; a
        layer's tensors are all registered on first use, in the template layer's order."""
        if f"{self.prefix}{layer}.{self.attr_rel(template, p)}" not in self.attrs:
            for t in [n for n in list(self.attrs.values()) if self.attr_rel(n, p) is not None]:
                self._register(t, f"{self.prefix}{layer}.{self.attr_rel(t, p)}")
        return self.attrs[f"{self.prefix}{layer}.{self.attr_rel(template, p)}"]

    def _register(self, t: fx.Node, target: str) -> None:
        """A meta tensor like ``t``'s at ``target`` on the graph module, and its get_attr node."""
        traced = self.traced
        value = get_attr(self.gm, t.target)
        meta = torch.empty_like(value, device="meta")
        set_attr(self.gm, target, nn.Parameter(meta, requires_grad=value.requires_grad)
                 if isinstance(value, nn.Parameter) else meta)
        (traced.params if t.target in traced.params else traced.buffers)[target] = [target]
        if t.target in traced.requires_grad:
            traced.requires_grad[target] = traced.requires_grad[t.target]
        kind = t.target in traced.params
        with self.graph.inserting_after(self.last_attr[kind]):
            new = self.graph.get_attr(target)
        new.meta = dict(t.meta)
        self.attrs[target] = self.last_attr[kind] = new

    def copy_layer(self, p: int, layer: int, prev: list[fx.Node]) -> list[fx.Node]:
        """Copies of layer ``p``'s nodes as layer ``layer``, reading ``prev`` (the copy of
        the layer before) where layer ``p`` reads layer ``p - 1``."""
        pos, rename = self.pos, _renamer(self.path, p, layer)
        out: list[fx.Node] = []

        def arg(x: fx.Node) -> fx.Node:
            if x in pos[p]:
                return out[pos[p][x]]
            if x in pos[p - 1]:
                return prev[pos[p - 1][x]]
            if self.attr_rel(x, p) is not None:
                return self.attr_node(x, p, layer)
            return x

        with self.graph.inserting_before(self.segs[self.last][0]):
            for n in self.segs[p]:
                new = self.graph.node_copy(n, arg)
                new.meta["nn_module_stack"] = _module_stack(n.meta, rename)
                out.append(new)
        return out

    def move_last(self, prev: list[fx.Node]) -> None:
        """The traced last layer: its inputs, parameters and module paths move from its index
        in the cut-down list to ``L-1``."""
        p, last = self.last, self.n_layers - 1
        rename = _renamer(self.path, p, last)

        def arg(x: fx.Node) -> fx.Node:
            if x in self.pos[p - 1]:
                return prev[self.pos[p - 1][x]]
            return self.attr_node(x, p, last) if self.attr_rel(x, p) is not None else x

        for n in self.segs[p]:
            n.args, n.kwargs = pytree.tree_map_only(fx.Node, arg, (n.args, n.kwargs))
            n.meta["nn_module_stack"] = _module_stack(n.meta, rename)
