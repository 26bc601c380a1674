"""Writes into module state: buffers updated in place become extra outputs of the graph.

``torch.export``'s training IR, which capture uses, keeps in-place ops as they ran:
BatchNorm's ``num_batches_tracked.add_(1)``, a ``copy_`` into a buffer, ... The rest of
the pipeline wants a graph without writes into state: a per-device graph writing into a
buffer in place would write into one device's local copy, and a strategy could reshard
the buffer and make the write land in a copy. :func:`functionalize_state` therefore
rewrites every in-place write into a buffer as its out-of-place op (``add_`` → ``add``,
``copy_(b, v)`` → a copy of ``v``), lets later reads of the buffer read the new value, and
returns each written buffer's final value, which capture appends to the graph's outputs
(``TracedModel.buffer_mutations``); the emitted module copies them back into its buffers
after every forward. Writes into user inputs, parameters, lifted constants, or into a view
of a buffer are refused with a :class:`~autoparallel.errors.CaptureError` that names them.
In-place ops on tensors the forward created (``relu_``, ``x += y``) are left as they are.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ..errors import CaptureError
from ..graph import alias_base, op_args, written_args
from .annotate import module_path

aten = torch.ops.aten

_NOT_COPIED = ("val", "tensor_meta", "autoparallel")


def fake_value(target, args, kwargs):
    """The FakeTensor(s) ``target`` returns on the ``meta["val"]`` of its node arguments."""
    args, kwargs = fx.map_arg((args, kwargs), lambda n: n.meta["val"])
    fakes = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, FakeTensor)]
    mode = fakes[0].fake_mode if fakes else FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        return target(*args, **kwargs)


def call_like(graph: fx.Graph, like: fx.Node, target, *args, **kwargs) -> fx.Node:
    """A new ``call_function`` node inserted at the graph's insertion point, carrying the
    metadata of ``like`` (module stack, source function) and its own ``meta["val"]``."""
    node = graph.call_function(target, tuple(args), kwargs)
    node.meta = {k: v for k, v in like.meta.items() if k not in _NOT_COPIED}
    node.meta["val"] = fake_value(target, node.args, node.kwargs)
    return node


def _functional(op):
    """The out-of-place overload of in-place op ``op`` (``aten.add_.Tensor`` → ``aten.add.Tensor``)."""
    ns, name = op._schema.name.split("::")
    if not name.endswith("_"):
        return None
    packet = getattr(getattr(torch.ops, ns), name[:-1], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


_KIND_WORDS = {"input": "its input", "parameter": "parameter", "constant": "the tensor constant"}
_ADVICE = {
    "input": "Clone the input before changing it (e.g. `x = x.clone()`).",
    "parameter": "Change parameters outside the forward (e.g. in the optimizer step).",
    "constant": "Make the tensor a registered buffer, or clone it before changing it.",
}


def _where(node: fx.Node) -> str:
    return f"node {node.name}, op {node.target}, module {module_path(node) or '<root>'}"


def functionalize_state(graph: fx.Graph, state: dict[fx.Node, tuple[str, str]]) -> dict[str, fx.Node]:
    """Rewrite in-place writes into buffers as out-of-place ops (see the module docstring).

    Args:
        graph: the captured graph, modified in place.
        state: every ``get_attr`` and ``placeholder`` node → ``(kind, name)``, kind one of
            ``"buffer"``, ``"parameter"``, ``"constant"``, ``"input"``.

    Returns:
        buffer ``get_attr`` target → the node holding its value at the end of the forward,
        for every buffer written, in order of first write.

    Raises:
        CaptureError: a write into a user input, a parameter or a constant, a write into a
            view of a buffer, or a read of a buffer's view taken before the buffer was
            written; the message names the node, its op, module path and the tensor.
    """
    writes = _BufferWrites(graph, state)
    for node in list(graph.nodes):
        if node.op in ("call_function", "output"):
            writes.visit(node)
    return {b.target: v for b, v in writes.latest.items()}


class _BufferWrites:
    """What :func:`functionalize_state` knows at a point of its walk over the graph.

    Attributes:
        holds: a value → the buffer it is the value of (a tied buffer read by several
            ``get_attr`` nodes is one buffer, its first node).
        latest: a written buffer → the node holding its current value.
        rename: a buffer's older value → its current one, for the nodes after the write.
        views: a view of a buffer's value → the buffer.
        stale: such views taken before the buffer was written → the buffer.
    """

    def __init__(self, graph: fx.Graph, state: dict[fx.Node, tuple[str, str]]):
        self.graph, self.state = graph, state
        canon: dict[str, fx.Node] = {}
        self.holds = {n: canon.setdefault(name, n) for n, (k, name) in state.items() if k == "buffer"}
        self.latest: dict[fx.Node, fx.Node] = {}
        self.rename: dict[fx.Node, fx.Node] = {}
        self.views: dict[fx.Node, fx.Node] = {}
        self.stale: dict[fx.Node, fx.Node] = {}

    def visit(self, node: fx.Node) -> None:
        """Read ``node``'s buffers at their current values; turn a write into one out-of-place."""
        if self.rename:
            node.args = fx.map_arg(node.args, lambda n: self.rename.get(n, n))
            node.kwargs = fx.map_arg(node.kwargs, lambda n: self.rename.get(n, n))
        for x in node.all_input_nodes:
            if x in self.stale:
                buf = self.state[self.stale[x]][1]
                raise CaptureError(f"the forward reads a view of buffer {buf!r} ({x.name}) taken before the buffer was "
                                   f"updated in place ({_where(node)}); take the view after the update")
        if node.op == "output":
            return
        written = written_args(node)
        if not written:
            base = alias_base(node)
            if base is not node and base in self.holds:
                self.views[node] = self.holds[base]
            return
        for i, x in written:
            if isinstance(x, (list, tuple)):  # e.g. _foreach_mul_: refused when it writes into state
                self._refuse_list_write(node, x)
            elif isinstance(x, fx.Node):
                buf = self._written_buffer(node, x, single=i == 0 and len(written) == 1)
                if buf is not None:
                    self._replace(node, x, buf)
                    return

    def _refuse_list_write(self, node: fx.Node, xs) -> None:
        bases = [alias_base(t) for t in xs if isinstance(t, fx.Node)]
        hit = [self.state[b] for b in bases if b in self.state]
        hit += [self.state[self.holds[b]] for b in bases if b in self.holds and b not in self.state]
        if hit:
            raise CaptureError(f"the forward writes in place into {', '.join(repr(n) for _, n in hit)} with "
                               f"{node.target} ({_where(node)}); autoparallel turns only single-tensor "
                               "in-place updates of buffers out-of-place (e.g. `buf.copy_(new)`)")

    def _written_buffer(self, node: fx.Node, x: fx.Node, single: bool) -> fx.Node | None:
        """The buffer ``node`` writes into through its argument ``x``; ``None`` for a tensor
        the forward created. ``single``: ``x`` is the op's first and only written argument.

        Raises:
            CaptureError: ``x`` is an input, a parameter or a constant, a view of a buffer,
                or a buffer written by an op that writes more than it.
        """
        base = alias_base(x)
        kind, name = self.state.get(base, (None, None))
        if kind in _KIND_WORDS:
            raise CaptureError(f"the forward writes in place into {_KIND_WORDS[kind]} {name!r} ({_where(node)}); "
                               f"autoparallel captures forwards that update only buffers in place. {_ADVICE[kind]}")
        if base not in self.holds:
            return None
        bname = self.state[self.holds[base]][1]
        if x is not base:
            raise CaptureError(f"the forward writes into a view of buffer {bname!r} ({_where(node)}); "
                               "autoparallel supports in-place updates of whole buffers only (e.g. "
                               "`buf.copy_(new)`, `buf.add_(1)`)")
        if not single:
            raise CaptureError(f"the forward updates buffer {bname!r} with {node.target} ({_where(node)}), "
                               "an op autoparallel cannot turn out-of-place; update it with `buf.copy_(new)`")
        return self.holds[base]

    def _replace(self, node: fx.Node, x: fx.Node, buf: fx.Node) -> None:
        """``node`` (writing into ``x``, the value of ``buf``) becomes its out-of-place op,
        the buffer's new value."""
        with self.graph.inserting_before(node):
            new = _functional_update(self.graph, node, x)
        for v, b in self.views.items():
            if b is buf:
                self.stale[v] = buf
        self.holds[new] = buf
        self.latest[buf] = new
        for v, b in self.holds.items():
            if b is buf and v is not new:
                self.rename[v] = new
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)


def _functional_update(graph: fx.Graph, node: fx.Node, old: fx.Node) -> fx.Node:
    """The out-of-place value of in-place ``node`` writing into ``old`` (same shape and dtype)."""
    val = old.meta["val"]
    if node.target is aten.copy_.default:
        src = op_args(node)["src"]
        if not isinstance(src, fx.Node):
            return call_like(graph, node, aten.full_like.default, old, src)
        if tuple(src.meta["val"].shape) != tuple(val.shape):
            src = call_like(graph, node, aten.expand.default, src, list(val.shape))
        if src.meta["val"].dtype != val.dtype:
            return call_like(graph, node, aten._to_copy.default, src, dtype=val.dtype)
        if len(src.users) == 1 and src.op == "call_function" and alias_base(src) is src:
            return src  # a value computed only to be copied (BatchNorm's running statistics)
        return call_like(graph, node, aten.clone.default, src)
    op = _functional(node.target)
    if op is None:
        raise CaptureError(f"the forward updates buffer {old.name} in place with {node.target}, which has no "
                           f"out-of-place form ({_where(node)})")
    new = call_like(graph, node, op, *node.args, **node.kwargs)
    if tuple(new.meta["val"].shape) != tuple(val.shape):
        raise CaptureError(f"in-place update of buffer {old.name} changes its shape ({_where(node)})")
    if new.meta["val"].dtype != val.dtype:
        new = call_like(graph, node, aten._to_copy.default, new, dtype=val.dtype)
    return new
