"""plan.plot() and `python -m autoparallel plan --report DIR`: files written, PNGs that open."""

import io
import json
import struct
import sys

import pytest
import torch

import autoparallel
from autoparallel.cli import main

from models import hf_model

PNG = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    data = open(path, "rb").read(32)
    assert data[:8] == PNG and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def plan():
    with torch.device("meta"):
        model = hf_model("gpt2", layers=2)
    ids = torch.empty(4, 16, dtype=torch.long, device="meta")
    return autoparallel.plan(model, {"input_ids": ids, "labels": ids.clone()}, cache_dir=False,
                             mesh_spec=autoparallel.MeshSpec((2, 2), ("dp", "tp")), memory_budget="64MiB")


def test_plot_writes_a_png(plan, tmp_path):
    pytest.importorskip("matplotlib")
    out = plan.plot(tmp_path / "sub" / "p.png")
    assert out == [str(tmp_path / "sub" / "p.png")]
    w, h = _png_size(out[0])
    assert w >= 800 and h >= 600
    tl = plan.inspection.memory_timeline
    assert max(tl["total"]) == plan.estimate.memory.peak_bytes  # the sampling keeps the peak
    assert plan.estimate.memory_budget_bytes == 64 * 2**20


def test_layer_times_add_up_to_the_step(plan):
    from autoparallel.plot import layer_times

    rows = layer_times(plan)
    assert [r[0] for r in rows][:4] == ["before layers", "transformer.h.0", "transformer.h.1", "after layers"]
    assert sum(r[1] for r in rows) == pytest.approx(plan.estimate.compute_s)
    assert sum(r[2] for r in rows) == pytest.approx(plan.estimate.comm_s)
    assert sum(r[1] + r[2] + r[3] for r in rows) == pytest.approx(plan.estimate.step_time_s, rel=1e-6)


def test_step_wide_optimizer_overhead_is_compute(plan):
    """What no node holds of the optimizer step (the DTensor dispatch, paid once for the module)
    is drawn as compute, not as exposed communication."""
    import dataclasses

    from autoparallel.plot import layer_times

    est = plan.estimate
    extra = dataclasses.replace(est, compute_s=est.compute_s + 4e-3, optimizer_s=est.optimizer_s + 4e-3,
                                step_time_s=est.step_time_s + 4e-3)
    before = layer_times(plan)[-1]
    comm = before[2] if before[0] == "step-wide" else 0.0  # one gradient all-reduce latency per mesh axis
    wide = layer_times(dataclasses.replace(plan, estimate=extra))[-1]
    assert wide[0] == "step-wide" and wide[1] == pytest.approx(4e-3) and wide[2] == pytest.approx(comm, abs=1e-12)


def _memory_axis(plan):
    import matplotlib.pyplot as plt

    from autoparallel.plot import figure

    fig = figure(plan)
    ax = fig.axes[1]
    out = ax.get_ylim(), ax.get_ylabel(), ax.get_title(), [ln.get_label() for ln in ax.get_lines()]
    plt.close(fig)
    return out


def test_memory_panel_is_scaled_to_the_data(plan):
    """A budget far above the peak is named in the title, not drawn (the axis would flatten the
    data); one within 3x of the peak is a line inside the axis."""
    import dataclasses

    pytest.importorskip("matplotlib")
    from autoparallel import units

    peak = max(plan.inspection.memory_timeline["total"])
    unit, scale = units.bytes_unit(peak)
    far = dataclasses.replace(plan.estimate, memory_budget_bytes=72 * 2**30)
    (low, high), label, title, lines = _memory_axis(dataclasses.replace(plan, estimate=far))
    assert low == 0 and peak / scale <= high <= 1.1 * peak / scale and label == f"{unit} per device"
    assert "budget" not in lines and "72 GiB" in title
    near = dataclasses.replace(plan.estimate, memory_budget_bytes=2 * peak)
    (low, high), label, title, lines = _memory_axis(dataclasses.replace(plan, estimate=near))
    unit, scale = units.bytes_unit(2 * peak)
    assert "budget" in lines and 2 * peak / scale <= high <= 2.2 * peak / scale and "budget" not in title


def test_plot_without_matplotlib_names_the_extra(plan, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"autoparallel\[plot\]"):
        plan.plot(tmp_path / "p.png")


def test_cli_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "report"
    assert main(["plan", "--model", "gpt2", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128",
                 "--batch", "4", "--seq", "16", "--mesh", "2x2", "--mesh-axes", "dp", "tp",
                 "--constraint", "lm_head.weight=S0(tp)", "--report", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("plan for a mesh of 4 devices: 2 (dp) × 2 (tp)")
    assert "constraints: lm_head.weight S0(tp)" in printed
    names = sorted(p.name for p in out.iterdir())
    assert names == ["plan.json", "plan.png", "summary.txt", "table.txt"]
    plan = autoparallel.Plan.from_json((out / "plan.json").read_text())
    assert (out / "summary.txt").read_text() == str(plan) + "\n"
    assert "parameters (placement)" in (out / "table.txt").read_text()
    assert json.loads((out / "plan.json").read_text())["param_placements"]["lm_head.weight"] == ["R", "S0"]
    _png_size(out / "plan.png")


class _Terminal(io.StringIO):
    """A stderr that says it is a terminal and keeps what is written."""

    def isatty(self):
        return True


def _staged():
    import time

    from autoparallel import progress

    @progress.planning
    def work():
        for name in ("strategies", "memory model", "costs and ILP solve"):
            progress.stage(name)
            time.sleep(0.6)

    work()


def test_cli_prices_the_recipes_only_with_compare(capsys):
    args = ["plan", "--model", "gpt2", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "128",
            "--batch", "4", "--seq", "16", "--mesh", "2"]
    assert main(args) == 0
    assert "DDP" not in capsys.readouterr().out
    assert main(args + ["--compare"]) == 0
    assert "vs this plan's step, same cost model: DDP" in capsys.readouterr().out


def test_progress_bar_on_a_terminal(monkeypatch):
    from autoparallel import progress

    monkeypatch.setattr(progress, "PROGRESS_DELAY_S", 0.2)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    _staged()
    assert "planning:" in term.getvalue() and "stages" in term.getvalue() and "costs and ILP solve" in term.getvalue()


def test_progress_log_lines_elsewhere(monkeypatch, caplog):
    import logging

    from autoparallel import progress

    monkeypatch.setattr(progress, "PROGRESS_DELAY_S", 0.5)
    with caplog.at_level(logging.INFO, logger="autoparallel"):
        _staged()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("planning:")]
    assert lines and lines[-1].startswith("planning: costs and ILP solve (") and "strategies" not in " ".join(lines)
