"""Smoke run of ``benchmarks/vs_torch.py --quick`` on 2 gloo processes: every row of the table is
there (autoparallel, autoparallel data, DDP, FSDP2 and TP for GPT-2 and Llama on mesh (2,)), each
measured row has a step time, an estimate where it is an autoparallel row, a peak, and the step-0
loss of the eager model; GPT-2's TP row says why it is not expressible. Likewise ``memory_bound.py
--quick`` on 2 processes and ``vs_torch.py --pipeline --quick`` on 4. Timings are not checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "vs_torch.py")
ROWS = ["autoparallel", "autoparallel data", "DDP", "FSDP2", "TP"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_vs_torch_quick_two_processes(tmp_path):
    out = tmp_path / "bench.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--quick", "--worlds", "2", "--json", str(out)], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=570)
    assert proc.returncode == 0, proc.stdout[-6000:]
    text = proc.stdout
    for col in ("variant", "s/step (median)", "estimate", "peak MiB", "vs DDP", "vs best recipe"):
        assert col in text, text
    results = {r["model"]: r for r in json.loads(out.read_text())}
    assert sorted(results) == ["gpt2", "llama"]
    for model, res in results.items():
        assert res["world"] == 2
        rows = {v["name"]: v for v in res["variants"]}
        assert list(rows) == ROWS, (model, list(rows))
        for name, v in rows.items():
            line = next((ln for ln in text.splitlines() if ln.startswith(model) and f"  {name}  " in ln), None)
            assert line is not None, f"{model} {name} missing from the table:\n{text}"
            if model == "gpt2" and name == "TP":
                assert v["na"] and "Conv1D" in v["na"] and "n/a" in line
                continue
            assert v["na"] is None and v["error"] is None, (model, name, v)
            assert v["step_s"] > 0 and v["fwd_bwd_s"] > 0 and v["peak_bytes"] > 0, (model, name, v)
            assert abs(v["loss0"] - res["ref_loss"]) <= 1e-4 * abs(res["ref_loss"]), (model, name, v["loss0"],
                                                                                    res["ref_loss"])
            if name.startswith("autoparallel"):
                assert v["estimate_s"] > 0, (model, name, v)
    assert "autoparallel data / DDP" in text and "autoparallel / best recipe" in text


MEMORY_BOUND = os.path.join(ROOT, "benchmarks", "memory_bound.py")
MB_RECIPES = ["DDP", "DDP+ZeRO-1", "FSDP2", "FSDP2 no-reshard", "FSDP2+AC", "FSDP2+offload"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_memory_bound_quick_two_processes(tmp_path):
    """``benchmarks/memory_bound.py --quick`` on 2 gloo processes, one budget (0.8 x DDP's peak):
    DDP's peak sets it, every recipe has a step, a peak and the model's step-0 loss, the offload
    row counts what it holds in host memory apart from its device peak, and autoparallel's row is
    measured with its modelled peak (or says why no plan fits). Timings are not checked."""
    out = tmp_path / "membound.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, MEMORY_BOUND, "--quick", "--worlds", "2", "--fractions", "0.8",
                           "--rounds", "1", "--cost-model", "cpu", "--json", str(out)], cwd=ROOT, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=270)
    assert proc.returncode == 0, proc.stdout[-6000:]
    text = proc.stdout
    for col in ("budget MiB", "device MiB", "host MiB", "fits", "modelled MiB", "model/meas", "vs fastest fitting"):
        assert col in text, text
    (job,) = json.loads(out.read_text())
    assert job["world"] == 2 and job["ddp_peak_bytes"] > 0
    assert job["budgets"] == {"0.8": int(0.8 * job["ddp_peak_bytes"])}
    rows = {v["name"]: v for v in job["variants"]}
    offload = rows["FSDP2+offload"]
    assert offload["host_peak_bytes"] > 0 and offload["peak_bytes"] < rows["FSDP2"]["peak_bytes"], offload
    assert list(rows) == MB_RECIPES + ["autoparallel 0.8"], list(rows)
    for name in MB_RECIPES:
        v = rows[name]
        assert v["na"] is None and v["error"] is None, (name, v)
        assert v["step_s"] > 0 and v["peak_bytes"] > 0, (name, v)
        assert abs(v["loss0"] - job["ref_loss"]) <= 1e-4 * abs(job["ref_loss"]), (name, v["loss0"], job["ref_loss"])
    auto = rows["autoparallel 0.8"]
    if auto["na"]:
        assert "InfeasiblePlanError" in auto["na"], auto["na"]
    else:
        assert auto["step_s"] > 0 and auto["peak_bytes"] > 0 and auto["estimate_parts"]["peak_memory_bytes"] > 0
        assert auto["estimate_parts"]["memory_budget_bytes"] == job["budgets"]["0.8"]
        assert "autoparallel measured device peak" in text


PIPE_ROWS = {"(2,2) pp,dp": ["autoparallel", "autoparallel ZB", "torch PP + DDP", "torch PP ZB + dp"],
             "(4,) pp": ["autoparallel", "autoparallel ZB", "torch PP", "torch PP ZB"]}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_vs_torch_pipeline_quick_four_processes(tmp_path):
    """``benchmarks/vs_torch.py --pipeline --quick`` on 4 gloo processes, one round: on meshes
    (2, 2) pp,dp and (4,) pp, autoparallel's pipeline (1F1B, 4 microbatches; and
    InterleavedZeroBubble, two stages a rank) and the hand-written
    torch.distributed.pipelining recipes (Schedule1F1B; ScheduleInterleavedZeroBubble) each have a step, the same step-0 loss as each other and
    as the eager model, autoparallel an estimate and its plan's stages, both a per-rank breakdown
    of the step (forward and backward chunks, p2p); the targets are printed. Timings are not
    checked."""
    out = tmp_path / "pipe.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, "--pipeline", "--quick", "--rounds", "1", "--steps", "1",
                           "--json", str(out)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=570)
    assert proc.returncode == 0, proc.stdout[-6000:]
    text = proc.stdout
    (job,) = json.loads(out.read_text())
    assert job["model"] == "gpt2" and job["world"] == 4 and job["pipeline"] and job["sizes"]["layers"] == 8
    for mesh, names in PIPE_ROWS.items():
        rows = {v["name"]: v for v in job["variants"] if v["mesh"] == mesh}
        assert list(rows) == names, (mesh, list(rows))
        for name, v in rows.items():
            assert v["na"] is None and v["error"] is None, (mesh, name, v)
            assert v["step_s"] > 0 and v["fwd_bwd_s"] > 0, (mesh, name, v)
            assert abs(v["loss0"] - job["ref_loss"]) <= 1e-4 * abs(job["ref_loss"]), (mesh, name, v["loss0"],
                                                                                    job["ref_loss"])
            assert v["estimate_parts"]["pipeline"]["microbatches"] == 4
            zb = "ZB" in name
            assert v["estimate_parts"]["pipeline"]["schedule"] == ("InterleavedZeroBubble" if zb else "1F1B")
            stages = v["estimate_parts"]["measured_stages"]  # per rank: pp coordinate, then seconds
            assert len(stages) == 4 and all(row[1] > 0 and row[2] > 0 and row[-1] > 0 for row in stages), stages
            assert sorted({int(row[0]) for row in stages}) == list(range(int(mesh[1])))
        for name, per_rank in (("autoparallel", 1), ("autoparallel ZB", 2)):
            auto = rows[name]
            assert auto["estimate_s"] > 0 and len(auto["estimate_parts"]["pipeline"]["stage_s"]) == per_rank * int(mesh[1])
        assert len(rows[names[-1]]["estimate_parts"]["pipeline"]["boundaries"]) == 2 * int(mesh[1]) + 1
        recipe, recipe_zb = names[-2:]
        for r in (recipe, recipe_zb):
            assert f"{mesh} {r}: layers split" in text and f"{mesh} {r}: measured per rank and step" in text
        assert f"mesh {mesh}: step-0 loss autoparallel" in text and "(the same)" in text
        assert f"mesh {mesh}: autoparallel / best recipe (" in text
        assert f"mesh {mesh}: autoparallel ZB / {recipe_zb}" in text
