"""A causal attention mask computed from constants becomes SDPA's ``is_causal`` flag.

Under ``torch.export`` transformers cannot prove the causal mask redundant (that needs the
values of the padding mask), so the captured graph builds it every step from ``arange``s and
hands it to ``scaled_dot_product_attention`` as ``attn_mask``; in eager, with no padding mask,
transformers calls SDPA with ``is_causal=True`` and no mask, which its kernels run faster (on the
2-core test VM, 3.2 against 3.5 ms a Llama-class layer's attention forward and backward) and
without the mask's ops.

:func:`causal_masks_as_flags` evaluates, once and at emission, every SDPA mask of the captured
graph that depends on no input, parameter or buffer, and where it is exactly the causal mask
(``True``, or ``0.0``, on and below the diagonal of a square ``[S, S]``, ``False`` or ``-inf``
above, for every batch and head) and the plan keeps the sequence dims whole on every device,
rewrites the per-device SDPA to ``is_causal=True`` without the mask; the mask's ops, now unread,
are removed. The mask being a constant, the check is the proof: nothing the model is given can
change it. Masks (and the tensors they are computed from) of more than 2**24 elements are not
evaluated and stay as they are.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Shard

from ..graph import op_args

aten = torch.ops.aten
_SDPA = aten.scaled_dot_product_attention.default
_SEQUENCE_DIM = 2  # of SDPA's [B, H, S, D] operands
# Largest tensor evaluated to prove a mask causal: planning at LLM scale (a [B, 1, S, S] mask of
# 8 × 8192²) must not allocate it; such a mask is left as it is.
_MAX_EVALUATED = 2**24


def causal_masks_as_flags(graph: fx.Graph, traced: fx.Graph, plan) -> int:
    """Rewrite, in place, the SDPAs of the per-device ``graph`` (nodes name their traced node in
    ``meta["source"]``) whose traced mask is a constant causal mask (module docstring); ``plan``
    gives the placements of each SDPA's operands. Returns how many were rewritten; the caller
    recompiles."""
    index = {n: i for i, n in enumerate(traced.nodes)}
    causal = {n.name for n in traced.nodes if n.op == "call_function" and n.target is _SDPA and n.name in plan.nodes
              and sequence_whole(plan.nodes[n.name].input_specs) and constant_causal_mask(n, index) is not None}
    count = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is _SDPA and node.meta.get("source") in causal:
            mask = _mask_of(node)
            args, kwargs = list(node.args), dict(node.kwargs)
            if len(args) > 3:
                args[3] = None
            kwargs.pop("attn_mask", None)
            node.args, node.kwargs = tuple(args), {**kwargs, "is_causal": True}
            if isinstance(mask, fx.Node):
                _erase_unread(graph, mask)
            count += 1
    return count


def _mask_of(node: fx.Node):
    return op_args(node).get("attn_mask")


def sequence_whole(input_specs) -> bool:
    """SDPA's query, key and value (the first three of ``input_specs``) have no sequence dim
    split on any mesh axis."""
    return len(input_specs) >= 3 and not any(isinstance(p, Shard) and p.dim == _SEQUENCE_DIM
                                             for spec in input_specs[:3] for p in spec)


def constant_causal_mask(sdpa: fx.Node, index: dict[fx.Node, int]) -> fx.Node | None:
    """The mask of captured SDPA node ``sdpa`` (``index``: the captured graph's order) when it
    depends on nothing but constants and evaluates to the causal mask of a square ``[S, S]`` for
    every leading index; else ``None``."""
    mask = _mask_of(sdpa)
    value = _constant_value(mask, index) if isinstance(mask, fx.Node) else None
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[-1] != value.shape[-2]:
        return None
    below = torch.ones(value.shape[-2:], dtype=torch.bool).tril()
    if value.dtype == torch.bool:
        causal = bool((value == below).all())
    elif value.dtype.is_floating_point:
        causal = bool((value[..., below] == 0).all() and (value[..., ~below] == float("-inf")).all())
    else:
        causal = False
    return mask if causal else None


def _constant_value(node: fx.Node, index: dict[fx.Node, int]):
    """``node``'s value computed on the CPU when it and everything it reads are ``call_function``
    nodes without random draws (no input, parameter or buffer) and of at most ``_MAX_EVALUATED``
    elements each, else ``None``."""
    order, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        if n.op != "call_function" or torch.Tag.nondeterministic_seeded in getattr(n.target, "tags", ()) \
                or any(t.numel() > _MAX_EVALUATED for t in pytree.tree_leaves(n.meta.get("val"))
                       if isinstance(t, torch.Tensor)):
            return None
        seen.add(n)
        order.append(n)
        stack.extend(n.all_input_nodes)
    env: dict[fx.Node, object] = {}
    cpu = torch.device("cpu")
    for n in sorted(order, key=index.__getitem__):
        args, kwargs = pytree.tree_map(
            lambda a: env[a] if isinstance(a, fx.Node) else cpu if isinstance(a, torch.device) else a,
            (n.args, n.kwargs))
        env[n] = n.target(*args, **kwargs)
    return env[node]


def _erase_unread(graph: fx.Graph, node: fx.Node) -> None:
    """Erase ``node`` if nothing reads it, then each of its inputs that is left unread the same
    way: ATen ops only (collectives, the runtime's functions, placeholders and attributes stay)."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload) \
                or n.target.namespace != "aten":
            continue
        inputs = n.all_input_nodes
        graph.erase_node(n)
        stack.extend(inputs)
