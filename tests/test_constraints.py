"""Constraints: the placement grammar, pattern matching, and plans that honour them."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autoparallel
from autoparallel.constraints import ConstraintError, format_spec, module_outputs, parse_spec
from autoparallel.placement import P, R

from models import hf_model, whole

AXES = ("dp", "tp")


@pytest.mark.parametrize("spec", [(R, R), (Shard(0), R), (R, Shard(1)), (Shard(0), Shard(0)), (Shard(1), Shard(0)),
                                  (R, P), (P, Shard(2))])
def test_named_notation_round_trips(spec):
    assert parse_spec(format_spec(spec, AXES), AXES) == spec


def test_grammar_forms():
    assert format_spec((Shard(0), Shard(0)), AXES) == "S0(dp) S0(tp)"
    assert format_spec((R, R), AXES) == "R"
    assert parse_spec("S0(tp)", AXES) == (R, Shard(0))
    assert parse_spec("S0(1) R(0)", AXES) == (R, Shard(0))  # axis by index
    assert parse_spec("S0 R", AXES) == (Shard(0), R)  # positional
    assert parse_spec("R", ("a", "b", "c")) == (R, R, R)
    assert parse_spec("P(dp)", AXES) == (P, R)


@pytest.mark.parametrize("text, match", [("", "empty"), ("X0(dp)", "bad placement"), ("S0(pp)", "unknown mesh axis"),
                                         ("S0(dp) S1(dp)", "placed twice"), ("S0(dp) R", "some items only"),
                                         ("S0 R S1", "3 placements"), ("S-1(dp)", "bad placement")])
def test_bad_text(text, match):
    with pytest.raises(ConstraintError, match=match):
        parse_spec(text, AXES)


@pytest.fixture(scope="module")
def gpt2():
    with torch.device("meta"):
        model = hf_model("gpt2", layers=2)
    ids = torch.empty(4, 16, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}


def _plan(gpt2, **kw):
    model, inputs = gpt2
    return autoparallel.plan(model, inputs, mesh_spec=autoparallel.MeshSpec((2, 2), AXES), cache_dir=False, **kw)


def test_constrained_plan_honours_every_constraint_and_costs_no_less(gpt2):
    free = _plan(gpt2)
    constraints = {"transformer.h.*.attn.c_attn.weight": "S1(tp)",  # parameters, by glob
                   "transformer.h.*.mlp.c_proj.weight": (Replicate(), Shard(0)),  # a DTensor tuple
                   "transformer.wpe.weight": "S0(dp) S0(tp)",
                   "input_ids": "S0(dp)",  # the ops reading the batch take it split over dp
                   "transformer.h.1.mlp": "S0(dp)",  # a module's output
                   "logits": "S0(dp) S1(tp)"}  # an output
    plan = _plan(gpt2, constraints=constraints)
    pp = plan.param_placements
    for i in range(2):
        assert pp[f"transformer.h.{i}.attn.c_attn.weight"] == (R, Shard(1))
        assert pp[f"transformer.h.{i}.mlp.c_proj.weight"] == (R, Shard(0))
    assert pp["transformer.wpe.weight"] == (Shard(0), Shard(0))
    model, inputs = gpt2
    from autoparallel.tracer import capture

    traced = capture(model, inputs)
    graph = {n.name: n for n in traced.gm.graph.nodes}
    readers = [u.name for u in graph["input_ids"].users]
    assert readers
    for r in readers:
        node = plan.nodes[r]
        specs = [s for s, x in zip(node.input_specs, graph[r].all_input_nodes) if x.name == "input_ids"]
        assert specs and all(s == (Shard(0), R) for s in specs), (r, node.input_specs)
    mlp_out = module_outputs(traced.gm)["transformer.h.1.mlp"]
    assert plan.nodes[mlp_out.name].output_specs[0] == (Shard(0), R)
    logits = [c for c in plan.redistributions if c.dst == "output" and c.arg == 1]
    produced = [n for n in plan.nodes.values() if n.out_shapes and n.out_shapes[0] == (4, 16, 128)]
    assert any(n.output_specs[0] == (Shard(0), Shard(1)) for n in produced) and not logits
    assert plan.inspection.placement_constraints["transformer.h.*.mlp.c_proj.weight"] == "S0(tp)"
    assert plan.solver_stats.objective_s >= free.solver_stats.objective_s * (1 - 1e-9)
    assert plan.estimate.step_time_s >= free.estimate.step_time_s * (1 - 1e-9)


def test_free_choice_as_constraint_gives_the_free_plan(gpt2):
    free = _plan(gpt2)
    fixed = {name: format_spec(spec, AXES) for name, spec in free.param_placements.items() if "h.0." in name}
    plan = _plan(gpt2, constraints=fixed)
    assert plan.solver_stats.objective_s == pytest.approx(free.solver_stats.objective_s, rel=1e-9)


def test_pattern_matching_nothing_names_the_closest_names(gpt2):
    """A misspelt pattern names the nearest names and layer globs, not arbitrary examples."""
    with pytest.raises(ConstraintError) as e:
        _plan(gpt2, constraints={"transformer.h.*.attn.c_atn.weight": "R"})
    assert "closest: 'transformer.h.*.attn.c_attn.weight'" in str(e.value)
    with pytest.raises(ConstraintError, match="closest: 'lm_head.weight'"):
        _plan(gpt2, constraints={"lm_haed.weight": "R"})


def test_impossible_constraint_names_pattern_tensor_and_choices(gpt2):
    with pytest.raises(ConstraintError) as e:
        _plan(gpt2, constraints={"transformer.wpe.*": "S2(tp)"})
    msg = str(e.value)
    assert "'transformer.wpe.*'" in msg and "parameter transformer.wpe.weight [32, 64]" in msg
    assert "legal placements are: R, " in msg and "S0(dp) S0(tp)" in msg


def test_pattern_matching_nothing_and_conflicts_raise(gpt2):
    with pytest.raises(ConstraintError, match="'no.such.*' matches no parameter.*nothing close; for example parameter"):
        _plan(gpt2, constraints={"no.such.*": "R"})
    with pytest.raises(ConstraintError, match="pinned to S0\\(tp\\) by .* and to R by"):
        _plan(gpt2, constraints={"*.c_attn.weight": "S0(tp)", "transformer.h.0.*": "R"})
    with pytest.raises(TypeError, match="constraints must be a dict"):
        _plan(gpt2, constraints=[("a", "R")])
    with pytest.raises(ConstraintError, match="1 placements for the 2-axis"):
        _plan(gpt2, constraints={"transformer.wpe.weight": (Shard(0),)})


def test_constraints_enter_the_cache_key(gpt2, tmp_path):
    model, inputs = gpt2
    mesh = autoparallel.MeshSpec((2, 2), AXES)
    a = autoparallel.plan(model, inputs, mesh_spec=mesh, cache_dir=tmp_path)
    b = autoparallel.plan(model, inputs, mesh_spec=mesh, cache_dir=tmp_path, constraints={"lm_head.weight": "R"})
    c = autoparallel.plan(model, inputs, mesh_spec=mesh, cache_dir=tmp_path, constraints={"lm_head.weight": "R"})
    assert a.solver_stats.cache == "miss" and b.solver_stats.cache == "miss"
    assert c.solver_stats.cache == "hit" and b.param_placements["lm_head.weight"] == (R, R)


def test_stored_and_used(gpt2):
    from autoparallel.summary import parameter_use

    plan = _plan(gpt2, constraints={"transformer.h.*.mlp.c_fc.weight": "S0(dp) S1(tp) -> S1(tp)",
                                    "transformer.wpe.weight": "S0(dp) S0(tp) -> R"})
    assert plan.param_placements["transformer.h.1.mlp.c_fc.weight"] == (Shard(0), Shard(1))
    node = {names[0]: n for n, names in plan.inspection.state_nodes.items()}
    assert parameter_use(plan, node["transformer.h.1.mlp.c_fc.weight"]) == "all-gathered over dp"
    assert parameter_use(plan, node["transformer.wpe.weight"]) == "all-gathered over dp,tp"
    assert plan.inspection.placement_constraints["transformer.wpe.weight"] == "S0(dp) S0(tp) -> R"
    with pytest.raises(ConstraintError, match="-> R by .* and to S0\\(dp\\) S0\\(tp\\) -> S0\\(tp\\) by"):
        _plan(gpt2, constraints={"transformer.wpe.weight": "S0(dp) S0(tp) -> R",
                                 "transformer.wpe.*": "S0(dp) S0(tp) -> S0(tp)"})
    with pytest.raises(ConstraintError, match="as read by"):
        _plan(gpt2, constraints={"transformer.wpe.weight": "S0(dp) -> S5(tp)"})


@pytest.mark.slow
def test_autoparallelize_with_constraints_keeps_parity(sim_mesh):
    import copy

    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode

    from models import batch_for, to_meta
    from models import build_model as build

    mesh = sim_mesh((2, 2))
    ref = build("gpt2")
    model = copy.deepcopy(ref)
    ranks = frozenset(range(4))
    constraints = {"transformer.h.*.mlp.c_fc.weight": "S0(0) S1(1) -> S1(1)",  # FSDP over axis 0 + TP over 1
                   "transformer.h.*.mlp.c_proj.weight": "S0(1)", "input_ids": "S0(0)"}
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, to_meta(batch_for("gpt2", 0)), device_mesh=mesh,
                                              cost_model=autoparallel.CostModel("cpu"), constraints=constraints)
    params = dict(pmodel.named_parameters())
    assert tuple(params["transformer.h.1.mlp.c_fc.weight"].placements) == (Shard(0), Shard(1))
    assert tuple(params["transformer.h.0.mlp.c_proj.weight"].placements) == (R, Shard(0))
    inputs = batch_for("gpt2", 0)
    want = ref(**inputs).loss
    want.backward()
    with LocalTensorMode(ranks):
        got = pmodel(**inputs).loss
        got.backward()
        grads = {n: whole(p.grad) for n, p in pmodel.named_parameters()}
    ref_params = dict(ref.named_parameters())
    for value in (got.detach()._local_tensors.values() if isinstance(got, LocalTensor) else [got.detach()]):
        torch.testing.assert_close(value, want.detach(), rtol=1e-4, atol=1e-5)
    for name, g in grads.items():
        for r, v in enumerate(g._local_tensors.values() if isinstance(g, LocalTensor) else [g]):
            torch.testing.assert_close(v, ref_params[name].grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {r}: {m}")


def test_constraints_of_the_wrong_type_are_refused_before_tracing(gpt2, monkeypatch):
    """A list (or any non-mapping) is refused by the argument checks, before the model is traced."""
    from autoparallel.tracer import ColoTracer

    def never(*args, **kwargs):
        raise AssertionError("traced before the constraints were checked")

    monkeypatch.setattr(ColoTracer, "trace", never)
    for bad in ([("transformer.wpe.weight", "R")], {0: "R"}, "R"):
        with pytest.raises(TypeError, match="constraints must be a dict"):
            _plan(gpt2, constraints=bad)
