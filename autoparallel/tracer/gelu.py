"""GELU written out in elementwise ops, captured as the one fused ``aten.gelu`` it computes.

Hugging Face's ``gelu_new`` (GPT-2's activation, ``NewGELUActivation``), ``gelu_fast`` and
``gelu_python`` compute GELU (Hendrycks and Gimpel 2016, §2) in Python arithmetic::

    0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3)))     # tanh approximation
    0.5 * x * (1 + erf(x / sqrt(2)))                                # exact

Captured, that is 8 elementwise ops on the activation in the forward and about 12 in the
backward, each reading and writing the whole ``[batch, seq, 4 · hidden]`` tensor, and 4 of
their results kept for the backward. ``aten.gelu(x, approximate="tanh" | "none")`` is one
pass each way and keeps ``x`` only. On GPT-2 4 x 256 (CPU, 1 thread, batch 4 x 128) the
model's training step takes 141.5 ms with ``gelu_new`` and 111.3 ms with
``gelu_pytorch_tanh`` (docs/design.md, "GELU captured as one op").

:func:`fuse_gelu` finds each region of the captured graph that computes GELU of one tensor
in elementwise arithmetic and replaces it by ``aten.gelu``, the rewrite a fusing compiler
makes. A region is found from its ``tanh`` or ``erf``: going up through arithmetic ops
(``add``, ``sub``, ``rsub``, ``mul``, ``div``, ``pow`` by a number, ``neg``, whose other
operands are numbers), every path must end at one tensor ``x``; going down, the region is
every arithmetic op computed from ``x`` and the region alone, and its output the last of
them whose region's other values are read by the region only. What the region computes is
then **checked numerically**: evaluated in float64 on 2001 points of ``[-10, 10]``, it must
equal ``gelu(x, approximate=...)`` within ``1e-6``; the two approximations differ by up to
``5e-4`` there, so the check tells them apart, and a region that only looks alike (another
constant, another formula) is left as it is.

The values equal the written-out form's up to rounding: the fused kernel evaluates the same
formula in its own order (``aten/src/ATen/native/cpu/Activation.cpp``), in float32 for a
half-precision ``x`` where the written-out form rounds every intermediate to ``x``'s dtype.
"""

from __future__ import annotations

import numbers

import torch
import torch.fx as fx
import torch.nn.functional as F

from .mutations import call_like

aten = torch.ops.aten

_ARITHMETIC = {
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.rsub.Scalar, aten.mul.Tensor,
    aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.pow.Tensor_Scalar, aten.neg.default,
}
_ANCHORS = {aten.tanh.default: "tanh", aten.erf.default: "none"}
_ELEMENTWISE = _ARITHMETIC | set(_ANCHORS)
_SAMPLES = torch.linspace(-10.0, 10.0, 2001, dtype=torch.float64)
_TOLERANCE = 1e-6
_REACH = 16  # nodes after the anchor searched for the region's output


def fuse_gelu(graph: fx.Graph) -> int:
    """Replace every elementwise region of ``graph`` that computes GELU of one tensor by
    ``aten.gelu`` (module docstring). Returns how many were replaced."""
    count, erased = 0, set()
    for anchor in [n for n in graph.nodes if n.op == "call_function" and n.target in _ANCHORS]:
        found = None if anchor in erased else _region(graph, anchor)
        if found is not None:
            x, region, out = found
            _replace(graph, x, region, out, _ANCHORS[anchor.target])
            erased.update(region)
            count += 1
    return count


def _numbers_only(node: fx.Node) -> bool:
    """Every operand of ``node`` that is not a graph value is a number."""
    consts = [a for a in (*node.args, *node.kwargs.values()) if not isinstance(a, fx.Node)]
    return all(isinstance(a, numbers.Number) and not isinstance(a, bool) for a in consts)


def _elementwise(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in _ELEMENTWISE and _numbers_only(node)


def _source(anchor: fx.Node) -> fx.Node | None:
    """The one tensor every path up from ``anchor`` through arithmetic ends at, or ``None``."""
    leaves, seen, todo = set(), set(), list(anchor.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if _elementwise(n) and n.target in _ARITHMETIC:
            todo.extend(n.all_input_nodes)
        else:
            leaves.add(n)
    if len(leaves) != 1:
        return None
    x = leaves.pop()
    val = x.meta.get("val")
    return x if isinstance(val, torch.Tensor) and val.dtype.is_floating_point else None


def _region(graph: fx.Graph, anchor: fx.Node) -> tuple[fx.Node, list[fx.Node], fx.Node] | None:
    """``(x, region, out)`` where the region (in graph order, ``out`` last) computes GELU of
    ``x`` of the anchor's kind, or ``None``."""
    x = _source(anchor)
    if x is None:
        return None
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    closure: list[fx.Node] = []
    inside = {x}
    for n in nodes[pos[x] + 1:pos[anchor] + _REACH]:
        if _elementwise(n) and all(a in inside for a in n.all_input_nodes):
            closure.append(n)
            inside.add(n)
    for out in reversed(closure):
        if pos[out] <= pos[anchor]:
            break
        region = _ancestors_within(out, set(closure))
        if anchor in region and _closed(x, region, out) and _computes_gelu(x, region, _ANCHORS[anchor.target]):
            return x, region, out
    return None


def _ancestors_within(out: fx.Node, allowed: set[fx.Node]) -> list[fx.Node]:
    """``out`` and its ancestors in ``allowed``, in graph order."""
    found, todo = set(), [out]
    while todo:
        n = todo.pop()
        if n in allowed and n not in found:
            found.add(n)
            todo.extend(n.all_input_nodes)
    return [n for n in out.graph.nodes if n in found]


def _closed(x: fx.Node, region: list[fx.Node], out: fx.Node) -> bool:
    """No value of the region but ``out`` is read outside it, and ``out`` keeps ``x``'s shape
    and dtype."""
    members = set(region)
    if any(u not in members for n in region if n is not out for u in n.users):
        return False
    x_val, val = x.meta["val"], out.meta.get("val")
    return isinstance(val, torch.Tensor) and val.shape == x_val.shape and val.dtype == x_val.dtype


def _computes_gelu(x: fx.Node, region: list[fx.Node], approximate: str) -> bool:
    """The region, evaluated in float64 on ``_SAMPLES``, equals ``gelu(·, approximate)``."""
    env = {x: _SAMPLES}
    for n in region:
        args, kwargs = fx.map_arg((n.args, n.kwargs), lambda a: env[a])
        env[n] = n.target(*args, **kwargs)
    got, want = env[region[-1]], F.gelu(_SAMPLES, approximate=approximate)
    return got.dtype == torch.float64 and torch.allclose(got, want, rtol=_TOLERANCE, atol=_TOLERANCE)


def _replace(graph: fx.Graph, x: fx.Node, region: list[fx.Node], out: fx.Node, approximate: str) -> None:
    with graph.inserting_before(out):
        kwargs = {"approximate": approximate} if approximate != "none" else {}
        gelu = call_like(graph, out, aten.gelu.default, x, **kwargs)
    out.replace_all_uses_with(gelu)
    for n in reversed(region):
        graph.erase_node(n)
