"""What a model parallelized in place runs outside its per-device graphs: its own forward on
whole parameters (:class:`EagerRunner`), and the check that no optimizer steps the parameters
it replaced (:func:`retire`)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.utils.stateless import _reparametrize_module
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..errors import AutoParallelError


class EagerRunner:
    """Runs the model's own forward with its parameters and buffers whole: each DTensor
    gathered (``full_tensor()``, a collective every rank joins), plain tensors as they are.
    Under ``torch.no_grad()`` the gathered tensors are kept while no local shard changes
    (``generate`` reuses one gather for all its steps); with grad enabled they are gathered
    for the call, differentiably (DTensor's autograd takes each parameter's gradient back to
    its shard). For calls no per-device graph was made for; every rank then holds the whole
    model for the call.

    Attributes:
        refused: call keys whose capture failed: run eagerly from then on, not captured again.
    """

    def __init__(self):
        self._versions: tuple | None = None
        self._whole: dict[str, torch.Tensor] = {}
        self.refused: set = set()

    @contextlib.contextmanager
    def whole_state(self, model: nn.Module):
        """Within: ``model``'s parameters and buffers (every name) are whole tensors."""
        state = list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False))
        if torch.is_grad_enabled():
            whole = {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in state}
        else:
            whole = self._kept(state)
        with _reparametrize_module(model, whole):
            yield

    def _kept(self, state) -> dict[str, torch.Tensor]:
        versions = tuple((t.to_local() if isinstance(t, DTensor) else t)._version for _, t in state)
        if versions != self._versions:
            self._whole = {name: t.full_tensor() if isinstance(t, DTensor) else t.detach() for name, t in state}
            self._versions = versions
        return self._whole


_RETIRED = WeakIdKeyDictionary()  # parameter replaced by autoparallelize -> its name
_HOOK: list = []


def retire(param: torch.Tensor, name: str) -> None:
    """Mark ``param`` (named ``name``) as replaced by its distributed value: an optimizer that
    still holds it raises at its next ``step()`` (:func:`_refuse_retired`) instead of
    training a tensor the model no longer reads."""
    _RETIRED[param] = name
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_retired))


def _refuse_retired(optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook (every optimizer).

    Raises:
        AutoParallelError: the optimizer holds a parameter autoparallelize replaced."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p in _RETIRED:
                raise AutoParallelError(
                    f"{type(optimizer).__name__} holds parameter {_RETIRED[p]} as it was before autoparallelize "
                    "replaced it with its distributed value; stepping it would train nothing. Build the optimizer "
                    "after the call: optimizer = torch.optim.AdamW(model.parameters(), ...)")
