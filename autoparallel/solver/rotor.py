"""Optimal activation checkpointing of a chain: Rotor's dynamic program over memory slots.

After Beaumont, Eyraud-Dubois, Herrmann, Joly, Shilova, "Optimal checkpointing for
heterogeneous chains: how to train deep neural networks with limited memory" (arXiv
1911.13214, §4: the persistent-schedule recurrence over (first stage, last stage, memory)).
The recurrence is written here for the schedules that nested non-reentrant
``torch.utils.checkpoint`` regions execute, so that every schedule found can be emitted.

The chain has ``L`` stages; stage ``i`` reads activation ``x[i]`` (bytes) and produces
``x[i + 1]``; run storing, it keeps ``xbar[i] - x[i]`` bytes for backward besides its
input; its forward needs ``fwd_tmp[i]`` transient bytes, its backward ``bwd_tmp[i]``; the
gradient of ``x[i]`` has the size of ``x[i]``. Times are ``fwd_time[i]``, ``bwd_time[i]``
(seconds). Run selectively (:mod:`autoparallel.runtime_kernels.recompute`: the outputs of
matmuls and attention kept, the other ops recomputed), it keeps ``sel[i]`` bytes besides its
input and its backward first recomputes for ``sel_time[i]`` seconds.

Executing stages ``[s, t)`` given ``x[s]`` and the gradient of ``x[t]`` (``run(s, t)``)
ends with only the gradient of ``x[s]`` live. Its first step is either

* stage ``s`` run storing: forward ``s``, ``run(s + 1, t)`` with ``x[s]`` and the saved
  bytes held, backward ``s``;
* stage ``s`` run selectively (when the chain has ``sel``): the same with ``sel[s]`` bytes
  held, and the recompute of ``sel_time[s]`` seconds before backward ``s``, whose peak is the
  stored one (the recompute restores what storing keeps); or
* a checkpoint region ``[s, k)``, ``k < t``: forward of ``s..k-1`` keeping only ``x[s]``
  and each stage's output until the next consumed it, ``run(k, t)`` with ``x[s]`` held,
  then the region's recompute ``run(s, k)`` (whose own regions are the nested ones).

Parameter gradients (``grad[i]``, allocated by stage ``i``'s backward) stay live to the
end of the step: every peak inside ``run(s, t)`` includes those of stages ``t..``, and
the backward of ``s`` those of ``s..``.

``C(s, t, m)``, the least time of ``run(s, t)`` whose peak stays within ``m`` memory
slots, follows from these options (the selective one is ours: a third choice per stage, the
recurrence otherwise Rotor's); a schedule is a tree of
:class:`~autoparallel.plan.Region`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..plan import Region


class InfeasibleBudget(ValueError):
    """No schedule fits the budget; ``min_budget`` is the smallest one that does (bytes)."""

    def __init__(self, budget: float, min_budget: float):
        self.min_budget = float(min_budget)
        super().__init__(f"no checkpointing schedule fits {budget:.0f} bytes; the smallest budget that fits "
                         f"(everything recomputed as needed) is {self.min_budget:.0f} bytes")


@dataclass(frozen=True)
class Chain:
    """Per-stage times (seconds) and sizes (bytes), arrays of length L (``x``: L + 1);
    ``grad``: bytes of parameter gradients each stage's backward produces (they stay live
    to the end of the step, so stages ``i..`` hold ``grads_from[i]`` once past them);
    ``sel``, ``sel_time``: bytes a stage run selectively keeps beside its input, and the
    seconds its recompute takes (``None``: stages cannot run selectively).

    Raises:
        ValueError: on mismatched lengths or negative values.
    """

    fwd_time: np.ndarray
    bwd_time: np.ndarray
    x: np.ndarray
    xbar: np.ndarray
    fwd_tmp: np.ndarray
    bwd_tmp: np.ndarray
    grad: np.ndarray | None = None
    sel: np.ndarray | None = None
    sel_time: np.ndarray | None = None

    def __post_init__(self):
        n = len(self.fwd_time)
        if self.grad is None:
            object.__setattr__(self, "grad", np.zeros(n))
        # G[i]: parameter-gradient bytes of stages i.. (live once their backward has run)
        object.__setattr__(self, "grads_from", np.concatenate([np.cumsum(np.asarray(self.grad)[::-1])[::-1], [0.0]]))
        if (self.sel is None) != (self.sel_time is None):
            raise ValueError("Chain.sel and Chain.sel_time go together")
        selective = ("sel", "sel_time") if self.sel is not None else ()
        for name in ("bwd_time", "xbar", "fwd_tmp", "bwd_tmp", "grad") + selective:
            if len(getattr(self, name)) != n:
                raise ValueError(f"Chain.{name} has {len(getattr(self, name))} entries, fwd_time {n}")
        if len(self.x) != n + 1:
            raise ValueError(f"Chain.x needs L + 1 = {n + 1} entries (stage inputs and the output), got {len(self.x)}")
        for name in ("fwd_time", "bwd_time", "x", "xbar", "fwd_tmp", "bwd_tmp", "grad") + selective:
            if np.any(np.asarray(getattr(self, name)) < 0):
                raise ValueError(f"Chain.{name} has negative entries")
        if np.any(np.asarray(self.xbar) < np.asarray(self.x[:n])):
            raise ValueError("Chain.xbar[i] includes the input x[i]: it cannot be smaller")

    def __len__(self) -> int:
        return len(self.fwd_time)


@dataclass(frozen=True)
class Schedule:
    """Top-level regions, modelled total seconds (forward, backward and recompute), the
    recompute seconds alone, and the modelled peak bytes."""

    regions: tuple[Region, ...]
    compute_time: float
    recompute_time: float
    peak_bytes: float


# ------------------------------------------------------------------ peaks of the two options
def _store_peaks(c: Chain, s: int, t: int) -> tuple[float, float]:
    """(peak of forward ``s`` storing, peak of backward ``s``) on top of ``run``'s entry."""
    x = c.x
    held = c.xbar[s] - x[s]
    g = c.grads_from
    fwd = x[s] + x[t] + x[s + 1] + c.fwd_tmp[s] + g[t]
    bwd = x[s] + held + x[s + 1] + x[s] + c.bwd_tmp[s] + g[s]
    return fwd, bwd


def _forward_maxima(c: Chain) -> list[np.ndarray]:
    """Per first stage ``s``: entry ``k - s - 1`` is the most a region ``[s, k)``'s forward holds
    at one stage beyond ``x[s]`` (the current input, unless it is ``x[s]``, its output and the
    stage's transient bytes), a running maximum over ``k``: O(L²) once, so that the DP looks
    each region's forward peak up in O(1) instead of O(L)."""
    x, n = c.x, len(c)
    return [np.maximum.accumulate(np.concatenate([[0.0], x[s + 1:n]]) + x[s + 1:n + 1] + c.fwd_tmp[s:n])
            for s in range(n)]


def _region_forward_peak(c: Chain, maxima: list[np.ndarray], s: int, k: int, t: int) -> float:
    """Peak of a region ``[s, k)``'s forward inside ``run(s, t)`` (``maxima``: :func:`_forward_maxima`)."""
    return c.x[s] + c.x[t] + maxima[s][k - s - 1] + c.grads_from[t]


# ------------------------------------------------------------------ simulation
def simulate(chain: Chain, regions) -> tuple[float, float]:
    """Seconds and peak bytes of executing ``regions`` (a tree of
    :class:`~autoparallel.plan.Region`, or a :class:`Schedule`) on ``chain``, stage by stage
    in nested-checkpoint order (see the module docstring for what is live when).

    Raises:
        ValueError: overlapping, empty or out-of-range regions.
    """
    if isinstance(regions, Schedule):
        regions = regions.regions
    x = chain.x
    peak = 0.0
    time = 0.0

    def run(s: int, t: int, regs: list[Region], outside: float) -> None:
        """[s, t) entered with x[s] and the gradient of x[t] live on top of ``outside``;
        leaves the gradient of x[s]."""
        nonlocal peak, time
        g = chain.grads_from
        peak = max(peak, outside + x[s] + x[t] + g[t])
        if s == t:
            return
        first = regs[0] if regs else None
        if first is not None and (first.start < s or first.stop > t or first.stop <= first.start
                                  or (len(regs) > 1 and regs[1].start < first.stop)):
            raise ValueError(f"regions {regs[:2]} overlap, are empty or leave stages [{s}, {t})")
        selective = first is not None and first.start == s and first.selective
        if selective and (chain.sel is None or first.stop != s + 1 or first.children):
            raise ValueError(f"selective region {first}: one stage, no children, on a chain with Chain.sel")
        if first is not None and first.start == s and not selective:
            k = first.stop
            for i in range(s, k):  # forward keeping only x[s] and the current output
                peak = max(peak, outside + x[s] + x[t] + (x[i] if i > s else 0.0) + x[i + 1] + chain.fwd_tmp[i]
                           + g[t])
                time += chain.fwd_time[i]
            run(k, t, regs[1:], outside + x[s])
            run(s, k, sorted(first.children, key=lambda r: r.start), outside)  # the recompute
            return
        held = chain.xbar[s] - x[s]
        peak = max(peak, outside + x[s] + x[t] + x[s + 1] + chain.fwd_tmp[s] + g[t])
        time += chain.fwd_time[s]
        run(s + 1, t, regs[1:] if selective else regs, outside + x[s] + (chain.sel[s] if selective else held))
        peak = max(peak, outside + x[s] + held + x[s + 1] + x[s] + chain.bwd_tmp[s] + g[s])
        time += chain.bwd_time[s] + (chain.sel_time[s] if selective else 0.0)

    run(0, len(chain), sorted(regions, key=lambda r: r.start), 0.0)
    return float(time), float(peak)


# ------------------------------------------------------------------ minimal budget
def min_budget(chain: Chain) -> float:
    """The smallest peak (bytes) any schedule reaches on ``chain``."""
    n = len(chain)
    x = chain.x
    maxima = _forward_maxima(chain)
    best = [[0.0] * (n + 1) for _ in range(n + 1)]
    for t in range(n + 1):
        best[t][t] = x[t] + x[t] + chain.grads_from[t]
    for length in range(1, n + 1):
        for s in range(0, n - length + 1):
            t = s + length
            f, b = _store_peaks(chain, s, t)
            p = max(f, b, x[s] + chain.xbar[s] - x[s] + best[s + 1][t])
            if chain.sel is not None:
                p = min(p, max(f, b, x[s] + chain.sel[s] + best[s + 1][t]))
            for k in range(s + 1, t):
                p = min(p, max(_region_forward_peak(chain, maxima, s, k, t), x[s] + best[k][t], best[s][k]))
            best[s][t] = p
    return best[0][n]


# ------------------------------------------------------------------ the dynamic program
_STORE, _SELECTIVE = -1, -2
"""First steps of ``run(s, t)`` in the DP's choice arrays besides a region's end ``k > s``."""


def solve(chain: Chain, budget_bytes: float, slots: int = 500) -> Schedule:
    """The fastest schedule of ``chain`` whose modelled peak stays within ``budget_bytes``.

    Memory is counted in ``slots`` units of ``budget_bytes / slots`` bytes, every size
    rounded up, so the schedule found never exceeds the budget in the exact model (and
    may miss one that fits by less than a slot per term). ``C(s, t, ·)`` is a vector over
    memory slots; every option is evaluated for all memory values at once with numpy, the
    regions ``[s, k)`` of one ``(s, t)`` for every ``k`` in one array: O(L³·slots) arithmetic in
    O(L²) numpy calls (160 stages with 500 slots: 5.4 s on 2 busy cores, 66 s as a loop over k; the cost and choice
    tables take ``(L + 1)² · (slots + 1) · 12`` bytes, 156 MB there).

    Raises:
        InfeasibleBudget: when no schedule fits; it carries the smallest budget that does.
    """
    n = len(chain)
    stored = no_checkpoint(chain)
    if stored.peak_bytes <= budget_bytes:  # the fastest schedule fits: nothing to recompute
        return stored
    need = min_budget(chain)
    maxima = _forward_maxima(chain)
    if budget_bytes < need:
        raise InfeasibleBudget(budget_bytes, need)
    unit = budget_bytes / slots
    x = chain.x

    def q(b: float) -> int:
        return int(math.ceil(b / unit - 1e-9))

    m_axis = np.arange(slots + 1)
    inf = np.inf
    cost = np.full((n + 1, n + 1, slots + 1), inf)  # cost[s, t]: C(s, t, ·)
    how = np.full((n + 1, n + 1, slots + 1), _STORE, dtype=np.int32)  # how[s, t]: run(s, t)'s first step
    for t in range(n + 1):
        cost[t, t] = np.where(m_axis >= q(2 * x[t] + chain.grads_from[t]), 0.0, inf)
    fwd_before = np.concatenate([[0.0], np.cumsum(chain.fwd_time)])  # seconds of stages 0..k-1

    def shifted(arr: np.ndarray, by: int) -> np.ndarray:
        """``out[..., m] = arr[..., m - by]`` (inf where m - by < 0)."""
        if by <= 0:
            return arr
        out = np.full_like(arr, inf)
        if by <= slots:
            out[..., by:] = arr[..., :slots + 1 - by]
        return out

    for length in range(1, n + 1):
        for s in range(0, n - length + 1):
            t = s + length
            f, b = _store_peaks(chain, s, t)
            fits = m_axis >= q(max(f, b))
            best = np.where(fits, shifted(cost[s + 1, t], q(chain.xbar[s])) + chain.fwd_time[s] + chain.bwd_time[s],
                            inf)
            choice = np.full(slots + 1, _STORE, dtype=np.int32)
            if chain.sel is not None:
                cand = np.where(fits, shifted(cost[s + 1, t], q(x[s] + chain.sel[s])) + chain.fwd_time[s]
                                + chain.sel_time[s] + chain.bwd_time[s], inf)
                better = cand < best
                best = np.where(better, cand, best)
                choice = np.where(better, _SELECTIVE, choice)
            if length > 1:  # regions [s, k), s < k < t, all at once: rows k, columns memory
                ks = np.arange(s + 1, t)
                cand = shifted(cost[s + 1:t, t], q(x[s])) + cost[s, s + 1:t] + (fwd_before[ks] - fwd_before[s])[:, None]
                peaks = x[s] + x[t] + maxima[s][ks - s - 1] + chain.grads_from[t]
                cand[m_axis[None, :] < np.ceil(peaks / unit - 1e-9)[:, None]] = inf
                j = cand.argmin(axis=0)  # the first k of the least cost, as a loop over k keeps it
                region = cand[j, m_axis]
                better = region < best
                best = np.where(better, region, best)
                choice = np.where(better, ks[j], choice)
            cost[s, t] = best
            how[s, t] = choice

    if not np.isfinite(cost[0, n][slots]):  # fits exactly, not once rounded up: a peak sums at
        raise InfeasibleBudget(budget_bytes, need + unit * (2 * n + 2))  # most 2L+2 rounded terms

    def regions(s: int, t: int, m: int) -> list[Region]:
        out = []
        while s < t:
            k = int(how[s, t][m])
            if k == _SELECTIVE:
                out.append(Region(s, s + 1, selective=True))
                m -= q(x[s] + chain.sel[s])
                s += 1
                continue
            if k == _STORE:
                m -= q(chain.xbar[s])
                s += 1
                continue
            out.append(Region(s, k, tuple(regions(s, k, m))))
            m -= q(x[s])
            s = k
        return out

    return _schedule(chain, tuple(regions(0, n, slots)))


# ------------------------------------------------------------------ baselines
def _recompute(chain: Chain, regions) -> float:
    """Extra forward seconds: each stage runs once more per region around it (a selective
    stage only its recomputed ops)."""
    return sum(float(chain.sel_time[r.start]) if r.selective else
               float(np.sum(chain.fwd_time[r.start:r.stop])) + _recompute(chain, r.children) for r in regions)


def _schedule(chain: Chain, regions) -> Schedule:
    total, peak = simulate(chain, regions)
    return Schedule(tuple(regions), total, _recompute(chain, regions), peak)


def no_checkpoint(chain: Chain) -> Schedule:
    """Everything stored: no recomputation."""
    return _schedule(chain, ())


def checkpoint_every_stage(chain: Chain) -> Schedule:
    """Each stage but the last its own region: only stage inputs are kept through the forward.
    The last stage's backward runs first, right after its forward: recomputing it frees
    nothing that is not needed at once, and costs a second copy of what it returns (a
    language model's recomputed logits beside the caller's); the DP never recomputes it
    either (a region ends before the stage that follows it)."""
    return _schedule(chain, [Region(i, i + 1) for i in range(len(chain) - 1)])


def selective_every_stage(chain: Chain) -> Schedule:
    """Every stage but the last run selectively (``checkpointing="selective"``; the last as in
    :func:`checkpoint_every_stage`).

    Raises:
        ValueError: ``chain`` has no ``sel`` (its stages cannot run selectively).
    """
    return _schedule(chain, [Region(i, i + 1, selective=True) for i in range(len(chain) - 1)])


def chen_sqrt(chain: Chain) -> Schedule:
    """Segments of about √L stages, each a region (Chen, Xu, Zhang, Guestrin, "Training
    Deep Nets with Sublinear Memory Cost", arXiv 1604.06174, §4)."""
    n = len(chain)
    size = max(1, int(round(math.sqrt(n))))
    return _schedule(chain, [Region(i, min(n, i + size)) for i in range(0, n, size)])
