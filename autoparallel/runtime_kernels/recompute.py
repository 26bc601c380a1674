"""Selective activation recomputation: keep the outputs of matmuls and attention, recompute
the rest.

A selective region runs under non-reentrant ``torch.utils.checkpoint`` with torch's
selective-checkpoint contexts (``create_selective_checkpoint_contexts``): during the forward,
the outputs of the ops in :data:`SAVED_OPS` are cached; in the backward the region is run
again, those ops return their cached outputs and every other op (pointwise ops, norms,
views, collectives) is recomputed. The policy is torchtitan's selective activation
checkpointing by op (save matmul and attention outputs; Korthikanti et al., "Reducing
Activation Recomputation in Large Transformer Models", arXiv 2205.05198, §4.2, recompute the
cheap, memory-heavy ops). Collectives are recomputed like the other ops, as in a full
checkpoint region.

:data:`SAVED_TARGETS` names the same ops at the level of the captured graph, where the
memory model counts what a selective region keeps: a captured ``aten.linear`` runs as
``aten.mm``/``aten.addmm`` and ``aten.scaled_dot_product_attention`` as one of its fused
kernels, whose outputs the policy saves.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

aten = torch.ops.aten

SAVED_TARGETS = frozenset({
    aten.linear.default, aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.matmul.default, aten.scaled_dot_product_attention.default, aten.convolution.default,
    aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
})
"""Ops of the captured graph whose outputs a selective region keeps (bytes counted by
:func:`autoparallel.solver.remat.build_chain`)."""

SAVED_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.convolution.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
})
"""Ops, as the dispatcher runs them, whose outputs a selective region caches."""


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_contexts = functools.partial(create_selective_checkpoint_contexts, _policy)


def selective_checkpoint(fn, *args):
    """``fn(*args)`` under non-reentrant checkpointing that keeps the outputs of
    :data:`SAVED_OPS` and recomputes every other op in the backward (module docstring).
    The RNG state is restored for the recompute, as with a full checkpoint region."""
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=_contexts)
