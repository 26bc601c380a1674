"""Bad input gets a clear error."""

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import init_device_mesh

import autoparallel
from models import MLP, batch_for, to_meta


class DataDependent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent Python control flow
            return self.lin(x)
        return x


def test_capture_error_names_the_user_line():
    with pytest.raises(autoparallel.CaptureError) as info:
        autoparallel.plan(DataDependent(), (torch.empty(4, 8, device="meta"),), mesh_shape=(2,))
    msg = str(info.value)
    assert "torch.export could not capture DataDependent" in msg
    assert "test_errors.py" in msg and "if x.sum() > 0:" in msg
    assert "torch.cond" in msg  # says what to do


class TwoFallbacks(MLP):
    """Two ops with no rule and no strategy in DTensor's registry."""

    def forward(self, x, y):
        h = self.layers[0](x)
        return torch.nn.functional.huber_loss(h, y) + torch.trace(h)


def test_strict_lists_every_op_without_a_rule():
    with pytest.raises(autoparallel.ShardingRuleError) as info:
        autoparallel.plan(TwoFallbacks(), to_meta(batch_for("mlp", 0)), mesh_shape=(2,), strict=True)
    msg = str(info.value)
    assert "aten.huber_loss.default" in msg and "aten.trace.default" in msg


def test_runtime_inputs_must_match_the_plan(sim_mesh):
    mesh = sim_mesh((2,))
    batch = batch_for("mlp", 0)
    with LocalTensorMode(frozenset(range(2))):
        pmodel = autoparallel.autoparallelize(MLP(), to_meta(batch), device_mesh=mesh, replan=False)
        with pytest.raises(autoparallel.InputMismatchError, match=r"argument x has shape \(4, 256\).*plan was made for shape \(8, 256\)"):
            pmodel(x=batch["x"][:4], y=batch["y"][:4])
        with pytest.raises(autoparallel.InputMismatchError, match="dtype"):
            pmodel(x=batch["x"].double(), y=batch["y"])
        with pytest.raises(autoparallel.InputMismatchError, match="keyword arguments"):
            pmodel(x=batch["x"])
        pmodel(y=batch["y"], x=batch["x"])  # keyword order does not matter


def test_mesh_must_span_the_world(sim_mesh):
    sim_mesh((4,))
    half = init_device_mesh("cpu", (2,))
    with pytest.raises(autoparallel.MeshMismatchError, match="world size is 4"):
        autoparallel.autoparallelize(MLP(), to_meta(batch_for("mlp", 0)), device_mesh=half)


def test_meta_weights_cannot_run(sim_mesh):
    mesh = sim_mesh((2,))
    with torch.device("meta"):
        model = MLP()
    with pytest.raises(autoparallel.AutoParallelError, match="real weights.*autoparallel.plan"):
        autoparallel.autoparallelize(model, to_meta(batch_for("mlp", 0)), device_mesh=mesh)
