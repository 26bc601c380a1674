"""Softmax cross-entropy kernels of the per-device graph: vocab-parallel, and over whole classes.

:func:`cross_entropy_loss` is torch's loss over whole classes with a one-pass backward (its
docstring). The rest of this module is the vocab-parallel loss, the local parts of
Megatron-LM's parallel loss.

Shoeybi et al. 2019 (Megatron-LM, §3) compute the softmax cross-entropy of logits whose
class (vocabulary) dim is split across devices without gathering them: each device takes
the row maximum and the sum of exponentials over its own classes, two all-reduces (max,
then sum) give every device the row's log-sum-exp, and the target's logit comes from the
device that owns it. Here the collectives are ``_c10d_functional`` all-reduces in the
emitted graph, between the two local steps of this module
(:func:`~autoparallel.strategies.losses.local_cross_entropy` emits them):

1. :func:`local_logsumexp`: per row, this device's maximum ``m`` and ``Σ exp(x - m)``.
2. all-reduce max of ``m`` → ``M``; all-reduce sum of ``s · exp(m - M)`` → ``S``;
   ``lse = M + log S``.
3. :func:`vocab_parallel_cross_entropy`: this device's share of each row's loss (the
   devices' shares sum to torch's ``cross_entropy`` with ``reduction='none'``: a
   ``Partial`` value), with a backward that is exact and local (softmax minus one-hot,
   no collective).

For a row with target ``t`` (not ``ignore_index``), class weights ``w`` (ones without a
weight), ``W = Σ_c w_c``, ``C`` classes and smoothing ``ε``, torch computes
(``aten/src/ATen/native/LossNLL.cpp``, ``cross_entropy_loss_label_smoothing``)::

    loss = (1 - ε) · w_t · (lse - x_t) + ε / C · (W · lse - Σ_c w_c x_c)

and 0 for an ignored row. A device's share keeps the terms of its own classes: the first
term where it owns ``t``, and ``W_local · lse - Σ_{c local} w_c x_c`` of the second. The
gradient with respect to a local logit is::

    ∂loss/∂x_c = ((1 - ε) · w_t + ε / C · W) · softmax_c - (1 - ε) · w_t · [c = t] - ε / C · w_c

which needs only ``lse`` and the (replicated) weight. On CUDA the three steps run as triton
kernels (:mod:`.cross_entropy_triton`); elsewhere as the torch code below.
"""

from __future__ import annotations

import torch

__all__ = ["cross_entropy_loss", "local_logsumexp", "vocab_parallel_cross_entropy"]


def _use_triton(x: torch.Tensor) -> bool:
    """Triton kernels for CUDA tensors when triton is installed; torch code otherwise."""
    if not x.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _rows(x: torch.Tensor) -> torch.Tensor:
    """Logits ``(N, C_local, d1, ...)`` (or ``(N, C_local)``) as contiguous rows ``(M, C_local)``
    (copied before the view: ``reshape`` of the moved dims on per-rank sizes fails under
    simulated ranks)."""
    return x.movedim(1, -1).contiguous().view(-1, x.shape[1]) if x.dim() > 2 else x.contiguous()


def _unrows(g: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_rows`: rows ``(M, C_local)`` back in the layout of ``like``."""
    if like.dim() <= 2:
        return g.view(like.shape)
    return g.view(like.shape[0], *like.shape[2:], like.shape[1]).movedim(-1, 1)


# ---------------------------------------------------------------- torch code
def torch_logsumexp_stats(xr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row maximum ``m`` and ``Σ exp(x - m)`` of rows ``(M, C_local)``, float32 ``(M,)`` each."""
    x = xr.float()
    m = x.amax(dim=1)
    return m, torch.exp(x - m[:, None]).sum(dim=1)


def _weights(weight, t, kept, first, n_local: int, n_classes: int):
    """``(w_t, w_local, W)``: the target's class weight per row (0 when ignored), the weights
    of the local classes ``(n_local,)`` and their global sum; ones without a weight
    (``w_local`` is then ``None``). ``n_local`` may differ by device (``torch.chunk`` pieces:
    under simulated ranks a per-rank ``SymInt``), so nothing here turns it into a float."""
    if weight is None:
        return kept.float(), None, float(n_classes)
    w = weight.float()
    w_t = w[torch.where(kept, t, 0)] * kept
    w_local = w.index_select(0, first + torch.arange(n_local, device=w.device))
    return w_t, w_local, w.sum()


def torch_loss(xr, t, weight, lse, first, n_classes: int, ignore_index: int, smoothing: float) -> torch.Tensor:
    """This device's share of each row's loss (module docstring), float32 ``(M,)``."""
    x = xr.float()
    kept = t != ignore_index
    local = t - first
    own = kept & (local >= 0) & (local < x.shape[1])
    x_t = x.gather(1, torch.where(own, local, 0)[:, None]).squeeze(1)
    w_t, w_local, _ = _weights(weight, t, kept, first, x.shape[1], n_classes)
    loss = (1 - smoothing) * torch.where(own, w_t * (lse - x_t), 0.0)
    if smoothing:  # Σ_{c local} w_c (lse - x_c): W_local · lse - Σ w_c x_c without counting the classes
        gap = lse[:, None] - x
        spread = gap.sum(1) if w_local is None else gap @ w_local
        loss = loss + smoothing / n_classes * torch.where(kept, spread, 0.0)
    return loss


def torch_grad(xr, t, weight, lse, first, grad, n_classes: int, ignore_index: int, smoothing: float) -> torch.Tensor:
    """Gradient of the summed loss with respect to the local logits ``(M, C_local)``, given
    ``grad`` ``(M,)``, the gradient of each row's (global) loss (module docstring)."""
    x = xr.float()
    kept = t != ignore_index
    local = t - first
    own = kept & (local >= 0) & (local < x.shape[1])
    w_t, w_local, w_sum = _weights(weight, t, kept, first, x.shape[1], n_classes)
    g = torch.where(kept, grad.float(), 0.0)
    coef = (1 - smoothing) * w_t + smoothing / n_classes * w_sum
    d = coef[:, None] * torch.exp(x - lse[:, None])
    if smoothing:
        d = d - smoothing / n_classes * (1.0 if w_local is None else w_local.unsqueeze(0))
    d = d * g[:, None]
    hit = torch.where(own, (1 - smoothing) * w_t * g, 0.0)
    return d.scatter_add(1, torch.where(own, local, 0)[:, None], -hit[:, None])


# ---------------------------------------------------------------- entry points
def local_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the local logits, the maximum ``m`` over this device's classes and
    ``Σ exp(x - m)`` over them.

    Args:
        x: local logits ``(N, C_local)`` or ``(N, C_local, d1, ...)`` (classes in dim 1).

    Returns:
        ``(m, s)``, float32, ``(M,)`` each, ``M`` = the number of rows (``N · d1 · ...``);
        no autograd history (the loss's gradient does not depend on them:
        :func:`vocab_parallel_cross_entropy` computes it).
    """
    with torch.no_grad():
        xr = _rows(x)
        if _use_triton(xr):
            from .cross_entropy_triton import triton_logsumexp_stats
            return triton_logsumexp_stats(xr)
        return torch_logsumexp_stats(xr)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, weight, lse, first, n_classes, ignore_index, smoothing):
        xr, t = _rows(x), target.reshape(-1)
        args = (weight, lse, first)
        if _use_triton(xr):
            from .cross_entropy_triton import triton_loss
            loss = triton_loss(xr, t, *args, n_classes, ignore_index, smoothing)
        else:
            loss = torch_loss(xr, t, *args, n_classes, ignore_index, smoothing)
        ctx.save_for_backward(x, target, *(() if weight is None else (weight,)), lse, first)
        ctx.consts = (weight is not None, n_classes, ignore_index, smoothing)
        return loss.view(target.shape).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        has_weight, n_classes, ignore_index, smoothing = ctx.consts
        saved = list(ctx.saved_tensors)
        x, target = saved[0], saved[1]
        weight = saved[2] if has_weight else None
        lse, first = saved[-2], saved[-1]
        xr, t, g = _rows(x), target.reshape(-1), grad.reshape(-1)
        if _use_triton(xr):
            from .cross_entropy_triton import triton_grad
            d = triton_grad(xr, t, weight, lse, first, g, n_classes, ignore_index, smoothing)
        else:
            d = torch_grad(xr, t, weight, lse, first, g, n_classes, ignore_index, smoothing)
        return _unrows(d.to(x.dtype), x), None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None,
                                 lse: torch.Tensor, first: torch.Tensor, n_classes: int,
                                 ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """This device's share of torch's ``cross_entropy(..., reduction='none')`` over logits
    whose classes are split (module docstring): the devices' results sum to the dense loss.

    Args:
        x: local logits ``(N, C_local)`` or ``(N, C_local, d1, ...)``; classes
            ``[first, first + C_local)`` of ``n_classes``.
        target: global class ids ``(N,)`` or ``(N, d1, ...)`` (int64).
        weight: class weights ``(n_classes,)``, whole on every device, or ``None``. Its
            gradient is not computed: a weight that requires one raises.
        lse: the global log-sum-exp of each row, float32 ``(M,)`` (module docstring, step 2).
        first: this device's first class, a 1-element int64 tensor.
        n_classes: ``C``, the global number of classes.
        ignore_index: target value whose rows contribute 0 (and get no gradient).
        label_smoothing: ``ε`` in ``[0, 1]``.

    Returns:
        The local share of each element's loss, shaped like ``target``, in ``x``'s dtype;
        its backward gives the exact gradient of the global loss for the local logits,
        with no collective.

    Raises:
        ValueError: ``weight`` requires a gradient while autograd records.
    """
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("vocab_parallel_cross_entropy: the class weight requires a gradient, which the "
                         "vocab-parallel loss does not compute; detach the weight (or keep the classes whole)")
    return _VocabParallelCrossEntropy.apply(x, target, weight, lse, first, n_classes, ignore_index,
                                            float(label_smoothing))


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, target, reduction, ignore_index):
        logp = torch.log_softmax(x, 1)
        ctx.save_for_backward(logp, target)
        ctx.reduction, ctx.ignore_index = reduction, ignore_index
        return torch.ops.aten.nll_loss(logp, target, None, reduction, ignore_index)

    @staticmethod
    def backward(ctx, grad):
        logp, target = ctx.saved_tensors
        kept = target != ctx.ignore_index
        if ctx.reduction == 0:  # none: one gradient per row
            rows = grad
        elif ctx.reduction == 1:  # mean over the rows kept
            rows = (grad / kept.sum()).expand(target.shape)
        else:  # sum
            rows = grad.expand(target.shape)
        rows = torch.where(kept, rows, 0).to(logp.dtype)  # an ignored row gets 0 (also when all are: no 0/0)
        d = logp.exp().mul_(rows[:, None])
        d.scatter_add_(1, torch.where(kept, target, 0)[:, None], -rows[:, None])
        return d, None, None, None


def cross_entropy_loss(x: torch.Tensor, target: torch.Tensor, reduction: int = 1,
                       ignore_index: int = -100) -> torch.Tensor:
    """``aten.cross_entropy_loss(x, target, None, reduction, ignore_index)`` with its backward
    in one pass: ``(softmax(x) - onehot(target)) · g`` per row, computed as ``exp(log_softmax)``
    scaled in place and the target's entry lowered (the gradient of the softmax cross-entropy;
    e.g. Goodfellow et al., "Deep Learning", 2016, §6.2.2.3). Autograd's path through
    ``log_softmax`` and ``nll_loss`` fills a zero buffer of ``x``'s size, scatters into it, and
    reads it and the saved ``log_softmax`` once more: one more buffer of ``x``'s size and two more
    passes over it (``[512, 2048]`` fp32 on one CPU thread: 1.92 → 1.28 ms forward and backward).
    The forward is torch's own ops, so the loss is bitwise torch's; the gradient equals it up to
    rounding (each entry is the same product, ``exp(logp) · g``, less ``g`` at the target).

    Args:
        x: logits ``(N, C)``, floating.
        target: class indices ``(N,)``, int64; rows equal to ``ignore_index`` contribute 0 and
            get a zero gradient.
        reduction: 0 none, 1 mean over the rows not ignored (NaN when all are, as torch's), 2 sum.
        ignore_index: the target value of ignored rows.

    Returns:
        the loss: ``(N,)`` for reduction 0, a scalar otherwise, in ``x``'s dtype.
    """
    return _CrossEntropy.apply(x, target, reduction, ignore_index)
