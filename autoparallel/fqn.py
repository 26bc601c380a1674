"""Read and write tensors on an ``nn.Module`` tree by fully qualified name ("a.b.weight")."""

from __future__ import annotations

import torch
import torch.nn as nn


def get_attr(root: nn.Module, fqn: str):
    """``root.a.b.weight`` for ``fqn == "a.b.weight"``."""
    obj = root
    for part in fqn.split("."):
        obj = getattr(obj, part)
    return obj


def set_attr(root: nn.Module, fqn: str, value: torch.Tensor, persistent: bool = True) -> None:
    """Register ``value`` at ``fqn``, creating empty container modules on the way; an
    ``nn.Parameter`` is registered as a parameter, anything else as a buffer (left out of
    ``state_dict()`` when not ``persistent``)."""
    *path, leaf = fqn.split(".")
    mod = root
    for part in path:
        if part not in mod._modules:
            mod.add_module(part, nn.Module())
        mod = mod._modules[part]
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    else:
        mod.register_buffer(leaf, value, persistent=persistent)
