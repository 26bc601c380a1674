"""Routed-experts modules captured as one op, so that the planner can split them by expert.

A Hugging Face mixture-of-experts layer (transformers 5: Mixtral, Qwen2-MoE, Qwen3-MoE,
DeepSeek-V3, ...) keeps its routed experts in one module with 3-D weights, ``gate_up_proj``
``(E, 2I, H)`` (gate rows first) and ``down_proj`` ``(E, H, I)``, called as
``experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k))``. Captured as it runs, the
module is a sort of the (token, expert) pairs, a gather of the tokens, a grouped matmul per
projection and a scatter back: ops whose sharding cannot express "each device computes its own
experts' tokens". :func:`experts_as_one_op` makes such a module call
:data:`~autoparallel.runtime_kernels.experts.ROUTED_EXPERTS` while the model is captured, the
same function in one node (:mod:`autoparallel.strategies.moe` gives it expert parallelism).

A module qualifies when its layout is the one above: the ``has_gate``, ``is_concatenated``
flags set, ``has_bias``, ``is_transposed`` and ``has_post_expert_norm`` unset, the library's
own ``_apply_gate`` (``act(gate) * up``) and an activation of
:data:`~autoparallel.runtime_kernels.experts.ACTIVATIONS`. Any other is captured as it runs.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from ..runtime_kernels.experts import ROUTED_EXPERTS

log = logging.getLogger(__name__)

_ACTIVATION_NAMES = {"SiLU": "silu", "SiLUActivation": "silu", "ReLU": "relu", "GELUActivation": "gelu",
                     "GELU": "gelu", "GELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh",
                     "PytorchGELUTanh": "gelu_tanh", "GELUPytorchTanh": "gelu_tanh"}


def _activation(module: torch.nn.Module) -> str | None:
    """The experts' activation as the op names it, or ``None``."""
    act = getattr(module, "act_fn", None)
    name = _ACTIVATION_NAMES.get(type(act).__name__)
    if name == "gelu" and getattr(act, "approximate", "none") == "tanh":
        return "gelu_tanh"
    return name


def _default_gate(module: torch.nn.Module) -> bool:
    """The module gates with the library's ``act(gate) * up`` on the concatenated layout."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return False
    return getattr(type(module), "_apply_gate", None) is _default_apply_gate


def routed_experts_act(module: torch.nn.Module) -> str | None:
    """The activation name of ``module`` when it is a routed-experts module of the layout the
    module docstring describes, else ``None``."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gu, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter)
            and gu.dim() == 3 and down.dim() == 3):
        return None
    e, two_i, h = gu.shape
    if down.shape != (e, h, two_i // 2) or two_i % 2:
        return None
    flags = {"has_gate": True, "is_concatenated": True, "has_bias": False, "is_transposed": False,
             "has_post_expert_norm": False}
    if any(getattr(module, k, None) is not v for k, v in flags.items()) or not _default_gate(module):
        return None
    return _activation(module)


@contextlib.contextmanager
def experts_as_one_op(model: torch.nn.Module):
    """While the context is open, every routed-experts module of ``model`` (module docstring)
    runs as one :data:`ROUTED_EXPERTS` call; its own ``forward`` is restored on exit."""
    patched = []
    for path, module in model.named_modules():
        act = routed_experts_act(module)
        if act is None:
            continue

        def forward(hidden_states, top_k_index, top_k_weights, m=module, act=act):
            return ROUTED_EXPERTS(hidden_states, top_k_index, top_k_weights, m.gate_up_proj, m.down_proj, act)

        had = "forward" in module.__dict__
        patched.append((module, had, module.__dict__.get("forward")))
        module.forward = forward
        log.debug("capturing %s as one routed-experts op", path or type(module).__name__)
    try:
        yield len(patched)
    finally:
        for module, had, old in patched:
            if had:
                module.forward = old
            else:
                del module.forward
