"""The command line (autoparallel.cli) and the Config it is derived from (autoparallel.config),
run in-process with tiny models: every value checked before any tracing, one line per error."""

from __future__ import annotations

import json
import math
import re
import time
import warnings

import pytest

import autoparallel
from autoparallel import Config, ConfigError
from autoparallel.cli import main

pytest.importorskip("transformers")

TINY = ["--model", "gpt2", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128", "--batch", "4",
        "--seq", "16", "--cache", "off"]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    err = [line for line in err if "Warning" not in line and "warn" not in line]
    assert len(err) == 1, err
    return err[0]


# ---------------------------------------------------------------------- Config
def test_config_from_toml_gives_plan_options_and_mesh(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('mesh = [2, 4]\nmesh_axes = ["dp", "tp"]\nmp_policy = "bf16"\nmemory_budget = "12GiB"\n'
                    'checkpointing = "full"\ncost_model = "h100"\ncache = "off"\n[model]\nlayers = 3\n')
    config = Config.from_toml(path)
    assert config.mesh == (2, 4) and config.axis_names() == ("dp", "tp")
    opts = config.plan_options()
    assert opts.mp_policy.param_dtype is autoparallel.precision.torch.bfloat16
    assert opts.memory_budget == "12GiB" and opts.checkpointing == "full" and opts.cache_dir is False
    assert opts.cost_model.device.name == "h100"
    assert config.plan_keywords()["mesh_spec"] == autoparallel.MeshSpec((2, 4), ("dp", "tp"))
    assert Config().plan_options() == autoparallel.PlanOptions(), "defaults are PlanOptions' own"


@pytest.mark.parametrize("data, match", [
    ({"memory_budjet": "1GiB"}, "unknown key 'memory_budjet'; did you mean 'memory_budget'"),
    ({"solver": "gurobi"}, "solver must be one of 'cbc', 'highs'"),
    ({"strict": "yes"}, "strict must be true or false"),
    ({"mesh": [2, 0]}, "every axis at least 1"),
    ({"mesh": "2x"}, "mesh '2x': expected devices per axis"),
    ({"mesh": [2, 2], "mesh_axes": ["dp"]}, "names 1 axes but mesh 2x2 has 2"),
    ({"memory_budget": "12 parsecs"}, "cannot read memory budget"),
    ({"mp_policy": "int8"}, "mp_policy must be one of"),
    ({"cost_model": "tpu"}, "cost_model must be 'auto' or a device preset"),
])
def test_bad_config_values_are_one_line_errors(data, match):
    with pytest.raises(ConfigError, match=match) as e:
        Config.from_dict(data)
    assert "\n" not in str(e.value)


def test_deprecated_keys_warn_once_and_map_to_one_name():
    from autoparallel import config as config_module

    config_module._warned.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert Config.from_dict({"mesh_shape": [4]}).mesh == (4,)
        assert Config.from_dict({"mesh_shape": [4]}).mesh == (4,)
    assert [str(x.message) for x in w] == ["config: 'mesh_shape' is deprecated; use 'mesh'"]
    with pytest.raises(ConfigError, match="give 'mesh' only"):
        Config.from_dict({"mesh_shape": [4], "mesh": [4]})


# ---------------------------------------------------------------------- bad command lines
@pytest.mark.parametrize("args, match", [
    (["plan", "--layers", "-1"], "layers must be a positive integer, not -1"),
    (["plan", "--mesh", "2x"], "--mesh: mesh '2x': expected devices per axis"),
    (["plan", "--solver", "gurobi"], "invalid choice 'gurobi' for argument '--solver'"),
    (["plan", "--hidden", "100", "--heads", "3"], "heads (3) must divide hidden (100)"),
    (["plan", "--memory-budget", "12parsecs"], "cannot read memory budget '12parsecs'"),
    (["plan", "--mesh", "2x2", "--mesh-axes", "dp"], "names 1 axes but mesh 2x2 has 2"),
    (["plan", "--constraint", "lm_head.weight=S0(zz)", "--mesh-axes", "dp", "tp"], "unknown mesh axis 'zz'"),
    (["plan", "--constraint", "lm_head.weight"], "expected PATTERN=PLACEMENTS"),
    (["plan", "--json", "/nonexistent-folder/plan.json"], "folder /nonexistent-folder does not exist"),
    (["coverage", "--factory", "nomodule"], "expected package.module:function"),
    (["plan", "--config", "/nonexistent.toml"], "cannot read config file /nonexistent.toml"),
    (["frobnicate"], "frobnicate"),
])
def test_bad_arguments_print_one_line_before_any_tracing(args, match, capsys):
    t0 = time.perf_counter()
    assert main(args) == 2
    line = _error_line(capsys)
    assert line.startswith("python -m autoparallel") and ": error: " in line, line
    assert match in line, line
    assert time.perf_counter() - t0 < 5, "checked before tracing"


def test_a_report_folder_that_cannot_be_written_is_refused_before_planning(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["report", str(blocker / "out"), *TINY]) == 2
    assert "report folder" in _error_line(capsys)


def test_help_lists_every_option_with_a_default(capsys):
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"]) if False else __import__("autoparallel.cli").cli.parse(["plan", "--help"])
    assert e.value.code == 0
    out = re.sub(r"\s+", " ", capsys.readouterr().out)
    for flag in ("--mesh AxB", "--layers INT", "--hidden INT", "--batch INT", "--mp-policy", "--memory-budget",
                 "--optimizer", "--checkpointing {auto,off,full,selective}", "--config FILE.toml"):
        assert flag in out, flag
    assert "(default: 2)" in out and "(default: 2x2)" in out


# ---------------------------------------------------------------------- commands
def test_config_file_then_flags(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('mesh = [4]\ncost_model = "cpu"\n[model]\nmodel = "gpt2"\nhidden = 64\nvocab = 128\n'
                    'layers = 1\nbatch = 4\nseq = 16\n')
    out = tmp_path / "plan.json"
    assert main(["plan", "--config", str(path), "--mesh", "2x2", "--mesh-axes", "dp", "tp", "--cache", "off",
                 "--json", str(out)]) == 0
    assert capsys.readouterr().out.startswith("plan for a mesh of 4 devices: 2 (dp) × 2 (tp); priced by preset cpu")
    plan = autoparallel.Plan.from_json(out.read_text())
    assert plan.mesh.shape == (2, 2)


def test_report_command_writes_the_four_files(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    assert main(["report", str(out), *TINY, "--mesh", "2"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["plan.json", "plan.png", "summary.txt", "table.txt"]
    assert json.loads((out / "plan.json").read_text())["mesh"]


def test_compare_command(capsys):
    assert main(["compare", *TINY, "--mesh", "2"]) == 0
    assert "vs this plan's step, same cost model: DDP" in capsys.readouterr().out


def test_checkpointing_full_through_the_cli(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", *TINY[:3], "2", *TINY[4:], "--mesh", "2", "--checkpointing", "full", "--json",
                 str(out)]) == 0
    plan = autoparallel.Plan.from_json(out.read_text())
    assert plan.checkpoint is not None and plan.estimate.recompute_s > 0


def test_coverage_command(capsys):
    assert main(["coverage", *TINY]) == 0
    assert "aten." in capsys.readouterr().out


# ---------------------------------------------------------------------- the training recipe
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [["--layers", "2"], ["--layers", "6", "--mesh-axes", "pp"]],
                         ids=["data", "pipeline"])
def test_train_saves_and_resume_continues_the_losses(tmp_path, capfd, layout):
    """``python -m autoparallel train`` runs examples/train.py under torchrun on 2 gloo processes:
    4 steps saving at step 2, then a run resumed from that checkpoint gives the same losses for
    steps 3 and 4; with the mesh axis named ``pp`` as two pipeline stages, every rank reading
    the global batch and holding its stage's parameters and optimizer state."""
    ckpt = str(tmp_path / "ckpt")
    common = ["--model", "gpt2", "--hidden", "64", "--vocab", "128", "--batch", "8", "--seq", "16", "--mesh", "2",
              "--cost-model", "cpu", "--cache", "off", "--steps", "4", "--checkpoint-dir", ckpt, *layout]
    printed = []

    def losses() -> list[float]:
        out = capfd.readouterr().out
        printed.append(out)
        line = [x for x in out.splitlines() if x.startswith("losses: ")]
        assert line, out[-2000:]
        return json.loads(line[-1].removeprefix("losses: "))

    assert main(["train", *common, "--save-at", "2"]) == 0
    full = losses()
    assert ("pipeline over mesh axis pp (2 devices)" in printed[0]) == ("pp" in layout)
    assert len(full) == 4 and all(math.isfinite(x) for x in full)
    assert main(["train", *common, "--resume"]) == 0
    assert losses() == full[2:]


@pytest.mark.slow  # ~50 s: the infeasible "auto" search solves many ILPs
def test_checkpointing_off_refuses_recomputation_that_auto_tries():
    """Under a budget nothing fits, "auto" has tried recomputing activations (its message says
    so), "off" has not; "full" checkpoints every stage whatever the budget."""
    from autoparallel.demo import ModelConfig

    model, inputs = ModelConfig(layers=2, hidden=64, vocab=128, batch=8, seq=16).build("meta")
    run = Config(mesh=(2,), cache="off", memory_budget=1000)
    with pytest.raises(autoparallel.InfeasiblePlanError, match="even recomputing activations"):
        autoparallel.plan(model, inputs, **run.plan_keywords())
    with pytest.raises(autoparallel.InfeasiblePlanError, match="no plan fits") as e:
        autoparallel.plan(model, inputs, **run.replace(checkpointing="off").plan_keywords())
    assert "recomputing" not in str(e.value)
    full = autoparallel.plan(model, inputs, **run.replace(checkpointing="full", memory_budget=None).plan_keywords())
    assert full.checkpoint is not None and full.estimate.recompute_s > 0
