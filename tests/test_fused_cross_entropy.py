"""The per-device cross-entropy over whole classes with a one-pass backward
(autoparallel/rewrites/cross_entropy.py, runtime_kernels.cross_entropy.cross_entropy_loss): torch's
loss bitwise and its gradient to rounding, for every reduction, ignored rows and dtype; only
the plain case (no class weight, no label smoothing) is rewritten; parity holds."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode

import autoparallel
from autoparallel.runtime_kernels.cross_entropy import cross_entropy_loss
from models import to_meta
from test_parity import run_parity, train_side_by_side

aten = torch.ops.aten
_TOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", list(_TOL), ids=str)
@pytest.mark.parametrize("reduction", [0, 1, 2], ids=["none", "mean", "sum"])
@pytest.mark.parametrize("ignored", ["no-row", "some-rows", "every-row"])
def test_kernel_matches_torch(dtype, reduction, ignored):
    torch.manual_seed(0)
    x, t = torch.randn(6, 5, dtype=dtype, requires_grad=True), torch.randint(0, 5, (6,))
    if ignored == "some-rows":
        t[[1, 4]] = -100
    elif ignored == "every-row":
        t[:] = -100
    grad = torch.randn(6, dtype=dtype) if reduction == 0 else torch.tensor(1.7, dtype=dtype)
    want = aten.cross_entropy_loss(x, t, None, reduction, -100)
    got = cross_entropy_loss(x, t, reduction, -100)
    assert torch.equal(want, got) or (want.isnan().all() and got.isnan().all())  # mean over no row: NaN
    (want_grad,), (got_grad,) = torch.autograd.grad(want, x, grad), torch.autograd.grad(got, x, grad)
    assert got_grad.dtype == dtype
    torch.testing.assert_close(got_grad, want_grad, rtol=_TOL[dtype], atol=_TOL[dtype])
    if ignored != "no-row":
        assert not got_grad[t == -100].any()


class Classifier(torch.nn.Module):
    def __init__(self, **loss_options):
        super().__init__()
        self.loss_options = loss_options
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 5))

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y, **self.loss_options)


@pytest.mark.parametrize("options,fused", [({}, True), ({"ignore_index": 2, "reduction": "sum"}, True),
                                           ({"label_smoothing": 0.1}, False),
                                           ({"weight": torch.linspace(0.5, 1.5, 5)}, False)],
                         ids=["plain", "ignore-sum", "smoothing", "class-weight"])
def test_only_the_plain_loss_is_rewritten_and_trains_as_on_one_device(options, fused, sim_mesh):
    torch.manual_seed(0)
    ref = Classifier(**options)
    batches = [{"x": torch.randn(8, 8), "y": torch.randint(0, 5, (8,))} for _ in range(2)]
    mesh = sim_mesh((2,))
    ranks = frozenset(range(mesh.size()))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(batches[0]), device_mesh=mesh,
                                              parallelism="data", cost_model=autoparallel.CostModel("cpu"))
    targets = [n.target for n in pmodel.graph_module.graph.nodes]
    assert (cross_entropy_loss in targets) == fused
    assert (aten.cross_entropy_loss.default in targets) != fused
    train_side_by_side(ref, pmodel, batches, ranks, loss=lambda out: out)


def test_llama_loss_runs_the_one_pass_kernel(sim_mesh):
    pytest.importorskip("transformers")
    pmodel = run_parity("llama", (2,), "cpu", sim_mesh, steps=2)
    assert cross_entropy_loss in [n.target for n in pmodel.graph_module.graph.nodes]
