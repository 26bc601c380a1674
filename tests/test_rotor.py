"""Rotor's dynamic program against baselines, brute force over region trees, and its clock."""

import math
import time

import numpy as np
import pytest

from autoparallel.plan import Region
from autoparallel.solver.rotor import (Chain, InfeasibleBudget, checkpoint_every_stage, chen_sqrt, min_budget,
                                       no_checkpoint, simulate, solve)


def _chain(n, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 20, n + 1).astype(float)
    x[-1] = 1.0
    saved = rng.integers(5, 60, n).astype(float)
    f = rng.uniform(1, 5, n)
    return Chain(fwd_time=f, bwd_time=2 * f, x=x, xbar=x[:n] + saved, fwd_tmp=rng.integers(0, 5, n).astype(float),
                 bwd_tmp=rng.integers(0, 5, n).astype(float), grad=rng.integers(0, 8, n).astype(float))


def _trees(s, t, whole=True):
    """Every list of non-overlapping top-level regions in [s, t), each with every nested
    tree of children; ``whole=False`` leaves out a region covering all of [s, t)."""
    if s >= t:
        yield []
        return
    yield from _trees(s + 1, t)  # stage s stored
    for k in range(s + 1, t + 1):
        if k == t and not whole:
            continue
        for inner in _trees(s, k, whole=False):
            for rest in _trees(k, t):
                yield [Region(s, k, tuple(inner))] + rest


def test_unlimited_budget_recomputes_nothing():
    c = _chain(12, 0)
    sched = solve(c, no_checkpoint(c).peak_bytes * 1.01)
    assert sched.regions == () and sched.recompute_time == 0


@pytest.mark.parametrize("seed", range(5))
def test_never_worse_than_baselines(seed):
    c = _chain(16, seed)
    lo, hi = checkpoint_every_stage(c).peak_bytes, no_checkpoint(c).peak_bytes
    for budget in np.linspace(lo, hi, 5):
        sched = solve(c, budget, slots=2000)
        total, peak = simulate(c, sched)
        assert peak <= budget + 1e-6 and math.isclose(total, sched.compute_time)
        for base in (checkpoint_every_stage(c), chen_sqrt(c)):
            if base.peak_bytes <= budget * (1 - 16 * 2 / 2000):  # clear of the slot rounding
                assert sched.compute_time <= base.compute_time + 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_optimal_against_brute_force(seed):
    c = _chain(5, seed)
    trees = list(_trees(0, 5))
    evals = [(simulate(c, tr), tr) for tr in trees]
    peaks = sorted({p for (_, p), _ in evals})
    for budget in peaks[:: max(1, len(peaks) // 6)]:
        best = min(t for (t, p), _ in evals if p <= budget)
        # an integer-sized chain on a slot of one byte: no rounding, the optimum exactly
        sched = solve(c, budget, slots=int(budget))
        assert math.isclose(sched.compute_time, best), (budget, sched)
    assert math.isclose(min_budget(c), peaks[0])


def test_infeasible_budget_states_the_minimum():
    c = _chain(10, 3)
    need = min_budget(c)
    with pytest.raises(InfeasibleBudget, match=f"{need:.0f} bytes") as e:
        solve(c, need * 0.9)
    assert e.value.min_budget == need
    assert simulate(c, solve(c, need, slots=int(need)))[1] <= need


def test_chain_validation():
    with pytest.raises(ValueError, match="L \\+ 1"):
        Chain(np.ones(3), np.ones(3), np.ones(3), np.ones(3), np.zeros(3), np.zeros(3))


def test_48_stages_500_slots_fast():
    c = _chain(48, 7)
    budget = (checkpoint_every_stage(c).peak_bytes + no_checkpoint(c).peak_bytes) / 2
    t0 = time.perf_counter()
    solve(c, budget, slots=500)
    assert time.perf_counter() - t0 < 5.0  # about 0.3 s on a 2-core machine; generous for CI
