"""Golden file of the emitted code: a 2-layer GPT-2 on a (2, 2) mesh with axes (dp, tp).

``pmodel.graph_module.code`` must equal ``tests/golden/gpt2_2layer_2x2.py``, so that a change
to what the code generation emits (names, comments, collectives, the copies around them)
shows up as a diff to review. When it changes on purpose (or the plan for this model does),
regenerate the file and review its diff with the change:

    AUTOPARALLEL_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_golden.py
"""

import difflib
import os
import pathlib
import re

import pytest
from torch.distributed._local_tensor import LocalTensorMode

import autoparallel
from models import ShardParams, batch_for, to_meta
from models import build_model as build

GOLDEN = pathlib.Path(__file__).parent / "golden" / "gpt2_2layer_2x2.py"
REGEN = "AUTOPARALLEL_REGEN_GOLDEN=1 .venv/bin/python -m pytest -q tests/test_golden.py"


def emitted_code(sim_mesh) -> str:
    """The per-device code of the 2-layer GPT-2 of ``models.py`` on a simulated (2, 2) mesh named
    (dp, tp), planned with parameters split where they can be (:class:`ShardParams`)."""
    from torch.distributed.tensor import init_device_mesh

    sim_mesh((2, 2))  # the fake process group of 4 ranks
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = build("gpt2")  # outside LocalTensorMode: plain weights
    with LocalTensorMode(frozenset(range(4))):
        pmodel = autoparallel.autoparallelize(model, to_meta(batch_for("gpt2", 0)), device_mesh=mesh,
                                              cost_model=ShardParams("cpu"), cache_dir=False)
    return pmodel.graph_module.code


def test_gpt2_code_matches_golden_file(sim_mesh):
    pytest.importorskip("transformers")
    code = emitted_code(sim_mesh)
    compile(code, str(GOLDEN), "exec")  # valid Python
    assert not re.search(r"0x[0-9a-f]{6,}|/tmp/", code), "an address or a temporary path in the code"
    # names of the plan table and of parameters, groups by mesh axis, comments with placements
    assert "    addmm_1 = torch.ops.aten.addmm.default(" in code  # c_proj (c_attn is split into q, k, v)
    assert "    transformer_h_0_attn_c_attn_weight = " in code
    assert "Group.dp" in code and "Group.tp" in code
    assert re.search(r"\n    # transformer\.h\.0\.[\w.]+: redistribute \w+ [SRP].* -> [SRP].*\n", code)
    assert re.search(r"\n    # transformer\.h\.0\.[\w.]+: (S\d+\(\w+\)|R|P\(\w+\))[^\n]* -> ", code)
    # no identity move; the logits are gathered at most once, for the output and the loss alike
    assert not re.search(r"movedim\.int\(\w+, (\d+), \1\)", code)
    gathered = {m[1] for m in re.finditer(r"redistribute (\w+) .* -> R R(, a view of \w+ redistributed)?$", code, re.M)
                if not m[2]}
    assert not {"to_3", "view_24"} <= gathered, "the logits and their flat view for the loss are gathered apart"
    if os.environ.get("AUTOPARALLEL_REGEN_GOLDEN"):
        GOLDEN.write_text(code)
        pytest.skip(f"regenerated {GOLDEN}")
    want = GOLDEN.read_text()
    if code != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), code.splitlines(True), "golden", "emitted", n=2))
        pytest.fail(f"the emitted code differs from {GOLDEN.name} (if on purpose, regenerate it: {REGEN}):\n"
                    f"{diff[:6000]}")
