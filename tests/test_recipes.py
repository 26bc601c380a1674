"""Hand-written recipes found from the graph (GPT-2's Conv1D, Llama, BERT) and priced by compare()."""

import pytest
import torch
from torch.distributed.tensor import Shard

import autoparallel
from autoparallel.tracer import capture
from autoparallel.placement import R
from autoparallel import compare
from autoparallel.recipes import find_roles, recipes

from models import hf_model

MESH = autoparallel.MeshSpec((2, 2), ("dp", "tp"))


def _model(name, layers=2, batch=4):
    with torch.device("meta"):
        model = hf_model(name, layers=layers)
    ids = torch.empty(batch, 16, dtype=torch.long, device="meta")
    return model, {"input_ids": ids, "labels": ids.clone()}


# per layer, in graph order: the Megatron roles and each weight's dim of output features
EXPECTED = {
    "gpt2": (["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"], 1, "transformer.wte.weight"),
    "llama": (["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj"], 0, "lm_head.weight"),
    "bert": (["attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
              "intermediate.dense", "output.dense"], 0, "bert.embeddings.word_embeddings.weight"),
}
ROLES = {"gpt2": "CRCR", "llama": "CCCRCCR", "bert": "CCCRCR"}


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_roles_from_the_graph(name):
    traced = capture(*_model(name))
    roles = find_roles(traced)
    modules, out_dim, head = EXPECTED[name]
    layer0 = [p for p in roles.projections if p.layer is not None and p.layer[1] == 0]
    assert [p.weight.rsplit(".", 1)[0].split(".0.", 1)[1] for p in layer0] == modules
    assert "".join(p.role[0].upper() for p in layer0) == ROLES[name]
    assert all(p.out_dim == out_dim for p in layer0)
    assert [p.weight for p in roles.projections if p.role == "head"] == [head] and roles.vocab == 128
    assert sum(p.role == "column" for p in roles.projections) == 2 * ROLES[name].count("C")


def test_recipe_constraints():
    traced = capture(*_model("llama"))
    by = {r.name: r for r in recipes(traced, MESH)}
    assert set(by) == {"DDP", "FSDP (ZeRO-3)", "Megatron TP over tp, DP over dp", "FSDP + TP"}
    ddp, fsdp, tp, both = (by[k].constraints for k in by)
    assert not any(".0." in k or ".1." in k for k in ddp)  # the two layers, placed alike, written once
    assert ddp["model.layers.*.mlp.up_proj.weight"] == "R" and ddp["input_ids"] == "S0(dp) S0(tp)"
    assert fsdp["model.layers.*.mlp.up_proj.weight"] == "S0(dp) S0(tp) -> R"
    assert tp["model.layers.*.self_attn.q_proj.weight"] == "S0(tp)"  # column: output features
    assert tp["model.layers.*.self_attn.o_proj.weight"] == "S1(tp)"  # row: input features
    assert tp["model.embed_tokens.weight"] == "S0(tp)" and tp["lm_head.weight"] == "S0(tp)"  # vocabulary
    assert tp["model.norm.weight"] == "R" and tp["input_ids"] == "S0(dp)"
    assert both["model.layers.*.self_attn.o_proj.weight"] == "S0(dp) S1(tp) -> S1(tp)"
    assert both["model.layers.*.self_attn.q_proj.weight"] == "S1(dp) S0(tp) -> S0(tp)"
    one_d = {r.name: r for r in recipes(traced, autoparallel.MeshSpec((4,), ("x",)))}
    assert one_d["FSDP + TP"].constraints is None and "2-D mesh" in one_d["FSDP + TP"].reason
    assert one_d["Megatron TP over x"].constraints["input_ids"] == "R"
    odd = {r.name: r for r in recipes(capture(*_model("llama", batch=3)), MESH)}
    assert odd["DDP"].constraints is None and "not divisible by 4" in odd["DDP"].reason


def test_compare_prices_each_recipe_as_the_plan_with_its_constraints():
    model, inputs = _model("gpt2", layers=1)
    mesh = autoparallel.MeshSpec((2,), ("x",))
    c = compare(model, inputs, mesh_spec=mesh, cache_dir=False)
    names = [r.name for r in c.rows]
    assert names == ["autoparallel plan", "DDP", "FSDP (ZeRO-3)", "Megatron TP over x", "FSDP + TP"]
    text = str(c)
    assert "FSDP + TP: cannot be expressed: needs a 2-D mesh" in text and "best recipe: " in text
    tp = c.rows[3]
    assert tp.plan.param_placements["transformer.h.0.mlp.c_fc.weight"] == (Shard(1),)
    assert tp.plan.param_placements["transformer.h.0.mlp.c_proj.weight"] == (Shard(0),)
    assert tp.plan.param_placements["transformer.ln_f.weight"] == (R,)
    traced = capture(model, inputs)
    recipe = next(r for r in recipes(traced, mesh) if r.name == "Megatron TP over x")
    again = autoparallel.plan(model, inputs, mesh_spec=mesh, cache_dir=False, constraints=recipe.constraints)
    assert again.estimate.step_time_s == tp.plan.estimate.step_time_s
    assert again.param_placements == tp.plan.param_placements
    for r in c.rows[1:4]:
        assert r.plan.estimate.step_time_s >= c.plan.estimate.step_time_s * (1 - 1e-9)
    # compare() plans every recipe; its plan's baselines are its rows
    assert list(c.plan.inspection.baselines) == names[1:]
    for r in c.rows[1:4]:
        est = r.plan.estimate
        assert c.plan.inspection.baselines[r.name] == {"step_time_s": est.step_time_s, "comm_s": est.comm_s,
                                                        "recompute_s": 0.0, "peak_memory_bytes": est.peak_memory_bytes}
    assert c.plan.inspection.baselines["FSDP + TP"] == {"reason": c.rows[4].reason}
    _check_plain_baselines(autoparallel.plan(model, inputs, mesh_spec=mesh, cache_dir=False, baselines=True), c)
    assert "vs this plan's step, same cost model: DDP" in str(c.plan)
    with pytest.raises(TypeError, match="pass no baselines"):
        compare(model, inputs, mesh_spec=mesh, baselines=False)


def _check_plain_baselines(plan, c):
    """``plan``'s default baselines against compare()'s rows: DDP and the fastest recipe
    planned alike; a recipe left out for its bound is no faster than the bound says, and the
    bound is above the fastest recipe's step."""
    base = plan.inspection.baselines
    assert list(base) == [r.name for r in c.rows[1:]] and "step_time_s" in base["DDP"]
    fastest = c.best_recipe().plan.estimate.step_time_s
    assert min(b["step_time_s"] for b in base.values() if "step_time_s" in b) == fastest
    for r in c.rows[1:]:
        b = base[r.name]
        if "step_time_s" in b:
            assert b["step_time_s"] == r.plan.estimate.step_time_s and b["comm_s"] == r.plan.estimate.comm_s
        elif "step_at_least_s" in b:
            assert fastest < b["step_at_least_s"] <= r.plan.estimate.step_time_s * (1 + 1e-9), (r.name, b)
        else:
            assert b == {"reason": r.reason}


@pytest.mark.slow
def test_compare_on_a_2d_mesh_every_recipe_expressible():
    model, inputs = _model("gpt2")
    c = compare(model, inputs, mesh_spec=MESH, cache_dir=False)
    assert all(r.plan is not None for r in c.rows), str(c)
    assert c.best_recipe() is not None
    _check_plain_baselines(autoparallel.plan(model, inputs, mesh_spec=MESH, cache_dir=False, baselines=True), c)


def test_roles_through_mixed_precision_casts():
    """Under a bf16 policy every parameter is read through its cast (tracer/casts.py)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    model, inputs = _model("llama")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    roles = find_roles(capture(model, inputs, mp_policy=policy))
    assert "".join(p.role[0].upper() for p in roles.projections if p.layer == ("model.layers", 0)) == ROLES["llama"]
    assert roles.vocab == 128 and [p.weight for p in roles.projections if p.role == "head"] == ["lm_head.weight"]


@pytest.mark.slow
def test_recipes_keep_repeated_layers_shared():
    """A recipe pins the embedding, so the first layer's ops group differently from the
    later ones (its input has one strategy): only the first layer of each template may leave
    the shared variables (solver.problem._shared), not every later layer."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    with torch.device("meta"):
        model = hf_model("llama", layers=8)
    ids = torch.empty(4, 16, dtype=torch.long, device="meta")
    c = compare(model, {"input_ids": ids, "labels": ids.clone()}, mesh_spec=MESH,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    free = c.plan.solver_stats.shared_nodes
    per_layer = free // 6  # layers 2..7 share the variables of layers 0 and 1
    for r in c.rows[1:]:
        assert r.plan is not None, r.reason
        assert r.plan.solver_stats.shared_nodes >= free - per_layer, (r.name, r.plan.solver_stats)


def test_restricted_planner_keeps_layer_templates_only_when_they_hold():
    """Planner.restricted reuses the plan's layer templates when the narrowed strategies sort
    the layers into the same classes of strategy counts, else computes them again: either way
    they are what layer_templates gives for the narrowed strategies."""
    from autoparallel.constraints import resolve, restrict
    from autoparallel.solver import CostModel
    from autoparallel.solver.planner import Planner
    from autoparallel.solver.shared_layers import layer_templates
    from autoparallel.strategies import StrategyGenerator

    traced = capture(*_model("gpt2", layers=4))
    gen = StrategyGenerator(MESH.shape)
    strategies = gen.generate(traced.gm)
    planner = Planner(traced.gm, strategies, gen.aliases, MESH, CostModel(), dict(traced.params))
    sets = [r.constraints for r in recipes(traced, MESH) if r.constraints]
    sets.append({"transformer.h.1.mlp.c_fc.weight": "S1(tp)"})  # one layer unlike the others
    reused = []
    for constraints in sets:
        narrowed = {n: list(ss) for n, ss in strategies.items()}
        restrict(narrowed, gen.aliases, resolve(constraints, traced, MESH), MESH.axis_names)
        sub = planner.restricted(narrowed)
        assert sub.template == layer_templates(planner.nodes, narrowed)
        reused.append(sub.template is planner.template)
    assert reused == [True] * (len(sets) - 1) + [False]
