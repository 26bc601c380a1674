"""Mixed precision: the policy a plan is made and run under.

The policy is torch's FSDP2 :class:`torch.distributed.fsdp.MixedPrecisionPolicy`
(``param_dtype``, ``reduce_dtype``, ``output_dtype``, ``cast_forward_inputs``), with its
meaning (Micikevicius et al., "Mixed Precision Training", ICLR 2018, §3.1: an fp32 master
copy of the weights, half-precision forward and backward):

* the module's parameters, their ``.grad`` and so the optimizer states stay in the model's
  dtype (fp32 master weights);
* the forward computes with every floating parameter cast to ``param_dtype``: the captured
  graph reads the fp32 parameter and casts it (``aten._to_copy``) right after, so FLOPs,
  activation bytes and activation collectives are priced in ``param_dtype``
  (:func:`autoparallel.tracer.capture.ColoTracer`);
* floating inputs are cast to ``param_dtype`` when ``cast_forward_inputs`` (FSDP2's
  default), floating outputs to ``output_dtype`` when it is set;
* gradients of parameters replicated along mesh axes are all-reduced in
  :func:`reduce_dtype` and added into the fp32 ``.grad``
  (:mod:`autoparallel.runtime_kernels.grad_reduction`); those of parameters kept sharded and
  all-gathered in ``param_dtype`` are reduce-scattered in it
  (:func:`~autoparallel.runtime_kernels.param_all_gather`, :func:`gathered_cast`).

``None`` (the default everywhere) means no policy: the model runs in the dtypes it has, and
a model already in bf16 is planned and priced in bf16.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.fsdp import MixedPrecisionPolicy

from .graph import alias_base

HALF = (torch.bfloat16, torch.float16)
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, *HALF)}


def check_policy(mp_policy) -> MixedPrecisionPolicy | None:
    """``mp_policy`` as a policy, or ``None`` when it changes nothing (``None``, or a
    policy whose ``param_dtype`` and ``output_dtype`` are unset and whose ``reduce_dtype``
    is unset: every dtype the model's own).

    Raises:
        TypeError: not a ``MixedPrecisionPolicy`` or ``None``.
        ValueError: a dtype that is not floating (``torch.float32``, ``float64``,
            ``bfloat16`` or ``float16``), or a ``reduce_dtype`` without ``param_dtype``.
    """
    if mp_policy is None:
        return None
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
                        f"not {type(mp_policy).__name__}")
    for what in ("param_dtype", "reduce_dtype", "output_dtype"):
        d = getattr(mp_policy, what)
        if d is not None and d not in _DTYPES.values():
            raise ValueError(f"mp_policy.{what} must be one of torch.{', torch.'.join(_DTYPES)} or None, not {d!r}")
    if mp_policy.param_dtype is None and mp_policy.reduce_dtype is not None:
        raise ValueError("mp_policy.reduce_dtype needs a param_dtype: without one the gradients are computed and "
                         "reduced in the parameters' own dtype; set param_dtype=torch.bfloat16 (or float16)")
    if mp_policy.param_dtype is None and mp_policy.output_dtype is None:
        return None
    return mp_policy


def reduce_dtype(policy: MixedPrecisionPolicy | None) -> torch.dtype | None:
    """The dtype gradients are all-reduced in: ``reduce_dtype``, else ``param_dtype`` (as
    FSDP2 does: "if None but param_dtype is not None, the reduction uses the compute dtype");
    ``None`` without a policy (the gradient's own dtype)."""
    if policy is None:
        return None
    return policy.reduce_dtype or policy.param_dtype


def gathered_cast(x: fx.Node, reduce_in: torch.dtype | None) -> fx.Node | None:
    """The policy's cast of a trainable parameter (``aten._to_copy`` of its ``get_attr`` or of
    a view of it, :mod:`autoparallel.tracer.casts`) when ``x`` is that cast or a view of it
    and its gradient, reduced in ``reduce_in`` (:func:`reduce_dtype`), is not in ``x``'s
    dtype; else ``None``. An all-gather of such a value is emitted as
    :func:`~autoparallel.runtime_kernels.param_all_gather` (its gradient reduce-scattered
    in ``reduce_in``, not in the gathered dtype) and priced so by the planner."""
    val = x.meta.get("val")
    if reduce_in is None or not isinstance(val, torch.Tensor) or val.dtype == reduce_in:
        return None
    cast = alias_base(x)
    if cast.op != "call_function" or cast.target is not torch.ops.aten._to_copy.default:
        return None
    param = alias_base(cast.args[0]) if isinstance(cast.args[0], fx.Node) else None  # through a fused weight's slice
    info = param.meta.get("autoparallel") if param is not None and param.op == "get_attr" else None
    return cast if info is not None and info.requires_grad else None


def policy_to_json(policy: MixedPrecisionPolicy | None) -> dict | None:
    """The policy as JSON-ready data: dtypes by name (``"bfloat16"``), ``None`` for no policy."""
    if policy is None:
        return None
    return {"param_dtype": _name(policy.param_dtype), "reduce_dtype": _name(policy.reduce_dtype),
            "output_dtype": _name(policy.output_dtype), "cast_forward_inputs": policy.cast_forward_inputs}


def policy_from_json(d) -> MixedPrecisionPolicy | None:
    """Inverse of :func:`policy_to_json`.

    Raises:
        ValueError: not ``None`` or an object with exactly the four fields, an unknown dtype name.
    """
    if d is None:
        return None
    names = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if not isinstance(d, dict) or set(d) != set(names) or not isinstance(d["cast_forward_inputs"], bool):
        raise ValueError(f"a mixed-precision policy is null or an object with the fields {names} "
                         f"(dtype names or null, and a boolean), not {d!r}")
    dtypes = {}
    for k in names[:3]:
        if d[k] is not None and d[k] not in _DTYPES:
            raise ValueError(f"mixed-precision policy: {k} {d[k]!r} is not one of {sorted(_DTYPES)} or null")
        dtypes[k] = _DTYPES[d[k]] if d[k] is not None else None
    return MixedPrecisionPolicy(**dtypes, cast_forward_inputs=d["cast_forward_inputs"])


def describe(policy: MixedPrecisionPolicy | None) -> str:
    """One line for the plan's table: ``params bf16 (fp32 master), gradients reduced in fp32``."""
    if policy is None:
        return "no mixed-precision policy (the model's dtypes)"
    parts = []
    if policy.param_dtype is not None:
        parts.append(f"compute in {_name(policy.param_dtype)} (parameters cast in the forward, master copy "
                     f"kept), gradients reduced in {_name(reduce_dtype(policy))}")
    if policy.output_dtype is not None:
        parts.append(f"outputs in {_name(policy.output_dtype)}")
    return "mixed precision: " + ", ".join(parts)


def _name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")
