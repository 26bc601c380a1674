"""Per-node annotations: output shapes and dtypes, module path, FLOPs, bytes, grad flow.

FLOPs of matmul-like ops (linear, mm, addmm, bmm, matmul, baddbmm, convolution) come from
``torch.utils.flop_counter.FlopCounterMode`` run on the node's FakeTensor inputs; those of
``scaled_dot_product_attention`` from torch's ``sdpa_flop_count`` on its shapes (the counter
has no formula for the CPU flash kernel the op dispatches to there, and counted 0); every other op is counted as one FLOP per output element (they are memory bound,
and the roofline in :mod:`autoparallel.solver.costs` prices them by bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from ..errors import CaptureError
from ..fqn import get_attr
from ..runtime_kernels.experts import ROUTED_EXPERTS

aten = torch.ops.aten

MATMUL_LIKE = {
    aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.matmul.default,
    aten.baddbmm.default, aten.scaled_dot_product_attention.default, aten.convolution.default,
    aten.conv1d.default, aten.conv2d.default, aten.einsum.default, ROUTED_EXPERTS,
}
_NO_GRAD_OPS = {aten.detach.default, aten.arange.default, aten.arange.start, aten.arange.start_step}


@dataclass
class NodeInfo:
    """Annotation of one fx node (``node.meta["autoparallel"]``).

    Attributes:
        outputs: ``(shape, dtype)`` of every tensor the node produces, in output order.
        module_path: dotted path of the innermost ``nn.Module`` the op ran in ('' for the root).
        flops: forward floating-point operations (FLOP), global shapes.
        bytes: bytes of all outputs, global shapes.
        requires_grad: whether a gradient flows back through the output.
    """

    outputs: list[tuple[tuple[int, ...], torch.dtype]]
    module_path: str
    flops: float
    bytes: int
    requires_grad: bool

    @property
    def shape(self) -> tuple[int, ...] | None:
        return self.outputs[0][0] if len(self.outputs) == 1 else None

    @property
    def dtype(self) -> torch.dtype | None:
        return self.outputs[0][1] if len(self.outputs) == 1 else None


def node_info(node: fx.Node) -> NodeInfo:
    """The annotation of ``node`` (set by :func:`annotate_graph`)."""
    return node.meta["autoparallel"]


def module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return path if isinstance(path, str) else str(path)


def _tensor_vals(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    return [v for v in pytree.tree_leaves(val) if isinstance(v, torch.Tensor)]


def _flops(node: fx.Node, memo: dict) -> float | None:
    """FLOPs of a matmul-like node, counted once per distinct (op, shapes, arguments)."""
    if node.target not in MATMUL_LIKE:
        return None
    if node.target is aten.scaled_dot_product_attention.default:
        q, k, v = (tuple(node.args[i].meta["val"].shape) for i in range(3))
        if len(q) == len(k) == len(v) == 4:  # [B, H, S, D]; a 3-D call goes to the counter
            return float(sdpa_flop_count(q, k, v))
    key = (node.target, repr(pytree.tree_map_only(
        fx.Node, lambda n: (tuple(n.meta["val"].shape), n.meta["val"].dtype), (node.args, node.kwargs))))
    if key in memo:
        return memo[key]
    args, kwargs = pytree.tree_map_only(fx.Node, lambda n: n.meta["val"], (node.args, node.kwargs))
    vals = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    fake_mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    if fake_mode is None:
        return None
    counter = FlopCounterMode(display=False)
    with fake_mode, counter:
        node.target(*args, **kwargs)
    memo[key] = float(counter.get_total_flops())
    return memo[key]


def _static_shape(node: fx.Node, val: torch.Tensor) -> tuple[int, ...]:
    """The shape of one output of ``node`` as ints.

    Raises:
        CaptureError: a size depends on tensor values (an unbacked symbol of export)."""
    try:
        return tuple(int(s) for s in val.shape)
    except GuardOnDataDependentSymNode as e:
        op = node.target if node.op == "call_function" else node.op
        raise CaptureError(
            f"node {node.name} ({op}, module {module_path(node) or '<root>'}) has an output of shape "
            f"{tuple(val.shape)}, which depends on tensor values (boolean-mask indexing x[mask], nonzero, "
            "masked_select, unique, ...). autoparallel plans for shapes known before the run: keep the "
            "shape fixed, e.g. torch.where(mask, x, 0) or x.masked_fill(~mask, 0) followed by a reduction "
            "instead of x[mask], or indices of a fixed count (topk) instead of nonzero.") from e


def annotate_graph(gm: fx.GraphModule) -> None:
    """Attach a :class:`NodeInfo` to every node of ``gm`` that produces tensors.

    Raises:
        CaptureError: a node's output shape depends on tensor values (see :func:`_static_shape`).
    """
    memo: dict = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        vals = _tensor_vals(node.meta.get("val"))
        outs = [(_static_shape(node, v), v.dtype) for v in vals]
        nbytes = sum(v.numel() * v.element_size() for v in vals)
        if node.op == "get_attr":
            attr = get_attr(gm, node.target)
            rg = isinstance(attr, torch.nn.Parameter) and attr.requires_grad
        elif node.op == "placeholder":
            rg = False
        else:
            inputs = node.all_input_nodes
            rg = (node.target not in _NO_GRAD_OPS
                  and any(n.meta["autoparallel"].requires_grad for n in inputs if "autoparallel" in n.meta)
                  and any(dt.is_floating_point for _, dt in outs))
        flops = _flops(node, memo) if node.op == "call_function" else None
        if flops is None:
            flops = float(sum(v.numel() for v in vals))
        node.meta["autoparallel"] = NodeInfo(outs, module_path(node), flops, int(nbytes), bool(rg))
