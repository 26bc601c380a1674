"""One rank's batch and the global batch (``inputs="local"``): every rank passes its own batch,
and the module computes on the ranks' batches concatenated along dim 0 in rank order. The
capture sees the global batch (:func:`global_batch`); the module checks calls against one
rank's shapes (:func:`local_input_meta`)."""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree


def global_batch(meta_inputs, world: int):
    """``meta_inputs`` (a dict of keyword arguments or a tuple of positional ones, one rank's
    shapes) with each tensor's dim 0 scaled by ``world``: the meta tensors of the global batch
    the capture and the plan are for. Non-tensor arguments are kept as they are.

    Raises:
        ValueError: a 0-d tensor (no batch dim to concatenate the ranks' batches along),
            naming the argument.
    """
    def scale(path, t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() == 0:
            name = pytree.keystr(path).strip("[]'\"") if isinstance(meta_inputs, dict) else \
                f"positional argument {pytree.keystr(path)}"
            raise ValueError(f"argument {name} is a 0-d tensor: under inputs='local' every tensor input is a "
                             "rank's own batch, concatenated with the other ranks' along dim 0; give it a batch "
                             "dim, or use inputs='global' (every rank passes the whole batch)")
        return torch.empty((t.shape[0] * world, *t.shape[1:]), dtype=t.dtype, device="meta")

    return pytree.tree_map_with_path(scale, meta_inputs)


def local_input_meta(input_meta, world: int) -> list:
    """A capture's ``input_meta`` (per flattened input, global ``(shape, dtype)`` or ``(None,
    value)``) with each tensor's dim 0 divided by ``world``: what one rank passes."""
    return [((shape[0] // world, *shape[1:]), dtype) if shape is not None else (shape, dtype)
            for shape, dtype in input_meta]


def microbatch(meta_inputs, microbatches: int):
    """``meta_inputs`` (global shapes) with each tensor's dim 0 divided by ``microbatches``:
    one microbatch of a pipelined plan (torch's schedules split every tensor along dim 0).

    Raises:
        ValueError: a tensor whose dim 0 ``microbatches`` does not divide, or a 0-d tensor."""
    def split(path, t):
        if not isinstance(t, torch.Tensor):
            return t
        if t.dim() == 0 or t.shape[0] % microbatches:
            raise ValueError(f"argument {pytree.keystr(path)} of shape {tuple(t.shape)} does not split into "
                             f"{microbatches} microbatches along dim 0; pick microbatches= dividing the batch")
        return torch.empty((t.shape[0] // microbatches, *t.shape[1:]), dtype=t.dtype, device="meta")

    return pytree.tree_map_with_path(split, meta_inputs)
