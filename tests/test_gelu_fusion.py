"""GELU written out in elementwise ops is captured as one ``aten.gelu`` (autoparallel/tracer/gelu.py):
the tanh approximation and the exact form each as its own ``approximate``, a look-alike (another
constant) or a region whose intermediate is read elsewhere left as it is; the loss and every
gradient still equal one device's."""

import copy
import math

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode

import autoparallel
from autoparallel.tracer import ColoTracer
from models import build_model, to_meta
from test_parity import run_parity, train_side_by_side

aten = torch.ops.aten


def _tanh_gelu(x, kappa=0.044715):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + kappa * torch.pow(x, 3.0))))


def _fast_gelu(x):  # HF's gelu_fast: the same approximation, factored otherwise
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _erf_gelu(x):  # HF's gelu_python
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class MLP(torch.nn.Module):
    """Linear → activation → linear."""

    def __init__(self, act):
        super().__init__()
        self.act = act
        self.up, self.down = torch.nn.Linear(8, 32), torch.nn.Linear(32, 8)

    def forward(self, x):
        return self.down(self.act(self.up(x))).square().mean()


class LeakyMLP(MLP):
    """The tanh GELU written inline, its ``tanh`` also added to the output: an intermediate of
    the region is read outside it."""

    def __init__(self):
        super().__init__(None)

    def forward(self, x):
        h = self.up(x)
        t = torch.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * torch.pow(h, 3.0)))
        return (self.down(0.5 * h * (1.0 + t)) + t.sum(-1, keepdim=True)).square().mean()


def _ops(model, example):
    traced = ColoTracer().trace(model, to_meta(example))
    return [n for n in traced.gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("act,approximate", [(_tanh_gelu, "tanh"), (_fast_gelu, "tanh"), (_erf_gelu, "none")],
                         ids=["gelu_new", "gelu_fast", "gelu_python"])
def test_written_out_gelu_is_captured_as_one_op(act, approximate):
    ops = _ops(MLP(act), {"x": torch.randn(4, 8)})
    gelus = [n for n in ops if n.target is aten.gelu.default]
    assert len(gelus) == 1 and gelus[0].kwargs.get("approximate", "none") == approximate
    assert not any(n.target in (aten.tanh.default, aten.erf.default, aten.pow.Tensor_Scalar) for n in ops)


@pytest.mark.parametrize("model", [MLP(lambda x: _tanh_gelu(x, kappa=0.05)), LeakyMLP()],
                         ids=["other-constant", "intermediate-read-elsewhere"])
def test_look_alikes_are_left_as_they_are(model):
    ops = _ops(model, {"x": torch.randn(4, 8)})
    assert not any(n.target is aten.gelu.default for n in ops)
    assert any(n.target is aten.tanh.default for n in ops)


@pytest.mark.parametrize("act", [_tanh_gelu, _erf_gelu], ids=["tanh", "erf"])
def test_fused_gelu_trains_as_on_one_device(act, sim_mesh):
    torch.manual_seed(0)
    ref = MLP(act)
    batches = [{"x": torch.randn(8, 8)} for _ in range(2)]
    mesh = sim_mesh((2,))
    ranks = frozenset(range(mesh.size()))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(batches[0]), device_mesh=mesh,
                                              cost_model=autoparallel.CostModel("cpu"))
    assert any(n.target is aten.gelu.default for n in pmodel.graph_module.graph.nodes)
    train_side_by_side(ref, pmodel, batches, ranks, loss=lambda out: out)


def test_gpt2_mlp_runs_one_gelu_per_layer(sim_mesh):
    """HF GPT-2's ``gelu_new``: the per-device graph runs ``aten.gelu(approximate="tanh")``, one per
    layer, and no ``tanh``; parity with one device holds."""
    pytest.importorskip("transformers")
    ref = build_model("gpt2")
    pmodel = run_parity("gpt2", (2,), "cpu", sim_mesh, steps=2, ref=ref)
    ops = [n.target for n in pmodel.graph_module.graph.nodes]
    assert ops.count(aten.gelu.default) == ref.config.n_layer
    assert aten.tanh.default not in ops
