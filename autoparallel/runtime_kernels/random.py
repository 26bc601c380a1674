"""Random ops of the per-device graph: an independent stream for every distinct shard.

On one device, ``dropout`` draws one mask for the whole tensor. On a mesh, each device holds a
shard, and drawing the shard's mask from the device's default generator would repeat the same
mask on every shard (ranks are seeded alike, so that replicated tensors agree). The graph pass
:func:`~autoparallel.passes.dropout.shard_random_ops` replaces every random op by a function of
this module, called with

* ``seed``: one int64 drawn by :func:`draw_seed` from the default CPU generator at the top of the
  forward: one draw per forward on every rank, so the ranks' default generators stay in step;
* ``stream``: the op's number among the random ops of the graph (one stream per op);
* ``coord`` and ``strides``: this device's mesh coordinate (``mesh_coord``) and, per mesh axis, its
  weight in the linear index of this device's shard among the distinct shards of the op's
  output (0 on axes along which the output is replicated or a pending sum).

The op draws from a ``torch.Generator`` on the tensor's device seeded with
``mix(seed, stream, shard index)`` (SplitMix64). Hence: devices holding the same shard draw the
same values (a replicated tensor gets one mask), different shards draw independent values, the
distribution is the op's own (``dropout``: keep with probability 1 − p, scale kept values by
1/(1 − p), exactly as ``torch.nn.functional.dropout``), and the values depend on the seed, the op
and the shard only, so a checkpointed region recomputes exactly the masks of its forward (the
seed is drawn outside every region and reaches it as an input). The masks cannot equal one
device's bit for bit: one device draws one stream for the whole tensor.

Under simulated ranks (``LocalTensorMode``) ``seed`` and ``coord`` are LocalTensors: each
simulated rank's values are drawn from its own generator and wrapped into a LocalTensor, which
is what every rank computes in a real run.
"""

from __future__ import annotations

import math
import weakref
from typing import Callable, Sequence

import torch
from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode
from torch._subclasses.fake_tensor import is_fake

_M64 = (1 << 64) - 1
_coords: "weakref.WeakKeyDictionary[torch.Tensor, tuple[int, ...]]" = weakref.WeakKeyDictionary()


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def stream_seed(seed: int, stream: int, shard: int) -> int:
    """The generator seed of shard ``shard`` of random op ``stream`` under the forward's ``seed``:
    all 64 bits mixed (a CPU generator keeps only the low 32)."""
    return _splitmix64(_splitmix64(_splitmix64(seed & _M64) ^ stream) ^ shard)


def shard_strides(spec, mesh_shape: Sequence[int], dims: Sequence[int] | None = None) -> tuple[int, ...]:
    """Per mesh axis, its weight in the linear (row-major) index of a device's shard among the
    distinct shards of a tensor placed by ``spec``: ``index = sum(coord[a] * strides[a])``.
    Only ``Shard(d)`` placements with ``d`` in ``dims`` (all dims when ``None``) count; a tensor
    dim split over several axes is split in ascending axis order (DTensor's convention)."""
    from torch.distributed.tensor import Shard

    strides = [0] * len(mesh_shape)
    split = sorted({p.dim for p in spec if isinstance(p, Shard) and (dims is None or p.dim in dims)})
    mult = 1
    for d in reversed(split):
        for a in reversed([a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == d]):
            strides[a] = mult
            mult *= mesh_shape[a]
    return tuple(strides)


def draw_seed() -> torch.Tensor:
    """One int64 from the default CPU generator (a LocalTensor, one draw per simulated rank,
    under ``LocalTensorMode``)."""
    return torch.randint(0, 1 << 62, (1,), dtype=torch.int64)


def _coord_of(coord: torch.Tensor) -> tuple[int, ...]:
    """The mesh coordinate as ints, read once per coordinate tensor (no device sync per op)."""
    got = _coords.get(coord)
    if got is None:
        got = tuple(int(c) for c in coord.tolist())
        _coords[coord] = got
    return got


def _local(t, r: int):
    return t._local_tensors[r] if isinstance(t, LocalTensor) else t


def _per_shard(fn: Callable[..., torch.Tensor], seed, stream: int, coord, strides, *tensors) -> torch.Tensor:
    """``fn(generator, *tensors)`` on this device's shards, with the generator of the shard
    (per simulated rank under ``LocalTensorMode``). The result carries no autograd history."""
    ranks = next((set(t._local_tensors) for t in (coord, seed, *tensors) if isinstance(t, LocalTensor)), None)

    def run(s: torch.Tensor, c: tuple[int, ...], ts) -> torch.Tensor:
        dev = next((t.device for t in ts if isinstance(t, torch.Tensor)), torch.device("cpu"))
        index = sum(ci * st for ci, st in zip(c, strides))
        g = torch.Generator(device=dev)
        g.manual_seed(stream_seed(0 if is_fake(s) else int(s), stream, index))
        with torch.no_grad():
            return fn(g, *ts)

    if is_fake(seed):  # the graph runs on fake tensors for their shapes (codegen.pipeline.stage_io): no values
        return run(seed, (), tensors)
    if ranks is None:
        return run(seed, _coord_of(coord), tensors)
    with maybe_disable_local_tensor_mode():
        out = {r: run(_local(seed, r), tuple(int(c) for c in _local(coord, r).tolist()),
                      [_local(t, r) for t in tensors]) for r in sorted(ranks)}
        return LocalTensor(out)


def dropout(seed, stream: int, coord, strides, x: torch.Tensor, p: float, train: bool | None) -> torch.Tensor:
    """``aten.dropout(x, p, train)`` with the mask of this device's shard: zeros with probability
    ``p``, the rest scaled by 1/(1 − p) (the same noise as torch's dropout, multiplied in, so
    the backward multiplies by the same mask)."""
    if not train or p == 0 or x.numel() == 0:
        return x
    if p == 1:
        return x * torch.zeros((), dtype=x.dtype, device=x.device)
    noise = _per_shard(lambda g, t: torch.empty_like(t).bernoulli_(1 - p, generator=g).div_(1 - p),
                       seed, stream, coord, strides, x)
    return x * noise


def native_dropout(seed, stream: int, coord, strides, x: torch.Tensor, p: float,
                   train: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout(x, p, train)``: (output, keep mask) with the mask of this device's shard."""
    if train is False or p == 0:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    scale = 0.0 if p == 1 else 1.0 / (1 - p)
    mask = _per_shard(lambda g, t: torch.empty_like(t, dtype=torch.bool).bernoulli_(1 - p, generator=g),
                      seed, stream, coord, strides, x)
    return x.mul(mask).mul(scale), mask


def bernoulli(seed, stream: int, coord, strides, x: torch.Tensor, p: float | None = None,
              generator=None) -> torch.Tensor:
    """``aten.bernoulli(x)`` (probabilities ``x``) or ``aten.bernoulli.p(x, p)`` on this device's shard."""
    if p is None:
        return _per_shard(lambda g, t: torch.bernoulli(t, generator=g), seed, stream, coord, strides, x)
    return _per_shard(lambda g, t: torch.empty_like(t).bernoulli_(p, generator=g), seed, stream, coord, strides, x)


def rand_like(seed, stream: int, coord, strides, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """``aten.rand_like`` on this device's shard."""
    return _per_shard(lambda g, t: torch.rand_like(t, generator=g, **kwargs), seed, stream, coord, strides, x)


def randn_like(seed, stream: int, coord, strides, x: torch.Tensor, **kwargs) -> torch.Tensor:
    """``aten.randn_like`` on this device's shard."""
    return _per_shard(lambda g, t: torch.randn_like(t, generator=g, **kwargs), seed, stream, coord, strides, x)


def scaled_dot_product_attention(seed, stream: int, coord, strides, q, k, v, attn_mask=None,
                                 dropout_p: float = 0.0, is_causal: bool = False, *, scale=None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``aten.scaled_dot_product_attention`` with dropout on the attention weights, computed as
    its math reference does (softmax(q·kᵀ·scale + mask) with the dropout mask of this device's
    shard of the weights, then ·v). It materializes the weights, as the math backend does."""
    L, S = q.size(-2), k.size(-2)
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    if enable_gqa and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    attn = (q * math.sqrt(scale)) @ (k * math.sqrt(scale)).transpose(-2, -1)
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=q.device).tril()
        attn = attn.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn = attn.masked_fill(attn_mask.logical_not(), float("-inf"))
        else:
            attn = attn + attn_mask
    attn = torch.ops.aten._safe_softmax.default(attn, -1)
    attn = dropout(seed, stream, coord, strides, attn, dropout_p, True)
    return attn @ v
