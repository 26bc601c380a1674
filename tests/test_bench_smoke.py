"""Smoke run of ``benchmarks/vs_torch.py --quick`` on 2 gloo processes: every row of the table is
there (autoparallel, autoparallel data, DDP, FSDP2 and TP for GPT-2 and Llama on mesh (2,)), each
measured row has a step time, an estimate where it is an autoparallel row, a peak, and the step-0
loss of the eager model; GPT-2's TP row says why it is not expressible. Timings are not checked."""

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
