"""SplitOutput: how a parallel module returns an output its plan keeps split over the mesh.

It is a DTensor (``isinstance(x, DTensor)`` holds, ``.full_tensor()`` gives it whole) whose
failing ops say what to do: mixing it with a plain tensor (``F.cross_entropy(out.logits, labels)``)
or reading it as Python values (``.tolist()``) fails inside DTensor with a message that names
neither remedy; here the error gains a line naming ``.full_tensor()`` and
``outputs="replicated"``. The results of ops on it are SplitOutputs too, so the hint follows
the value through the user's loss code.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor

_HINTED = (RuntimeError, NotImplementedError, TypeError)
_HINT = ("\n(autoparallel: a module output used here is split over the device mesh, a DTensor with placements {placements}; "
         "call .full_tensor() on it to get the whole tensor on every rank, or plan with "
         "outputs=\"replicated\" so that the module returns every output whole)")


class SplitOutput(DTensor):
    """A DTensor returned by a parallel module; the same object as DTensor, plus the hint."""

    __slots__ = ()  # DTensor's layout: a DTensor made by an op becomes one by a class change

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            try:
                out = func(*args, **(kwargs or {}))
            except _HINTED as e:
                raise _with_hint(e, args, kwargs) from e
        return pytree.tree_map_only(DTensor, mark, out)


def mark(t: DTensor) -> DTensor:
    """``t`` as a :class:`SplitOutput` (in place: its class changes; same tensor)."""
    if type(t) is DTensor:
        t.__class__ = SplitOutput
    return t


def _with_hint(e: Exception, args, kwargs) -> Exception:
    """``e`` of the same type with the hint appended; ``e`` itself where its type cannot be
    rebuilt from one message."""
    split = [a for a in pytree.tree_leaves((args, kwargs or {})) if isinstance(a, SplitOutput)]
    placements = tuple(split[0].placements) if split else ()
    try:
        return type(e)(f"{e}" + _HINT.format(placements=placements))
    except Exception:  # an exception type whose constructor takes other arguments
        return e
