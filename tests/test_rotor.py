"""Rotor's dynamic program against baselines, brute force over region trees, and its clock."""

import math
import time

import numpy as np
import pytest

from autoparallel.plan import Region
from autoparallel.solver.rotor import (Chain, InfeasibleBudget, checkpoint_every_stage, chen_sqrt, min_budget,
                                       no_checkpoint, selective_every_stage, simulate, solve)


def _chain(n, seed, selective=False):
    """A random chain; ``selective``: stages may also run selectively, keeping a part of what
    storing keeps and recomputing a part of their forward."""
    rng = np.random.default_rng(seed)
    x = rng.integers(1, 20, n + 1).astype(float)
    x[-1] = 1.0
    saved = rng.integers(5, 60, n).astype(float)
    f = rng.uniform(1, 5, n)
    sel = np.floor(saved * rng.uniform(0.1, 0.8, n)) if selective else None
    return Chain(fwd_time=f, bwd_time=2 * f, x=x, xbar=x[:n] + saved, fwd_tmp=rng.integers(0, 5, n).astype(float),
                 bwd_tmp=rng.integers(0, 5, n).astype(float), grad=rng.integers(0, 8, n).astype(float),
                 sel=sel, sel_time=f * rng.uniform(0.05, 0.5, n) if selective else None)


def _trees(s, t, whole=True, selective=False):
    """Every list of non-overlapping top-level regions in [s, t), each with every nested
    tree of children; ``whole=False`` leaves out a region covering all of [s, t);
    ``selective``: a stage may also be a selective region."""
    if s >= t:
        yield []
        return
    yield from _trees(s + 1, t, selective=selective)  # stage s stored
    if selective:
        for rest in _trees(s + 1, t, selective=True):
            yield [Region(s, s + 1, selective=True)] + rest
    for k in range(s + 1, t + 1):
        if k == t and not whole:
            continue
        for inner in _trees(s, k, whole=False, selective=selective):
            for rest in _trees(k, t, selective=selective):
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


@pytest.mark.parametrize("seed,selective", [(s, False) for s in range(4)] + [(s, True) for s in range(4)])
def test_optimal_against_brute_force(seed, selective):
    c = _chain(5, seed, selective)
    trees = list(_trees(0, 5, selective=selective))
    evals = [(simulate(c, tr), tr) for tr in trees]
    peaks = sorted({p for (_, p), _ in evals})
    for budget in peaks[:: max(1, len(peaks) // 6)]:
        best = min(t for (t, p), _ in evals if p <= budget)
        # an integer-sized chain on a slot of one byte: no rounding, the optimum exactly
        sched = solve(c, budget, slots=int(budget))
        assert math.isclose(sched.compute_time, best), (budget, sched)
    assert math.isclose(min_budget(c), peaks[0])


def test_selective_stages_chosen_where_they_pay():
    """Keeping most of a stage's activations for a little recompute beats a full region at a
    budget between the two, and every stage selective sits between storing and full
    recomputation in both time and memory."""
    c = _chain(12, 5, selective=True)
    every_sel, every_full, stored = selective_every_stage(c), checkpoint_every_stage(c), no_checkpoint(c)
    assert every_full.peak_bytes <= every_sel.peak_bytes <= stored.peak_bytes
    assert stored.compute_time < every_sel.compute_time < every_full.compute_time
    sched = solve(c, every_sel.peak_bytes, slots=4000)
    assert any(r.selective for r in sched.regions)
    assert sched.compute_time <= every_sel.compute_time + 1e-9
    assert simulate(c, sched)[1] <= every_sel.peak_bytes


def test_selective_region_is_one_stage_on_a_selective_chain():
    with pytest.raises(ValueError, match="one stage"):
        simulate(_chain(4, 0, selective=True), [Region(0, 2, selective=True)])
    with pytest.raises(ValueError, match="Chain.sel"):
        simulate(_chain(4, 0), [Region(0, 1, selective=True)])


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
    with pytest.raises(ValueError, match="go together"):
        Chain(np.ones(3), np.ones(3), np.ones(4), np.ones(3), np.zeros(3), np.zeros(3), sel=np.ones(3))


def test_48_stages_500_slots_fast():
    c = _chain(48, 7)
    budget = (checkpoint_every_stage(c).peak_bytes + no_checkpoint(c).peak_bytes) / 2
    t0 = time.perf_counter()
    solve(c, budget, slots=500)
    assert time.perf_counter() - t0 < 5.0  # about 0.3 s on a 2-core machine; generous for CI
