"""A causal attention mask computed from constants becomes SDPA's ``is_causal`` flag."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Shard

from ..graph import op_args
from ..runtime_kernels import local_piece
from ..tracer.annotate import node_info
from .base import Rewrite, Size

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_SEQUENCE_DIM = 2  # of SDPA's [B, H, S, D] operands
_CAUSAL = "autoparallel_causal_mask"  # node.meta key: whether _constant_causal_mask found the mask causal
# Largest tensor evaluated to prove a mask causal: planning at LLM scale (a [B, 1, S, S] mask of
# 8 × 8192²) must not allocate it; such a mask is left as it is.
_MAX_EVALUATED = 2**24


class CausalMaskAsFlag(Rewrite):
    """SDPA with ``is_causal=True`` and no mask, where its mask is a constant causal mask.

    Matches: a ``scaled_dot_product_attention`` whose ``attn_mask`` depends on no input,
    parameter or buffer (and draws nothing random) and evaluates, once, on the CPU, to exactly
    the causal mask (``True``, or ``0.0``, on and below the diagonal of a square ``[S, S]``,
    ``False`` or ``-inf`` above, for every batch and head), where the plan keeps the sequence
    dims of query, key and value whole on every device (a split query block would need a
    shifted diagonal). Under ``torch.export`` transformers cannot prove the causal mask redundant
    (that needs the values of the padding mask), so the captured graph builds it every step from
    ``arange``s and hands it to SDPA as ``attn_mask``; in eager, with no padding mask,
    transformers calls SDPA with ``is_causal=True`` and no mask, which its kernels run faster (on
    the 2-core test VM, 3.2 against 3.5 ms a Llama-class layer's attention forward and backward)
    and without the mask's ops. The mask's ops, now unread, are removed. Masks (and the tensors
    they are computed from) of more than 2**24 elements are not evaluated and stay as they are.

    Exact: the mask being a constant, the check is the proof: nothing the model is given can
    change it.

    Memory: the SDPA no longer keeps the float copy of the mask it makes for its backward (an
    op-internal tensor of the mask's shape), under every strategy that keeps the sequence whole.
    """

    name = "causal_mask"

    def applies(self, node: fx.Node) -> bool:
        """``node`` is an SDPA whose mask is a constant causal mask."""
        return node.target is _SDPA and _constant_causal_mask(node) is not None

    def saved_size(self, saver: fx.Node, operand: fx.Node | None, shape: tuple[int, ...], size: Size) -> Size:
        """The mask's copy ``saver`` keeps: nothing where the strategy keeps the sequence whole."""
        if operand is not None or not self.applies(saver) or shape != node_info(_constant_causal_mask(saver)).shape:
            return size
        return lambda s: 0 if _sequence_whole(s.inputs) else size(s)

    def apply(self, graph: fx.Graph, source_graph: fx.Graph, plan) -> int:
        causal = {n.name for n in source_graph.nodes if n.op == "call_function" and n.target is _SDPA
                  and n.name in plan.nodes and _sequence_whole(plan.nodes[n.name].input_specs) and self.applies(n)}
        count = 0
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is _SDPA and node.meta.get("source") in causal:
                mask = op_args(node).get("attn_mask")
                args, kwargs = list(node.args), dict(node.kwargs)
                if len(args) > 3:
                    args[3] = None
                kwargs.pop("attn_mask", None)
                node.args, node.kwargs = tuple(args), {**kwargs, "is_causal": True}
                if isinstance(mask, fx.Node):
                    _erase_unread(graph, mask)
                count += 1
        return count


def _sequence_whole(input_specs) -> bool:
    """SDPA's query, key and value (the first three of ``input_specs``) have no sequence dim
    split on any mesh axis."""
    return len(input_specs) >= 3 and not any(isinstance(p, Shard) and p.dim == _SEQUENCE_DIM
                                             for spec in input_specs[:3] for p in spec)


def _constant_causal_mask(sdpa: fx.Node) -> fx.Node | None:
    """The mask of captured SDPA node ``sdpa`` when it depends on nothing but constants and
    evaluates to the causal mask of a square ``[S, S]`` for every leading index; else ``None``.
    Evaluated once per node (the memory model asks while planning, the lowering after)."""
    mask = op_args(sdpa).get("attn_mask")
    if _CAUSAL not in sdpa.meta:
        sdpa.meta[_CAUSAL] = _is_causal(mask)
    return mask if sdpa.meta[_CAUSAL] else None


def _is_causal(mask) -> bool:
    value = _constant_value(mask) if isinstance(mask, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-1] != value.shape[-2]:
        return False
    below = torch.ones(value.shape[-2:], dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        return bool((value == below).all())
    if value.dtype.is_floating_point:
        return bool((value[..., below] == 0).all() and (value[..., ~below] == float("-inf")).all())
    return False


def _constant_value(node: fx.Node):
    """``node``'s value computed on the CPU when it and everything it reads are ``call_function``
    nodes without random draws (no input, parameter or buffer) and of at most ``_MAX_EVALUATED``
    elements each, else ``None``."""
    order = _constant_ancestry(node)
    if order is None:
        return None
    env: dict[fx.Node, object] = {}
    cpu = torch.device("cpu")
    for n in order:
        args, kwargs = pytree.tree_map(
            lambda a: env[a] if isinstance(a, fx.Node) else cpu if isinstance(a, torch.device) else a,
            (n.args, n.kwargs))
        env[n] = n.target(*args, **kwargs)
    return env[node]


def _constant_ancestry(node: fx.Node) -> list[fx.Node] | None:
    """``node`` and everything it reads, inputs first, when all are ``call_function`` nodes
    without random draws and of at most ``_MAX_EVALUATED`` elements; else ``None``."""
    order, done = [], set()

    def visit(n: fx.Node) -> bool:
        if n in done:
            return True
        if n.op != "call_function" or torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) \
                or any(t.numel() > _MAX_EVALUATED for t in pytree.tree_leaves(n.meta.get("val"))
                       if isinstance(t, torch.Tensor)):
            return False
        done.add(n)
        if not all(visit(x) for x in n.all_input_nodes):
            return False
        order.append(n)
        return True

    return order if visit(node) else None


def _erase_unread(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` if nothing reads it, then each of its inputs that is left unread the same
    way: ATen ops and the slice moves' pieces only (collectives, the runtime's other functions,
    placeholders and attributes stay). An input two erased nodes read is reached twice and erased
    once."""
    stack, erased = [node], set()
    while stack:
        n = stack.pop()
        aten_op = isinstance(n.target, torch._ops.OpOverload) and n.target.namespace == "aten"
        if n in erased or n.users or n.op != "call_function" or not (aten_op or n.target is local_piece):
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        erased.add(n)
        stack.extend(inputs)
