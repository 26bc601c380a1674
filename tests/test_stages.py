"""Pipeline stages chosen at plan time (issue 28): the axis, microbatches, schedule and
boundaries of :func:`autoparallel.solver.stages.plan_stages`, priced by its step and memory
model. Planning tier: meta-device models, no process group."""

import numpy as np
import pytest
import torch
import transformers as T

import autoparallel
from autoparallel import MeshSpec
from autoparallel.errors import InfeasiblePlanError
from autoparallel.plan import Plan
from autoparallel.solver import stages

T.logging.set_verbosity_error()


def llama(layers=6, hidden=64, vocab=512):
    with torch.device("meta"):
        return T.LlamaForCausalLM(T.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                                                num_hidden_layers=layers, num_attention_heads=4,
                                                num_key_value_heads=2, vocab_size=vocab, use_cache=False))


def gpt2(layers=6, vocab=512):
    with torch.device("meta"):
        return T.GPT2LMHeadModel(T.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=vocab, n_positions=256,
                                              use_cache=False))


def batch(b=8, s=64):
    ids = torch.empty(b, s, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def plan(model, inputs, mesh, **kw):
    return autoparallel.plan(model, inputs, mesh_spec=mesh, cache_dir=False, **kw)


@pytest.fixture(scope="module")
def gpt2_pp():
    return plan(gpt2(), batch(), MeshSpec((2, 2), ("pp", "dp")), microbatches=4, schedule="1F1B")


def test_pp_axis_carries_the_stages(gpt2_pp):
    pl = gpt2_pp.pipeline
    assert pl.axis == 0 and pl.pp == 2 and pl.stages == 2 and pl.layers == "transformer.h"
    assert pl.boundaries[0] == 0 and pl.boundaries[-1] == 6
    assert len(pl.stage_s) == len(pl.stage_peak_bytes) == 2 and min(pl.stage_s) > 0
    assert gpt2_pp.mesh.shape == (2,)  # one stage's submesh
    assert gpt2_pp.estimate.step_time_s == pytest.approx(pl.step_s)
    assert gpt2_pp.estimate.peak_memory_bytes == max(pl.stage_peak_bytes)
    assert 0 < pl.bubble < 1 and pl.p2p_s > 0


def test_pinned_microbatches_and_schedule(gpt2_pp):
    assert gpt2_pp.pipeline.microbatches == 4 and gpt2_pp.pipeline.schedule == "1F1B"
    assert gpt2_pp.pipeline.bubble == pytest.approx(1 / 5)  # (p - 1) / (M + p - 1)
    inter = plan(gpt2(), batch(), MeshSpec((2, 2), ("pp", "dp")), microbatches=2, schedule="Interleaved1F1B")
    assert inter.pipeline.schedule == "Interleaved1F1B" and inter.pipeline.stages == 4
    assert inter.pipeline.microbatches == 2


def test_one_f_one_b_holds_more_in_flight_on_the_first_stage(gpt2_pp):
    # 1F1B: stage s of p holds min(p - s, M) microbatches' activations
    assert stages.in_flight("1F1B", 4, 1, 8) == [4, 3, 2, 1]
    assert stages.in_flight("GPipe", 4, 1, 8) == [8] * 4
    assert gpt2_pp.pipeline.stage_peak_bytes[0] > gpt2_pp.pipeline.stage_peak_bytes[-1]


def test_pieces_add_up_to_the_intra_stage_step():
    from autoparallel import PlanOptions
    from autoparallel.solver.pipeline import plan_traced
    from autoparallel.tracer import capture
    model = llama()
    traced = capture(model, batch())
    opts = PlanOptions(cache_dir=False)
    inner = plan_traced(traced, MeshSpec((2,)), opts)
    pieces = stages.aggregate(inner, traced, "model.layers", 6, opts)
    assert pieces.micro_s.sum() + pieces.step_s.sum() == pytest.approx(inner.estimate.step_time_s)
    assert pieces.micro_s[2:6] == pytest.approx([pieces.micro_s[2]] * 4, rel=1e-3)  # identical layers alike
    assert pieces.cross[1] > 0 and pieces.cross_grad[1] > 0


def test_heavy_head_cuts_unevenly():
    # a vocabulary of 128k on hidden 256: head and loss weigh more than a layer, so the last stage takes fewer
    p = plan(llama(layers=8, hidden=256, vocab=131072), batch(8, 128), MeshSpec((2,), ("pp",)), microbatches=2, schedule="1F1B")
    b = p.pipeline.boundaries
    assert b[2] - b[1] < b[1] - b[0], b


def test_auto_pipelines_over_a_slow_axis_and_not_over_fast_links():
    model, inputs = llama(hidden=256), batch(16, 256)
    slow = plan(model, inputs, MeshSpec((2, 2), ("x", "y"), beta=(1e-8, 1e-11)), pipeline="auto", microbatches=2)
    assert slow.pipeline is not None and slow.pipeline.axis == 0
    fast = plan(model, inputs, MeshSpec((2, 2), ("x", "y")), pipeline="auto", microbatches=2, schedule="GPipe")
    assert fast.pipeline is None
    assert slow.estimate.step_time_s > fast.estimate.step_time_s


def test_json_round_trip(gpt2_pp):
    again = Plan.from_json(gpt2_pp.to_json())
    assert again.pipeline == gpt2_pp.pipeline
    assert again.estimate.step_time_s == gpt2_pp.estimate.step_time_s


def test_summary_lines(gpt2_pp):
    text = str(gpt2_pp)
    assert "pipeline over mesh axis pp (2 devices): 2 stages of transformer.h, 4 microbatches, 1F1B" in text
    assert "stage 0" in text and "embeddings, layers 0-" in text and "head and loss" in text


def test_no_split_fits_names_the_smallest_peak():
    with pytest.raises(InfeasiblePlanError, match="smallest stage peak"):
        plan(gpt2(), batch(), MeshSpec((2,), ("pp",)), microbatches=2, memory_budget="1MiB")


def test_compare_prices_the_3d_recipe_by_the_same_model():
    c = autoparallel.compare(gpt2(), batch(16), mesh_spec=MeshSpec((2, 2, 2), ("pp", "dp", "tp")), cache_dir=False)
    names = [r.name for r in c.rows]
    assert names[0] == "autoparallel plan" and names[1].startswith(stages.RECIPE)
    recipe = c.rows[1].plan
    assert recipe.pipeline.schedule == "1F1B" and recipe.pipeline.boundaries == (0, 3, 6)
    assert c.plan.estimate.step_time_s <= recipe.estimate.step_time_s


def test_a_profile_of_the_whole_mesh_prices_the_stage_on_its_submesh():
    """A cost model profiled on the whole (pp, dp) mesh: the stage solve runs on dp alone and
    binds the profile's submesh (CostModel.bind used to raise on the shape)."""
    from autoparallel.solver.costs import COLLECTIVES, CollectiveTable, CommProfile, CostModel, DevicePreset

    sizes = [4096 * 2**i for i in range(8)]
    tables = {(a, k): CollectiveTable.fit(sizes, [2e-5 + 1e-10 * (1 + a) * b for b in sizes])
              for a in range(2) for k in COLLECTIVES}
    identity = {"backend": "gloo", "device_type": "cpu", "device_name": "test cpu", "world_size": 4,
                "mesh_shape": [2, 2], "hosts": ["a", "a", "b", "b"], "torch": torch.__version__}
    profile = CommProfile(identity, ("pp", "dp"), tables, DevicePreset("test", 5e10, 2e10, 1e10, 2**30))
    sub = profile.submesh(0)
    assert sub.mesh_shape == (2,) and sub.axis_names == ("dp",) and sub.identity["hosts"] == ["a", "a"]
    assert set(sub.tables) == {(0, k) for k in COLLECTIVES} and sub.tables[(0, "all_reduce")] is tables[(1, "all_reduce")]
    cm = CostModel.from_profile(profile)
    p = plan(gpt2(), batch(), MeshSpec((2, 2), ("pp", "dp")), microbatches=4, schedule="1F1B", cost_model=cm)
    assert p.pipeline.pp == 2 and p.mesh.shape == (2,) and cm.profile is profile


def test_the_recipe_checkpoints_every_layer_only_when_a_stage_would_not_fit():
    """torchtitan's recipe: no activation checkpointing when its even split fits, else every
    layer checkpointed, which the pieces price as keeping each layer's input only."""
    mesh = MeshSpec((2, 2), ("pp", "tp"))
    roomy = autoparallel.compare(llama(), batch(16, 256), mesh_spec=mesh, cache_dir=False, microbatches=4)
    assert "no activation checkpointing" in " ".join(roomy.rows[1].notes)
    peak = roomy.rows[1].plan.estimate.peak_memory_bytes
    tight = autoparallel.compare(llama(), batch(16, 256), mesh_spec=mesh, cache_dir=False, microbatches=4,
                                 memory_budget=int(peak * 0.7))
    recipe = tight.rows[1].plan
    assert "full activation checkpointing" in " ".join(tight.rows[1].notes)
    assert recipe.checkpoint is not None and len(recipe.checkpoint.regions) >= 6  # one per layer at least
    assert recipe.estimate.peak_memory_bytes <= peak * 0.7 < peak
    assert recipe.estimate.step_time_s > roomy.rows[1].plan.estimate.step_time_s  # the recomputation
    assert tight.plan.estimate.peak_memory_bytes <= peak * 0.7


def test_checkpointing_is_chosen_per_stage():
    """Under 1F1B the first of two stages holds two microbatches in flight and the last one:
    with a budget below the first stage's peak, the first stage recomputes and the last does
    not, faster than either policy on every stage; the plan's checkpoint regions are the first
    stage's layers' only."""
    mesh, kw = MeshSpec((2, 2), ("pp", "tp")), dict(microbatches=4, schedule="1F1B")
    free = plan(llama(12), batch(16, 256), mesh, **kw)
    assert free.pipeline.checkpointing == ("off", "off")
    budget = int(0.8 * max(free.pipeline.stage_peak_bytes))
    mixed = plan(llama(12), batch(16, 256), mesh, memory_budget=budget, **kw)
    pl = mixed.pipeline
    assert pl.checkpointing[0] in ("selective", "full") and pl.checkpointing[1] == "off", pl
    assert max(pl.stage_peak_bytes) <= budget
    for policy in ("selective", "full"):
        pinned = plan(llama(12), batch(16, 256), mesh, memory_budget=budget, checkpointing=policy, **kw)
        assert set(pinned.pipeline.checkpointing) == {policy}
        assert pl.step_s < 0.95 * pinned.pipeline.step_s, (policy, pl.step_s, pinned.pipeline.step_s)
    paths = {mixed.nodes[n].module_path for reg in mixed.checkpoint.regions
             for n, st in mixed.checkpoint.stages.items() if reg.start <= st < reg.stop and n in mixed.nodes}
    layers = {int(p.split(".")[2]) for p in paths if p.startswith("model.layers.")}
    assert layers and max(layers) < pl.boundaries[1], (layers, pl.boundaries)
    assert Plan.from_json(mixed.to_json()).pipeline == pl
    assert "checkpointing per layer" in str(mixed) and "no recomputation" in str(mixed)
    # its regions are per layer, a chain the graph gives too: the plan runs (validated as autoparallelize does)
    from autoparallel.api import _stage_capture
    from autoparallel.options import PlanOptions
    from autoparallel.validate import validate_plan

    traced, _ = _stage_capture(llama(12), batch(16, 256), PlanOptions.build(None, "plan", cache_dir=False),
                               "model.layers", 4)
    validate_plan(mixed, traced)


def test_checkpointing_is_chosen_per_stage_on_devices_of_several_stages():
    """Interleaved1F1B: each device runs two stages and holds both. Each stage fits the budget
    alone unrecomputed, the two together do not: one of them recomputes, the others do not
    (``fit_ranks``), faster than either policy on every stage (25.2 ms against 29.2 ms
    selective and 30.3 ms full at 0.8 x the fastest plan's device peak)."""
    mesh, kw = MeshSpec((2, 2), ("pp", "tp")), dict(microbatches=4, schedule="Interleaved1F1B")
    free = plan(llama(12), batch(16, 256), mesh, **kw)
    budget = int(0.8 * max(free.pipeline.stage_peak_bytes))
    pl = plan(llama(12), batch(16, 256), mesh, memory_budget=budget, **kw).pipeline
    assert "off" in pl.checkpointing and set(pl.checkpointing) != {"off"}, pl
    assert max(pl.stage_peak_bytes) <= budget
    full = plan(llama(12), batch(16, 256), mesh, memory_budget=budget, checkpointing="full", **kw).pipeline
    assert pl.step_s < 0.9 * full.step_s, (pl.step_s, full.step_s)


def test_ranks_idle_in_the_bubble_lend_their_cores():
    """Four ranks on two cores (core_share 0.5), pp = 4 and 4 microbatches: of the 7 slots, 2
    have one rank busy and 2 have two (each with a whole core, twice the calibrated speed), 2
    have three (4/3) and 1 all four: 4.5 slots' time. Ranks with a core each: the formula."""
    from autoparallel.solver.costs import DevicePreset

    whole, bubble = stages.step_model("1F1B", 4, 1, 4, [1.0], 0.0, [0.0])
    shared, same = stages.step_model("1F1B", 4, 1, 4, [1.0], 0.0, [0.0], core_share=0.5)
    assert (whole, bubble, same) == (7.0, 3 / 7, 3 / 7) and shared == pytest.approx(4.5)
    # two stages of two ranks each on two cores: the fill and drain slots run twice as fast
    assert stages.step_model("1F1B", 2, 1, 4, [1.0], 0.0, [0.0], core_share=0.5)[0] == pytest.approx(4.0)
    # interleaved, a core each: (M + (p - 1) / v) slots of t plus the sends and the update
    assert stages.step_model("Interleaved1F1B", 2, 2, 4, [1.0], 0.1, [0.5])[0] == pytest.approx(4.5 * 1.2 + 0.5)
    # zero bubble: a third of that idle half slot is left (ZB-H1), the sends and the update alike
    step, bubble = stages.step_model("InterleavedZeroBubble", 2, 2, 4, [1.0], 0.1, [0.5])
    assert step == pytest.approx(4 + 0.5 / 3 + 4.5 * 2 * 0.1 + 0.5) and bubble == pytest.approx((0.5 / 3) / (4 + 0.5 / 3))
    preset = DevicePreset("d", 1e12, 1e12, 1e11, 2**30, core_share=0.5)
    assert DevicePreset.from_json(preset.to_json()) == preset
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="core_share"):
            DevicePreset("d", 1e12, 1e12, 1e11, 2**30, core_share=bad)


def test_microbatch_counts_are_tried_from_the_largest_down(monkeypatch):
    seen = []
    real = stages._search_at

    def spy(*args, **kw):
        seen.append(args[9])
        return real(*args, **kw)

    monkeypatch.setattr(stages, "_search_at", spy)
    p = plan(gpt2(), batch(), MeshSpec((2, 2), ("pp", "dp")), schedule="1F1B")
    assert seen[0] == 8 and seen == sorted(seen, reverse=True)  # 2 · {1, 2, 4} divide the batch of 8
    assert p.pipeline.microbatches in seen


def test_one_prepare_serves_every_budget():
    """The stage search solves one capture under several budgets on one prepared planner: the
    same plans as preparing afresh, a previous budget's memory rows dropped."""
    from dataclasses import replace

    from autoparallel.api import _stage_capture
    from autoparallel.options import PlanOptions
    from autoparallel.pipeline_plan import submesh
    from autoparallel.solver.pipeline import plan_traced, prepare

    opts = PlanOptions.build(None, "plan", cache_dir=False)
    traced, _ = _stage_capture(llama(), batch(8, 64), opts, "model.layers", 4)
    sub = submesh(MeshSpec((2, 2), ("pp", "dp")), 0)
    base = replace(opts, pipeline="off", memory_budget="unlimited")
    prepared = prepare(traced, sub, base)
    free = plan_traced(traced, sub, base, prepared=prepared)
    tight = int(free.estimate.peak_memory_bytes * 0.8)
    for budget in (tight, "unlimited", tight):
        o = replace(base, memory_budget=budget)
        shared, fresh = plan_traced(traced, sub, o, prepared=prepared), plan_traced(traced, sub, o)
        assert shared.estimate.step_time_s == pytest.approx(fresh.estimate.step_time_s)
        assert shared.estimate.peak_memory_bytes == fresh.estimate.peak_memory_bytes
    pieces = stages.aggregate(free, traced, "model.layers", 6, opts, memory=prepared.planner.memory)
    again = stages.aggregate(free, traced, "model.layers", 6, opts)
    assert all(np.array_equal(getattr(pieces, f), getattr(again, f)) for f in pieces.__dataclass_fields__)


def test_stage_sums_and_peaks_from_prefix_sums_match_the_pieces():
    """The DP prices a stage in O(1) (prefix sums, a range-maximum table): the same numbers as
    summing its pieces."""
    rng = np.random.default_rng(0)
    for L in (6, 13):
        r = lambda: rng.random(L + 2)  # noqa: E731
        pc = stages.Pieces(r(), r(), r(), r(), r(), 10 * r(), r(), 3 * r(), 1e6 * r(), 1e6 * r())
        priced = stages._Priced(pc, 1e-5, 1e-9)
        for a in range(L):
            for b in range(a + 1, L + 1):
                ks = pc.stage(a, b)
                want = sum(pc.state[k] for k in ks) + 2.5 * sum(pc.saved[k] for k in ks) + max(pc.transient[k] for k in ks)
                assert priced.stage_peak(a, b, 2.5) == pytest.approx(want)
                assert priced.sum(pc.micro_s, a, b) == pytest.approx(sum(pc.micro_s[k] for k in ks))
