"""Forms of attention in a captured graph that the emitted module runs otherwise.

The per-device graph hands SDPA its key and value unrepeated (``passes.gqa``) and a constant
causal mask as ``is_causal`` (``passes.causal_mask``); the memory model counts what that graph
keeps for the backward. Both ask here which SDPA nodes of the captured graph have those forms.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.distributed.tensor import Shard

from .graph import op_args

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_RESHAPES = (aten.reshape.default, aten._unsafe_view.default, aten.view.default)
_SEQUENCE_DIM = 2  # of SDPA's [B, H, S, D] operands
_CAUSAL = "autoparallel_causal_mask"  # node.meta key: whether constant_causal_mask found the mask causal
# Largest tensor evaluated to prove a mask causal: planning at LLM scale (a [B, 1, S, S] mask of
# 8 × 8192²) must not allocate it; such a mask is left as it is.
_MAX_EVALUATED = 2**24


def repeated_kv(sdpa: fx.Node) -> dict[fx.Node, int]:
    """On the captured graph: ``{key: n, value: n}`` when SDPA node ``sdpa`` reads its key and
    value repeated ``n`` times per query head, which ``passes.gqa.fold_repeated_kv`` gives it
    unrepeated in the emitted graph (so it keeps ``1/n`` of them for the backward); else empty."""
    if sdpa.target is not SDPA or len(sdpa.args) < 3:
        return {}
    kv = sdpa.args[1:3]
    if any(repeated_kv_source(x) is None for x in kv):
        return {}
    n = {x.args[0].args[1][2] for x in kv}
    return dict.fromkeys(kv, n.pop()) if len(n) == 1 else {}


def repeated_kv_source(node) -> fx.Node | None:
    """On the captured graph: the ``[B, KV, S, D]`` node that key or value ``node`` repeats per
    query head (``reshape(expand(unsqueeze(x, 2), [B, KV, n, S, D]), [B, KV·n, S, D])``); else
    ``None``."""
    chain = repeat_chain(node)
    if chain is None:
        return None
    unsqueeze = chain[1].args[0]
    if not (isinstance(unsqueeze, fx.Node) and unsqueeze.target is aten.unsqueeze.default and unsqueeze.args[1] == 2):
        return None
    return unsqueeze.args[0]


def repeat_chain(node):
    """``(reshape, expand)`` when ``node`` is ``reshape(expand(·, [B, KV, n, S, D]), [B, KV·n, S, D])``
    with static sizes, each read only by the next; else ``None``."""
    reshape = node
    if not (isinstance(reshape, fx.Node) and reshape.op == "call_function" and reshape.target in _RESHAPES
            and len(reshape.users) == 1):
        return None
    expand = reshape.args[0]
    if not (isinstance(expand, fx.Node) and expand.op == "call_function" and expand.target is aten.expand.default
            and len(expand.users) == 1):
        return None
    sizes, shape = list(expand.args[1]), list(reshape.args[1])
    if len(sizes) != 5 or len(shape) != 4 or not all(type(s) is int and s > 0 for s in sizes + shape):
        return None
    b, kv, n, s, d = sizes
    return (reshape, expand) if shape == [b, kv * n, s, d] else None


def _mask_of(node: fx.Node):
    return op_args(node).get("attn_mask")


def sequence_whole(input_specs) -> bool:
    """SDPA's query, key and value (the first three of ``input_specs``) have no sequence dim
    split on any mesh axis."""
    return len(input_specs) >= 3 and not any(isinstance(p, Shard) and p.dim == _SEQUENCE_DIM
                                             for spec in input_specs[:3] for p in spec)


def constant_causal_mask(sdpa: fx.Node) -> fx.Node | None:
    """The mask of captured SDPA node ``sdpa`` when it depends on nothing but constants and
    evaluates to the causal mask of a square ``[S, S]`` for every leading index; else ``None``.
    Evaluated once per node (the memory model asks while planning, the emission after)."""
    mask = _mask_of(sdpa)
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
