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

from ..attention import SDPA as _SDPA
from ..attention import constant_causal_mask, sequence_whole
from ..graph import op_args


def causal_masks_as_flags(graph: fx.Graph, traced: fx.Graph, plan) -> int:
    """Rewrite, in place, the SDPAs of the per-device ``graph`` (nodes name their traced node in
    ``meta["source"]``) whose traced mask is a constant causal mask (module docstring); ``plan``
    gives the placements of each SDPA's operands. Returns how many were rewritten; the caller
    recompiles."""
    causal = {n.name for n in traced.nodes if n.op == "call_function" and n.target is _SDPA and n.name in plan.nodes
              and sequence_whole(plan.nodes[n.name].input_specs) and constant_causal_mask(n) is not None}
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
