"""Plans are checked before they are used: their structure by ``Plan.from_json``, their fit to
the graph by ``validate_plan``; the plan cache ignores (and replaces) what does not fit and
survives a folder it cannot write."""

import contextlib
import copy
import json
import logging
import os
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoparallel
from autoparallel import cache
from autoparallel.errors import PlanMismatchError
from autoparallel.options import PlanOptions
from autoparallel.solver.pipeline import plan_traced
from autoparallel.passes import apply_plan
from autoparallel.passes.dropout import shard_random_ops
from autoparallel.plan import MOVE_KINDS, Plan
from autoparallel.tracer import ColoTracer
from autoparallel.validate import validate_plan
from models import MLP, ShardParams, batch_for, hf_model, to_meta

CPU = autoparallel.CostModel("cpu")


class Ema(nn.Module):
    """In-place updates of buffers (a counter, a chained ``mul_().add_()``): edges that must
    not be resharded, buffers that must stay replicated."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x, y):
        self.steps += 1
        self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        return F.mse_loss(self.lin(x - self.ema), y)


def _mlp(hidden=64, layers=2, batch=8):
    with torch.device("meta"):
        model = MLP(hidden=hidden, layers=layers)
    return model, {"x": torch.empty(batch, hidden, device="meta"), "y": torch.empty(batch, hidden, device="meta")}


def _gpt2(layers=2, batch=8, seq=16):
    pytest.importorskip("transformers")
    with torch.device("meta"):
        model = hf_model("gpt2", layers=layers)
    return model, to_meta(batch_for("gpt2", 0, batch=batch, seq=seq))


def _ema():
    return Ema(), {"x": torch.empty(32, 16, device="meta"), "y": torch.empty(32, 16, device="meta")}


def _solved(make, mesh_shape, budget_frac=None, **kw):
    """(traced, plan) of ``make()`` on ``mesh_shape``; with ``budget_frac``, under that fraction
    of the unconstrained plan's modelled peak memory."""
    model, inputs = make()
    traced = ColoTracer().trace(model, inputs)
    options = PlanOptions(**{"cost_model": CPU, "time_limit": 30, "cache_dir": False, **kw})
    plan = plan_traced(traced, autoparallel.MeshSpec(mesh_shape), options)
    if budget_frac is not None:
        budget = int(budget_frac * plan.estimate.peak_memory_bytes)
        plan = plan_traced(traced, autoparallel.MeshSpec(mesh_shape), PlanOptions.build(options, memory_budget=budget))
    return traced, plan


# ------------------------------------------------------------------ structure: Plan.from_json
@pytest.fixture(scope="module")
def mlp_plan():
    return _solved(_mlp, (2,), cost_model=ShardParams("cpu"))


def test_from_json_reads_plans_saved_with_the_old_field_name(mlp_plan):
    """Plans saved before 'conversions' was renamed 'redistributions' still load, unchanged."""
    d = json.loads(mlp_plan[1].to_json())
    d["conversions"] = d.pop("redistributions")
    assert d["conversions"] and Plan.from_json(json.dumps(d)) == mlp_plan[1]


@pytest.mark.parametrize("spec, match", [
    (["S99"], "splits dim 99 of a 2-dim tensor"), (["S-1"], "bad placement 'S-1'"), (["S01"], "bad placement"),
    (["Q"], "bad placement 'Q'"), ([0], "bad placement 0"), ("S0", "must be a list"),
    (["S0", "R", "R"], "has 3 placements, the mesh"), ([], "has 0 placements"),
])
def test_from_json_rejects_bad_specs(mlp_plan, spec, match):
    d = json.loads(mlp_plan[1].to_json())
    d["nodes"][0]["output_specs"][0] = spec
    with pytest.raises(ValueError, match=match):
        Plan.from_json(json.dumps(d))


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("nodes"), r"missing field\(s\) \['nodes'\]"),
    (lambda d: d.update(extra=1), r"unknown field\(s\) \['extra'\]"),
    (lambda d: d["nodes"][1].update(name=d["nodes"][0]["name"]), "appears twice"),
    (lambda d: d["nodes"][0].update(out_shapes=[[64, "64"]]), "out_shapes.* must be a list of ints >= 0"),
    (lambda d: d["nodes"][0].update(compute_s="fast"), "compute_s must be a number"),
    (lambda d: d["nodes"][0].pop("op"), r"missing field\(s\) \['op'\]"),
    (lambda d: d["redistributions"][0]["moves"][0].__setitem__(0, "teleport"), "kind 'teleport' is not one of"),
    (lambda d: d["redistributions"][0]["moves"][0].__setitem__(1, 1), "along mesh axis 1 of a 1-axis mesh"),
    (lambda d: d["redistributions"][0]["moves"].append([1, 2]), "expected \\[kind, mesh axis"),
    (lambda d: d["redistributions"][0].update(arg=-1), "arg must be an int >= 0"),
    (lambda d: d["param_placements"].update({"layers.0.weight": ["S0", "R"]}), "has 2 placements"),
    (lambda d: d["mesh"].update(shape=[2, 0]), "mesh: .*at least 1 device"),
    (lambda d: d["mesh"].update(beta=[-1.0]), "mesh: .*beta must be positive"),
    (lambda d: d["estimate"].update(step_time_s="1 s"), "step_time_s must be a number"),
    (lambda d: d.update(checkpoint={"stages": {"linear": 0}, "regions": [{"start": 0, "stop": 5, "children": []}],
                                    "table": [], "recompute_s": 0.0}), r"covers stages \[0, 5\)"),
])
def test_from_json_rejects_bad_structure(mlp_plan, edit, match):
    d = json.loads(mlp_plan[1].to_json())
    edit(d)
    with pytest.raises(ValueError, match=match):
        Plan.from_json(json.dumps(d))


def test_from_json_rejects_text_that_is_no_plan():
    for text in ("", "[]", "null", '{"mesh": 1}', "{"):
        with pytest.raises(ValueError):
            Plan.from_json(text)


def test_from_json_fuzz_raises_only_value_error(mlp_plan):
    """Any value in any place: a plan or a ValueError, never another exception."""
    rng = random.Random(0)
    base = json.loads(mlp_plan[1].to_json())
    junk = [None, True, -1, 0, 2, 1.5, float("nan"), "", "R", "S0", "x", [], [1], ["S0"], {}, {"a": 1}]

    def slots(v, path=()):
        yield path
        if isinstance(v, dict):
            for k, x in v.items():
                yield from slots(x, path + (k,))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                yield from slots(x, path + (i,))

    paths = [p for p in slots(base) if p]
    for _ in range(400):
        d = copy.deepcopy(base)
        path = rng.choice(paths)
        target = d
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = rng.choice(junk)
        with contextlib.suppress(ValueError):  # any other exception fails the test
            Plan.from_json(json.dumps(d))


# ------------------------------------------------------------------ fit: validate_plan
def test_solved_plans_validate(mlp_plan):
    traced, plan = mlp_plan
    validate_plan(plan, traced)
    validate_plan(Plan.from_json(plan.to_json()), traced, mesh_shape=(2,))
    with pytest.raises(PlanMismatchError, match=r"plan is for a mesh of shape \(2,\), the mesh .* has shape \(4,\)"):
        validate_plan(plan, traced, mesh_shape=(4,))


@pytest.mark.parametrize("other, match", [
    (lambda: _mlp(layers=3), "has no entry for this node"),
    (lambda: _mlp(hidden=32), "out_shapes"),
    (lambda: _mlp(batch=16), "out_shapes"),
], ids=["deeper", "narrower", "other-batch"])
def test_foreign_plan_is_rejected(mlp_plan, other, match):
    traced_other = ColoTracer().trace(*other())
    with pytest.raises(PlanMismatchError, match=match) as e:
        validate_plan(mlp_plan[1], traced_other)
    assert "autoparallel.plan(" in str(e.value)  # says what to do


def test_plan_of_another_model_is_rejected(mlp_plan):
    traced_ema = ColoTracer().trace(*_ema())
    with pytest.raises(PlanMismatchError, match="node .* has no entry|the graph has no such node"):
        validate_plan(mlp_plan[1], traced_ema)


def _emitted(traced, plan):
    """What the module runs: the per-device graph's code (collectives and local ops), the
    parameter placements it distributes, the mesh shape and the checkpoint stages. The
    checkpoint regions are left out: they choose what is recomputed, not what is computed."""
    targets = set(traced.params) | set(traced.buffers)
    graph = apply_plan(traced.gm, plan, [f"group{a}" for a in range(plan.mesh.ndim)], "cpu", targets,
                       plan.mesh.size, traced_on=traced.device)
    shard_random_ops(graph, plan)
    code = graph.python_code("self").src
    return code, plan.param_placements, plan.mesh.shape, plan.checkpoint.stages if plan.checkpoint else None


INFORMATIONAL = {"node.compute_s", "node.comm_s", "node.memory_bytes", "redistribution.cost_s", "move.nbytes",
                 "mesh.axis_names", "mesh.alpha", "mesh.beta", "estimate", "solver_stats", "inspection",
                 "checkpoint.table", "checkpoint.recompute_s", "checkpoint.every_stage"}


def _tokens(rank):
    return ["R", "P"] + [f"S{d}" for d in range(rank + 1)] + ["S99"]


def _tampers(d, rng, per_kind):
    """``(kind, edit)`` single-field edits of plan JSON ``d``: every kind of field, up to
    ``per_kind`` (sampled) of each kind."""
    nodes, convs = d["nodes"], d["redistributions"]
    names = [n["name"] for n in nodes]
    ndim = len(d["mesh"]["shape"])
    out = {}

    def add(kind, fn):
        out.setdefault(kind, []).append(fn)

    def set_at(*path, value):
        def fn(x):
            for k in path[:-1]:
                x = x[k]
            x[path[-1]] = value
        return fn

    for i, n in enumerate(nodes):
        add("node.name", set_at("nodes", i, "name", value=n["name"] + "_x"))
        add("node.name", set_at("nodes", i, "name", value=names[(i + 1) % len(names)]))
        add("node.op", set_at("nodes", i, "op", value="relu.default" if n["op"] != "relu.default" else "gelu.default"))
        add("node.module_path", set_at("nodes", i, "module_path", value=n["module_path"] + ".x"))
        for k in ("in_shapes", "out_shapes"):
            for j, sh in enumerate(n[k]):
                if sh:
                    add(f"node.{k}", set_at("nodes", i, k, j, 0, value=sh[0] * 2 + 1))
                add(f"node.{k}", set_at("nodes", i, k, j, value=sh + [2]))
            add(f"node.{k}", set_at("nodes", i, k, value=n[k][:-1]))
        for k, shapes in (("input_specs", "in_shapes"), ("output_specs", "out_shapes")):
            for j, spec in enumerate(n[k]):
                rank = len(n[shapes][j]) if j < len(n[shapes]) else 0
                for a in range(ndim):
                    for tok in _tokens(rank):
                        if tok != spec[a]:
                            add(f"node.{k}", set_at("nodes", i, k, j, a, value=tok))
                add(f"node.{k}", set_at("nodes", i, k, j, value=spec + ["R"]))
            add(f"node.{k}", set_at("nodes", i, k, value=n[k][:-1]))
            add(f"node.{k}", set_at("nodes", i, k, value=n[k] + [["R"] * ndim]))
        add("node.compute_s", set_at("nodes", i, "compute_s", value=n["compute_s"] * 3 + 1e-3))
        add("node.comm_s", set_at("nodes", i, "comm_s", value=n["comm_s"] + 1.0))
        add("node.memory_bytes", set_at("nodes", i, "memory_bytes", value=n["memory_bytes"] + 7))
    for i, c in enumerate(convs):
        add("redistribution.src", set_at("redistributions", i, "src", value=next(x for x in names if x != c["src"])))
        add("redistribution.src_index", set_at("redistributions", i, "src_index", value=c["src_index"] + 1))
        add("redistribution.dst", set_at("redistributions", i, "dst", value=next(x for x in names[::-1] if x != c["dst"])))
        add("redistribution.dst", set_at("redistributions", i, "dst", value="output" if c["dst"] != "output" else names[-1]))
        add("redistribution.arg", set_at("redistributions", i, "arg", value=c["arg"] + 1))
        if c["shape"]:
            add("redistribution.shape", set_at("redistributions", i, "shape", 0, value=c["shape"][0] * 2))
        add("redistribution.shape", set_at("redistributions", i, "shape", value=c["shape"] + [1]))
        add("redistribution.cost_s", set_at("redistributions", i, "cost_s", value=c["cost_s"] * 2 + 1.0))
        add("redistribution.moves", set_at("redistributions", i, "moves", value=[]))
        add("redistribution.moves", set_at("redistributions", i, "moves", value=c["moves"] + c["moves"][:1]))
        add("redistributions", lambda x, i=i: x["redistributions"].pop(i))
        add("redistributions", lambda x, i=i: x["redistributions"].append(copy.deepcopy(x["redistributions"][i])))
        rank = len(c["shape"])
        for k, m in enumerate(c["moves"]):
            add("redistribution.moves", lambda x, i=i, k=k: x["redistributions"][i]["moves"].pop(k))
            for kind in MOVE_KINDS:
                if kind != m[0]:
                    add("move.kind", set_at("redistributions", i, "moves", k, 0, value=kind))
            for axis in range(ndim + 1):
                if axis != m[1]:
                    add("move.axis", set_at("redistributions", i, "moves", k, 1, value=axis))
            for slot, kind in ((2, "move.src_dim"), (3, "move.dst_dim")):
                for dim in [None] + list(range(rank + 1)):
                    if dim != m[slot]:
                        add(kind, set_at("redistributions", i, "moves", k, slot, value=dim))
            add("move.nbytes", set_at("redistributions", i, "moves", k, 4, value=m[4] + 8))
    for name, spec in d["param_placements"].items():
        node = next((n for n in nodes if n["op"] == "get_attr" and n["name"] == name.replace(".", "_")), None)
        rank = len(node["out_shapes"][0]) if node else 1
        for a in range(ndim):
            for tok in _tokens(rank):
                if tok != spec[a]:
                    add("param_placements", set_at("param_placements", name, a, value=tok))
        add("param_placements", lambda x, name=name: x["param_placements"].pop(name))
    add("param_placements", set_at("param_placements", "ghost.weight", value=["R"] * ndim))
    for shape in ([4], [2, 2], [1], [2], [2, 2, 2]):
        if shape != d["mesh"]["shape"]:
            add("mesh.shape", lambda x, shape=shape: x["mesh"].update(
                shape=shape, axis_names=[f"a{i}" for i in range(len(shape))], alpha=[1e-6] * len(shape),
                beta=[1e-9] * len(shape)))
    add("mesh.axis_names", set_at("mesh", "axis_names", value=[f"axis{i}" for i in range(ndim)]))
    add("mesh.alpha", set_at("mesh", "alpha", value=[1e-3] * ndim))
    add("mesh.beta", set_at("mesh", "beta", value=[1e-6] * ndim))
    add("estimate", set_at("estimate", "step_time_s", value=123.0))
    add("solver_stats", set_at("solver_stats", "solve_s", value=99.0))
    add("inspection", set_at("inspection", "fallback_ops", value=["aten.ghost"]))
    cp = d["checkpoint"]
    if cp:
        for name, s in cp["stages"].items():
            add("checkpoint.stages", set_at("checkpoint", "stages", name, value=s + 1))
        add("checkpoint.stages", lambda x: x["checkpoint"]["stages"].pop(next(iter(cp["stages"]))))
        add("checkpoint.stages", set_at("checkpoint", "stages", "ghost", value=0))
        for i, r in enumerate(cp["regions"]):
            add("checkpoint.regions", set_at("checkpoint", "regions", i, "stop", value=r["stop"] - 1))
            add("checkpoint.regions", set_at("checkpoint", "regions", i, "start", value=r["start"] + 1))
            add("checkpoint.regions", set_at("checkpoint", "regions", i, "stop", value=r["stop"] + 100))
        add("checkpoint.table", set_at("checkpoint", "table", 0, "recompute_s", value=5.0))
        add("checkpoint.recompute_s", set_at("checkpoint", "recompute_s", value=5.0))
        add("checkpoint.every_stage", set_at("checkpoint", "every_stage", value={}))
    return [(kind, fn) for kind, fns in sorted(out.items())
            for fn in (fns if len(fns) <= per_kind else rng.sample(fns, per_kind))]


def _tamper_all(traced, plan, per_kind):
    """Apply the tampers: each must be rejected, unless it edits an informational field or
    moves a checkpoint region within the stages, and then emit exactly what the plan emits."""
    base = json.loads(plan.to_json())
    want = _emitted(traced, plan)
    counts = {"from_json": 0, "validate": 0, "harmless": 0}
    kinds = set()
    for kind, edit in _tampers(base, random.Random(0), per_kind):
        d = copy.deepcopy(base)
        edit(d)
        if d == base:  # e.g. dropping the last of no input specs
            continue
        kinds.add(kind)
        try:
            tampered = Plan.from_json(json.dumps(d))
        except ValueError:
            assert kind not in INFORMATIONAL, (kind, d)
            counts["from_json"] += 1
            continue
        try:
            validate_plan(tampered, traced, mesh_shape=plan.mesh.shape)
        except PlanMismatchError:
            assert kind not in INFORMATIONAL, kind
            counts["validate"] += 1
            continue
        assert kind in INFORMATIONAL or kind == "checkpoint.regions", f"accepted a tamper of {kind}"
        assert _emitted(traced, tampered) == want, f"accepted a tamper of {kind} that changes the module"
        counts["harmless"] += 1
    return counts, kinds


@pytest.mark.parametrize("make, mesh_shape, per_kind, options, moves", [
    (lambda: _mlp(layers=4, batch=32), (2, 2), 15, {"cost_model": ShardParams("cpu")},
     {"all_gather", "all_reduce", "slice"}),
    (_ema, (2,), 30, {"budget_frac": 0.7}, {"all_gather", "all_reduce", "slice"}),
    (lambda: _gpt2(layers=2), (4,), 3, {"cost_model": ShardParams("cpu"), "budget_frac": 0.93, "zero": False},
     set(MOVE_KINDS)),  # without ZeRO, whose plan at this budget needs no all-to-all
    (lambda: _gpt2(layers=2, seq=32), (2,), 2, {"cost_model": ShardParams("cpu"), "budget_frac": 0.8,
                                                 "offload": False, "zero": False},
     {"all_gather", "all_reduce", "all_to_all", "slice"}),
], ids=["mlp-2x2", "inplace-buffers", "gpt2-4", "gpt2-checkpointed"])
def test_single_field_tampers_are_rejected_or_harmless(make, mesh_shape, per_kind, options, moves, request):
    traced, plan = _solved(make, mesh_shape, **options)
    assert {m.kind for c in plan.redistributions for m in c.moves} >= moves  # the plan exercises these
    assert bool(plan.checkpoint) == request.node.callspec.id.endswith("checkpointed")
    counts, kinds = _tamper_all(traced, plan, per_kind)
    assert {"node.input_specs", "node.output_specs", "node.name", "node.op", "node.in_shapes", "node.out_shapes",
            "redistribution.moves", "move.kind", "move.axis", "param_placements", "mesh.shape"} <= kinds
    assert counts["validate"] > 0 and counts["from_json"] > 0


# ------------------------------------------------------------------ the plan cache
def _cache_warnings(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("autoparallel") and r.levelno == logging.WARNING]


def _only_file(folder):
    files = list(folder.glob("*.json"))
    assert len(files) == 1, files
    return files[0]


@pytest.mark.parametrize("spoil", ["foreign", "tampered", "other-alpha", "truncated"])
def test_cache_ignores_and_replaces_a_plan_that_does_not_fit(tmp_path, caplog, spoil):
    model, inputs = _mlp(layers=3)
    kw = dict(mesh_shape=(2,), cost_model=ShardParams("cpu"), cache_dir=tmp_path)
    first = autoparallel.plan(model, inputs, **kw)
    path = _only_file(tmp_path)
    d = json.loads(path.read_text())
    if spoil == "foreign":  # another model's plan under this model's key
        other, other_inputs = _mlp(layers=2)
        text = autoparallel.plan(other, other_inputs, mesh_shape=(2,), cache_dir=False).to_json()
    elif spoil == "tampered":  # one parameter moved: its node and consumers no longer agree with it
        placements = d["param_placements"]
        placements["layers.1.weight"] = ["S1"] if placements["layers.1.weight"] != ["S1"] else ["R"]
        text = json.dumps(d)
    elif spoil == "other-alpha":  # priced for another network
        d["mesh"]["alpha"] = [1.0]
        text = json.dumps(d)
    else:
        text = path.read_text()[:100]
    path.write_text(text)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="autoparallel"):
        again = autoparallel.plan(model, inputs, **kw)
    assert again.solver_stats.cache == "miss"
    assert any("planning again" in m for m in _cache_warnings(caplog)), caplog.text
    stored = Plan.from_json(path.read_text())  # replaced by the new plan
    assert [n.to_json() for n in stored.nodes.values()] == [n.to_json() for n in first.nodes.values()]
    assert stored.param_placements == again.param_placements == first.param_placements
    caplog.clear()
    assert autoparallel.plan(model, inputs, **kw).solver_stats.cache == "hit" and not _cache_warnings(caplog)


def test_cache_ignores_a_plan_that_moves_a_pinned_parameter(tmp_path, caplog):
    from torch.distributed.tensor import Replicate

    model, inputs = _mlp()
    traced = ColoTracer().trace(model, inputs)

    def plan(cache_dir, pinned=None):
        return plan_traced(traced, autoparallel.MeshSpec((2,)),
                           PlanOptions(cost_model=ShardParams("cpu"), time_limit=10, cache_dir=cache_dir), pinned=pinned)

    sharded = plan(tmp_path / "free")
    pinned = {name: (Replicate(),) for name in sharded.param_placements}
    assert sharded.param_placements != pinned
    plan(tmp_path / "pinned", pinned)
    _only_file(tmp_path / "pinned").write_text(sharded.to_json())  # fits the graph, not the pins
    with caplog.at_level(logging.WARNING, logger="autoparallel"):
        again = plan(tmp_path / "pinned", pinned)
    assert again.solver_stats.cache == "miss" and again.param_placements == pinned
    assert any("moves a parameter" in m for m in _cache_warnings(caplog))


@pytest.mark.parametrize("how", ["path-is-a-file", "read-only", "disk-full"])
def test_cache_write_failure_is_a_warning(tmp_path, caplog, monkeypatch, how):
    folder = tmp_path / "cache"
    if how == "path-is-a-file":
        folder.write_text("not a folder")
    elif how == "read-only":
        folder.mkdir()
        folder.chmod(0o500)
        if os.access(folder, os.W_OK):  # root writes anyway: the write fails as it would for a user
            def denied(self, *args, **kwargs):
                raise PermissionError(13, "Permission denied", str(self))

            monkeypatch.setattr(cache.Path, "write_text", denied)
    else:
        def full(self, *args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(cache.Path, "write_text", full)
    model, inputs = _mlp()
    with caplog.at_level(logging.WARNING, logger="autoparallel"):
        p = autoparallel.plan(model, inputs, mesh_shape=(2,), cache_dir=folder)
    assert p.solver_stats.cache == "miss" and p.nodes
    warnings = _cache_warnings(caplog)
    assert len(warnings) == 1 and "could not write the plan cache" in warnings[0], warnings
    if how != "path-is-a-file":
        assert not list(folder.iterdir())  # no temporary file left behind
