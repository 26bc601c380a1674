"""Triton kernels of the vocab-parallel cross-entropy's local steps (the maths and the
torch code they match: :mod:`.cross_entropy`).

One program per row of the local logits ``(M, C_local)`` (contiguous rows), walking the
row in blocks of ``BLOCK`` classes: a single pass for the statistics (an online maximum
with the running sum rescaled, as in Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax", §3) and for the loss; the gradient kernel also splits the row
over a second grid axis. Everything accumulates in float32 whatever the logits' dtype.
``first`` (this device's first class) and the weight's sum are read from device memory,
so no host synchronization is needed. On CPU they run under ``TRITON_INTERPRET=1`` (the
test suite's small shapes); the runtime uses them for CUDA tensors only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 4096


def _block(n_local: int) -> int:
    return min(triton.next_power_of_2(n_local), _MAX_BLOCK)


@triton.jit
def _stats_kernel(x_ptr, m_ptr, s_ptr, n_local, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_local
    cols = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    for start in range(0, n_local, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < n_local, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    tl.store(m_ptr + row, m)
    tl.store(s_ptr + row, s)


@triton.jit
def _loss_kernel(x_ptr, t_ptr, w_ptr, lse_ptr, first_ptr, out_ptr, n_local, n_classes, ignore_index, smoothing,
                 HAS_WEIGHT: tl.constexpr, SMOOTH: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * n_local
    t = tl.load(t_ptr + row)
    first = tl.load(first_ptr)
    lse = tl.load(lse_ptr + row)
    kept = t != ignore_index
    local = t - first
    own = kept & (local >= 0) & (local < n_local)
    x_t = tl.load(x_row + local, mask=own, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        w_t = tl.load(w_ptr + t, mask=kept, other=0.0).to(tl.float32)
    else:
        w_t = kept.to(tl.float32)
    loss = tl.where(own, (1 - smoothing) * w_t * (lse - x_t), 0.0)
    if SMOOTH:
        cols = tl.arange(0, BLOCK)
        wx = tl.zeros((), tl.float32)
        w_local = tl.zeros((), tl.float32)
        for start in range(0, n_local, BLOCK):
            inside = start + cols < n_local
            x = tl.load(x_row + start + cols, mask=inside, other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                w = tl.load(w_ptr + first + start + cols, mask=inside, other=0.0).to(tl.float32)
            else:
                w = inside.to(tl.float32)
            wx += tl.sum(w * x, axis=0)
            w_local += tl.sum(w, axis=0)
        loss += tl.where(kept, smoothing / n_classes * (w_local * lse - wx), 0.0)
    tl.store(out_ptr + row, loss)


@triton.jit
def _grad_kernel(x_ptr, t_ptr, w_ptr, w_sum_ptr, lse_ptr, first_ptr, g_ptr, dx_ptr, n_local, n_classes,
                 ignore_index, smoothing, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n_local
    t = tl.load(t_ptr + row)
    first = tl.load(first_ptr)
    kept = t != ignore_index
    local = t - first
    g = tl.where(kept, tl.load(g_ptr + row).to(tl.float32), 0.0)
    if HAS_WEIGHT:
        w_t = tl.load(w_ptr + t, mask=kept, other=0.0).to(tl.float32)
        w_sum = tl.load(w_sum_ptr).to(tl.float32)
        w = tl.load(w_ptr + first + cols, mask=inside, other=0.0).to(tl.float32)
    else:
        w_t = kept.to(tl.float32)
        w_sum = n_classes * 1.0
        w = 1.0
    x = tl.load(x_ptr + row * n_local + cols, mask=inside, other=0.0).to(tl.float32)
    p = tl.exp(x - tl.load(lse_ptr + row))
    coef = (1 - smoothing) * w_t + smoothing / n_classes * w_sum
    d = coef * p - smoothing / n_classes * w - tl.where(cols == local, (1 - smoothing) * w_t, 0.0)
    tl.store(dx_ptr + row * n_local + cols, g * d, mask=inside)


def triton_logsumexp_stats(xr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.cross_entropy.torch_logsumexp_stats` as a triton kernel (``xr`` contiguous)."""
    rows, n_local = xr.shape
    m = torch.empty(rows, dtype=torch.float32, device=xr.device)
    s = torch.empty_like(m)
    if rows:
        _stats_kernel[(rows,)](xr, m, s, n_local, BLOCK=_block(n_local))
    return m, s


def triton_loss(xr, t, weight, lse, first, n_classes: int, ignore_index: int, smoothing: float) -> torch.Tensor:
    """:func:`.cross_entropy.torch_loss` as a triton kernel (``xr`` contiguous)."""
    rows, n_local = xr.shape
    out = torch.empty(rows, dtype=torch.float32, device=xr.device)
    if rows:
        _loss_kernel[(rows,)](xr, t.contiguous(), xr if weight is None else weight.contiguous(), lse.contiguous(),
                              first, out, n_local, n_classes, ignore_index, smoothing,
                              HAS_WEIGHT=weight is not None, SMOOTH=smoothing != 0, BLOCK=_block(n_local))
    return out


def triton_grad(xr, t, weight, lse, first, grad, n_classes: int, ignore_index: int,
                smoothing: float) -> torch.Tensor:
    """:func:`.cross_entropy.torch_grad` as a triton kernel (``xr`` contiguous), float32."""
    rows, n_local = xr.shape
    dx = torch.empty(rows, n_local, dtype=torch.float32, device=xr.device)
    block = _block(n_local)
    if rows:
        w = xr if weight is None else weight.contiguous()
        w_sum = lse if weight is None else weight.float().sum().reshape(1)
        _grad_kernel[(rows, triton.cdiv(n_local, block))](
            xr, t.contiguous(), w, w_sum, lse.contiguous(), first, grad.contiguous(), dx, n_local, n_classes,
            ignore_index, smoothing, HAS_WEIGHT=weight is not None, BLOCK=block)
    return dx
