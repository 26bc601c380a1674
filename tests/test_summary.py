"""str(plan) is a one-screen summary; plan.explain(name) gives the chosen strategy and the
next best alternatives, taken from the solve."""

import copy
import json

import pytest
import torch

import autoparallel
from autoparallel import units
from autoparallel.summary import fold, ranges

from models import hf_model

MESH = autoparallel.MeshSpec((2, 2), ("dp", "tp"))


def _plan(name, layers, **kw):
    with torch.device("meta"):
        model = hf_model(name, layers=layers)
    ids = torch.empty(4, 16, dtype=torch.long, device="meta")
    return autoparallel.plan(model, {"input_ids": ids, "labels": ids.clone()}, mesh_spec=MESH, cache_dir=False, **kw)


@pytest.fixture(scope="module")
def gpt2_plan():
    return _plan("gpt2", 4, baselines=True)


def test_fold_and_ranges():
    assert fold("transformer.h.3.attn.c_attn.weight") == ("transformer.h.{}.attn.c_attn.weight", 3)
    assert fold("lm_head.weight") == ("lm_head.weight", None)
    assert ranges([3, 0, 1, 2, 5]) == "0..3,5" and ranges([0, 2, 4, 6]) == "0,2,..,6" and ranges([7]) == "7"


def test_summary_folds_layers_and_names_every_parameter_kind(gpt2_plan):
    text = str(gpt2_plan)
    lines = text.splitlines()
    assert len(lines) <= 50, text
    assert lines[0].startswith("plan for a mesh of 4 devices: 2 (dp) × 2 (tp); priced by preset a100")
    for kind in {fold(n)[0] for n in gpt2_plan.param_placements}:
        if kind == "lm_head.weight":  # tied to the embedding: printed beside it
            assert "(= lm_head.weight)" in text
            continue
        head, _, tail = kind.partition("{}")
        rows = [ln.split()[0] for ln in lines if ln.strip().startswith(head)]
        assert any(r.endswith(tail) for r in rows), (kind, text)
        if "{}" in kind:  # folded: no row names a single layer
            assert not any(kind.format(i) in text for i in range(4)), kind
    assert "transformer.h.{0..3}.attn.c_attn.weight" in text
    for part in ("estimated step", "compute", "exposed communication", "peak memory", "inputs", "input_ids [4, 16]",
                 "collectives in transformer.h.2 (one of transformer.h.{0..3})",
                 "vs this plan's step, same cost model: DDP "):
        assert part in text, part
    assert " S0 " not in text and "S01" not in text  # placements carry mesh-axis names
    assert "(dp)" in gpt2_plan.table() or "(tp)" in gpt2_plan.table() or " R" in gpt2_plan.table()


def test_summary_length_does_not_grow_with_depth(gpt2_plan):
    shallow = _plan("gpt2", 2, baselines=True)
    assert len(str(gpt2_plan).splitlines()) == len(str(shallow).splitlines())
    assert "transformer.h.{0..1}.mlp.c_fc.weight" in str(shallow)


def _check_alternatives(plan):
    checked = 0
    for name, entry in plan.inspection.alternatives.items():
        if "same_as" in entry:
            assert entry["same_as"] in plan.inspection.alternatives
            continue
        costs = [a["cost_s"] for a in entry["alternatives"]]
        assert costs == sorted(costs), name
        chosen = entry["chosen"]["cost_s"]
        assert all(c >= chosen - 1e-12 - 1e-9 * chosen for c in costs), (name, entry)
        for a in entry["alternatives"]:
            assert a["cost_s"] == pytest.approx(a["compute_s"] + a["comm_s"])
        checked += 1
    return checked


def test_explain_alternatives_are_ordered_and_the_chosen_is_cheapest():
    plan = _plan("gpt2", 2, share_layers=False)
    assert _check_alternatives(plan) > 50


def test_explain_alternatives_on_a_shared_layer_plan(gpt2_plan):
    assert _check_alternatives(gpt2_plan) > 20
    assert any("same_as" in e for e in gpt2_plan.inspection.alternatives.values())


def test_explain_text(gpt2_plan):
    text = gpt2_plan.explain("transformer.h.1.mlp.c_fc.weight")
    assert text.splitlines()[0].startswith("transformer_h_1_mlp_c_fc_weight (get_attr, transformer.h.1.mlp.c_fc.weight")
    assert "  chosen " in text and "  next best " in text and "communication" in text and "memory" in text
    tied = gpt2_plan.explain("lm_head.weight")  # a tied name finds the embedding's node
    assert "transformer.wte.weight" in tied
    module = gpt2_plan.explain("transformer.h.0.mlp.c_fc", nodes=True)  # every node run in the module
    assert module.count("  chosen ") >= 1 and "addmm" in module
    node = next(n for n in gpt2_plan.inspection.alternatives if "same_as" not in gpt2_plan.inspection.alternatives[n])
    assert gpt2_plan.explain(node).startswith(node)
    with pytest.raises(KeyError, match="not a parameter, buffer, module path or node"):
        gpt2_plan.explain("no.such.thing")


def test_inspection_survives_json(gpt2_plan):
    again = autoparallel.Plan.from_json(gpt2_plan.to_json())
    assert str(again) == str(gpt2_plan)
    assert again.explain("transformer.h.1.mlp.c_fc.weight") == gpt2_plan.explain("transformer.h.1.mlp.c_fc.weight")


def test_baselines_when_asked_printed_and_cached(gpt2_plan, tmp_path):
    base = gpt2_plan.inspection.baselines
    assert set(base) == {"DDP", "FSDP (ZeRO-3)", "Megatron TP over tp, DP over dp", "FSDP + TP"}
    step = gpt2_plan.estimate.step_time_s
    done = {n: b for n, b in base.items() if "step_time_s" in b}
    assert "DDP" in done and all(b["step_time_s"] >= step * (1 - 1e-9) for b in done.values())
    fastest = min(b["step_time_s"] for b in done.values())
    assert all(b["step_at_least_s"] > fastest for b in base.values() if "step_at_least_s" in b)
    lines = str(gpt2_plan).splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("vs this plan's step"))
    line = lines[at] + ("\n" + lines[at + 1] if lines[at + 1].startswith("  other recipes: ") else "")
    ddp = done["DDP"]["step_time_s"]
    assert f"DDP {units.seconds(ddp)} ({ddp / step:.2f}x" in line
    best = min(done, key=lambda n: done[n]["step_time_s"])
    assert (", the fastest recipe" in line) == (best == "DDP") and best in line
    for name, b in base.items():  # every recipe is on the two lines
        if "step_at_least_s" in b:
            assert f"{name} ≥ {b['step_at_least_s'] / step:.2f}x" in line
        elif "step_time_s" in b:
            assert f"{name} {b['step_time_s'] / step:.2f}x" in line or f"{name} {units.seconds(b['step_time_s'])}" in line
        else:
            assert "not possible: " in line and name in line
    with torch.device("meta"):
        model = hf_model("gpt2", layers=1)
    ids = torch.empty(4, 16, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids.clone()}
    first = autoparallel.plan(model, inputs, mesh_spec=MESH, cache_dir=tmp_path, baselines=True)
    again = autoparallel.plan(model, inputs, mesh_spec=MESH, cache_dir=tmp_path, baselines=True)
    assert first.solver_stats.cache == "miss" and again.solver_stats.cache == "hit"
    assert again.inspection.baselines == first.inspection.baselines and str(again) == str(first)
    off = autoparallel.plan(model, inputs, mesh_spec=MESH, cache_dir=tmp_path)  # the default: not priced
    assert off.solver_stats.cache == "miss" and off.inspection.baselines is None  # its own cache entry
    assert "data parallelism and hand-written recipes: not priced" in str(off)
    with pytest.raises(TypeError, match="baselines must be True or False"):
        autoparallel.plan(model, inputs, mesh_spec=MESH, cache_dir=False, baselines="yes")


@pytest.mark.parametrize("bad, field", [([1], "baselines must be an object"),
                                        ({"FSDP": {"step_at_least_s": "1"}}, "step_at_least_s must be seconds"),
                                        ({"DDP": {"step_time_s": -1.0, "comm_s": 0.0, "recompute_s": 0.0,
                                                  "peak_memory_bytes": None}}, "step_time_s must be seconds"),
                                        ({"DDP": {"reason": 3}}, "reason must be text"),
                                        ({"DDP": {"step_time_s": 1.0}}, "missing field")])
def test_plan_json_validates_baselines(gpt2_plan, bad, field):
    d = json.loads(gpt2_plan.to_json())
    d["inspection"]["baselines"] = bad
    with pytest.raises(ValueError, match=field):
        autoparallel.Plan.from_json(json.dumps(d))


def test_autoparallelize_plans_baselines_only_when_asked(sim_mesh):
    torch.manual_seed(0)
    model = hf_model("gpt2", layers=1)
    ids = torch.empty(4, 16, dtype=torch.long, device="meta")
    inputs = {"input_ids": ids, "labels": ids.clone()}
    mesh = sim_mesh((2,))
    on = autoparallel.autoparallelize(copy.deepcopy(model), inputs, device_mesh=mesh, cache_dir=False, baselines=True)
    assert "step_time_s" in on.plan.inspection.baselines["DDP"]
    assert "vs this plan's step, same cost model: DDP" in str(on.plan)
    off = autoparallel.autoparallelize(copy.deepcopy(model), inputs, device_mesh=mesh, cache_dir=False)
    assert off.plan.inspection.baselines is None and "baselines" not in off.plan.solver_stats.stage_s
    with pytest.raises(TypeError, match="baselines must be True or False"):
        autoparallel.autoparallelize(model, inputs, device_mesh=mesh, baselines=None)


def test_summary_fits_one_screen_in_one_unit_per_value(gpt2_plan):
    """str(plan) of a 4-layer GPT-2 is under 40 lines, and every time and size is printed by
    autoparallel.units: no raw floats, no fractions of a MiB."""
    import re

    text = str(gpt2_plan)
    assert len(text.splitlines()) <= 40, text
    assert not re.search(r"\d\.\d+e-\d", text) and not re.search(r"\b0\.0\d* (s|ms|MiB|GiB)\b", text), text
    assert f"estimated step {units.seconds(gpt2_plan.estimate.step_time_s)} = " in text
    assert f"peak memory {units.nbytes(gpt2_plan.estimate.peak_memory_bytes)} per device" in text


def test_table_is_per_module_by_default(gpt2_plan):
    """One row per module path with the parameters it holds and their placements; the
    per-node table behind by="node"."""
    table = gpt2_plan.table()
    rows = {ln.split()[0]: ln for ln in table.splitlines() if ln.startswith("transformer")}
    assert len(table.splitlines()) < 70 and max(len(ln) for ln in table.splitlines()[:-1]) < 130, table
    fc = rows["transformer.h.3.mlp.c_fc"]
    placed = units.nbytes(sum(n.memory_bytes for n in gpt2_plan.nodes.values()
                              if n.module_path == "transformer.h.3.mlp.c_fc"
                              or (gpt2_plan.inspection.state_nodes.get(n.name) or [""])[0].startswith(
                                  "transformer.h.3.mlp.c_fc.")))
    assert "weight " in fc and "bias " in fc and fc.rstrip().endswith(placed), (fc, placed)
    assert "transformer.h.3.attn" in rows and "addmm" not in table and "(top level)" in table
    assert table.splitlines()[-1].startswith("mesh (2, 2): estimated step ")
    nodes = gpt2_plan.table(by="node")
    assert "input specs → output spec" in nodes and "addmm" in nodes
    with pytest.raises(ValueError, match="by is 'module'"):
        gpt2_plan.table(by="layer")
    with pytest.raises(ValueError, match="by='node', all_nodes=True"):
        gpt2_plan.table(all_nodes=True)


def test_table_cuts_long_parameter_lists():
    from autoparallel.table import PARAMETERS_WIDTH, _shorten

    assert _shorten("weight R") == "weight R"
    long = ", ".join(f"w{i} S0(dp) S1(tp)" for i in range(10))
    assert len(_shorten(long)) == PARAMETERS_WIDTH and _shorten(long).endswith("…")


def test_explain_a_module_line_per_part(gpt2_plan):
    """A module is explained by its submodules and parameters, one line each; node by node on request."""
    text = gpt2_plan.explain("transformer.h.3.attn")
    lines = text.splitlines()
    assert lines[0].startswith("transformer.h.3.attn: ") and len(lines) <= 10, text
    parts = [ln.split()[0] for ln in lines[2:-1]]
    assert parts[:2] == ["c_attn", "c_proj"] and "(its" in parts, text
    assert "nodes=True" in lines[-1]
    leaf = gpt2_plan.explain("transformer.h.3.mlp.c_fc")
    weight = next(ln for ln in leaf.splitlines() if ln.split()[0] == "weight")
    spec = gpt2_plan.param_placements["transformer.h.3.mlp.c_fc.weight"]
    assert f"[64, 256] {autoparallel.summary.named(gpt2_plan, spec)}, " in weight and "next best " in weight, leaf
    detail = gpt2_plan.explain("transformer.h.3.attn", nodes=True)
    assert detail.count("  chosen ") > 3 and len(detail.splitlines()) > len(lines)
