"""Capture under a mixed-precision policy (:mod:`autoparallel.precision`).

The model is captured as it computes under the policy: a meta-device copy whose floating
parameters are in ``param_dtype`` (:func:`half_skeleton`), on floating inputs in
``param_dtype`` when the policy casts them. Every op then has the dtypes it runs in
(half-precision matmuls, activations, softmax where the model upcasts it itself). The
captured graph is then given back its master copy (:func:`restore_master`): each cast
parameter is read in its own dtype again and cast by an ``aten._to_copy`` inserted before
its first user, each cast input arrives in the caller's dtype and is cast the same way, and
floating outputs are cast to ``output_dtype`` when the policy sets one.

Where the cast runs relative to a parameter's all-gather is the plan's choice of the cast
node's placement; the cast follows its parameter (it has one strategy per placement of
its input, :func:`~autoparallel.solver.problem._follow`), so it runs on the local
shard and the all-gather moves ``param_dtype`` bytes (docs/design.md, "Mixed precision").
"""

from __future__ import annotations

import copy

import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.distributed.fsdp import MixedPrecisionPolicy

from ..fqn import get_attr, set_attr

aten = torch.ops.aten


def half_skeleton(model: nn.Module, param_dtype: torch.dtype) -> tuple[nn.Module, dict[str, torch.dtype]]:
    """A copy of ``model`` on the meta device whose floating parameters are in ``param_dtype``
    (buffers keep their dtype, as FSDP2 leaves them; tied parameters stay one tensor), and
    each parameter name's dtype in ``model`` (the master dtype). No weight is copied.

    Raises:
        RuntimeError: ``copy.deepcopy`` of the model fails (an attribute that cannot be copied).
    """
    memo: dict[int, object] = {}
    master: dict[str, torch.dtype] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        master[name] = p.dtype
        if id(p) not in memo:
            dtype = param_dtype if p.is_floating_point() else p.dtype
            memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"), requires_grad=p.requires_grad)
    for _, b in model.named_buffers(remove_duplicate=False):
        memo.setdefault(id(b), torch.empty_like(b, device="meta"))
    try:
        return copy.deepcopy(model, memo), master
    except Exception as e:
        raise RuntimeError(f"capturing {type(model).__name__} under a mixed-precision policy copies it to the meta "
                           f"device, but copy.deepcopy failed: {type(e).__name__}: {e}; make the model's attributes "
                           "copyable, or pass mp_policy=None") from e


def half_inputs(meta_inputs, policy: MixedPrecisionPolicy):
    """``meta_inputs`` with floating tensors as meta tensors in ``param_dtype`` when the
    policy casts inputs (else unchanged)."""
    if not policy.cast_forward_inputs:
        return meta_inputs
    return pytree.tree_map_only(torch.Tensor, lambda t: torch.empty(tuple(t.shape), dtype=policy.param_dtype,
                                                                    device="meta") if t.is_floating_point() else t,
                                meta_inputs)


def _like(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor like ``val`` (a FakeTensor or a meta tensor) in ``dtype``."""
    mode = getattr(val, "fake_mode", None)
    if mode is None:
        return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=dtype, device="meta")
    with mode:
        return torch.empty_strided(tuple(val.shape), tuple(val.stride()), dtype=dtype, device=val.device)


def _cast_before_use(graph: fx.Graph, node: fx.Node, dtype: torch.dtype, cast_val: torch.Tensor) -> None:
    """Insert ``aten._to_copy(node, dtype=dtype)`` before the first user of ``node`` and read it
    there instead of ``node``; the cast takes that user's module stack (its layer)."""
    users = list(node.users)
    if not users:
        return
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(users, key=order.__getitem__)
    with graph.inserting_before(first):
        cast = graph.create_node("call_function", aten._to_copy.default, (node,), {"dtype": dtype},
                                 name=f"{node.name}_{dtype_tag(dtype)}")
    cast.meta = {"val": cast_val}
    if first.op != "output" and "nn_module_stack" in first.meta:
        cast.meta["nn_module_stack"] = dict(first.meta["nn_module_stack"])
    node.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not cast)


def dtype_tag(dtype: torch.dtype) -> str:
    """``bf16``, ``fp16``, ``fp32``: the suffix of a cast node's name."""
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(dtype, "cast")


def restore_master(traced, master: dict[str, torch.dtype], input_dtypes: list, policy: MixedPrecisionPolicy):
    """Turn the graph ``traced`` captured from :func:`half_skeleton` into the graph of the
    model under ``policy``, in place (module docstring).

    Args:
        traced: the :class:`~autoparallel.tracer.capture.TracedModel`.
        master: parameter name → its dtype in the model.
        input_dtypes: per flattened user input, the caller's dtype (``None`` for a non-tensor).
        policy: the policy it was captured under.
    """
    graph = traced.gm.graph
    for node in list(graph.nodes):
        if node.op == "get_attr" and node.target in traced.params:
            val, want = node.meta["val"], master[node.target]
            if val.dtype == want:
                continue
            p = get_attr(traced.gm, node.target)
            set_attr(traced.gm, node.target,
                     nn.Parameter(torch.empty(p.shape, dtype=want, device="meta"), requires_grad=p.requires_grad))
            node.meta["val"] = _like(val, want)
            _cast_before_use(graph, node, val.dtype, val)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for i, (node, dtype) in enumerate(zip(placeholders, input_dtypes)):
        val = node.meta.get("val")
        if dtype is None or not isinstance(val, torch.Tensor) or val.dtype == dtype:
            continue
        node.meta["val"] = _like(val, dtype)
        traced.input_meta[i] = (traced.input_meta[i][0], dtype)
        _cast_before_use(graph, node, val.dtype, val)
    if policy.output_dtype is not None:
        _cast_outputs(graph, len(traced.buffer_mutations), policy.output_dtype)
    graph.lint()
    traced.gm.recompile()


def _cast_outputs(graph: fx.Graph, n_buffers: int, dtype: torch.dtype) -> None:
    """Cast the floating user outputs (not the buffer write-backs, the last ``n_buffers``
    outputs) to ``dtype``."""
    out = graph.output_node()
    leaves = list(out.args[0])
    for i, x in enumerate(leaves[:len(leaves) - n_buffers]):
        val = x.meta.get("val") if isinstance(x, fx.Node) else None
        if not isinstance(val, torch.Tensor) or not val.is_floating_point() or val.dtype == dtype:
            continue
        with graph.inserting_before(out):
            cast = graph.create_node("call_function", aten._to_copy.default, (x,), {"dtype": dtype},
                                     name=f"{x.name}_{dtype_tag(dtype)}")
        cast.meta = {"val": _like(val, dtype)}
        leaves[i] = cast
    out.args = (tuple(leaves),)
