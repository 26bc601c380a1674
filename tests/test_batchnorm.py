"""BatchNorm in training mode: a batch split over devices is normalized by the statistics
of the global batch, and the running statistics are written back, so that loss, gradients
and buffers equal one device's (simulated ranks, DESIGN §4 tier 2)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard

import autoparallel
from autoparallel.runtime_kernels.grad_reduction import sum_over_axes
from autoparallel.tracer import ColoTracer
from models import build_model, placements_of
from test_parity import assert_close

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class BNCNN(nn.Module):
    """Conv → BatchNorm2d → ReLU → pooling, twice, then a linear head and cross-entropy."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(8, momentum=0.3)
        self.head = nn.Linear(8, 10)

    def forward(self, x, y):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        return F.cross_entropy(self.head(F.adaptive_avg_pool2d(x, 1).flatten(1)), y)


class BN1dMLP(nn.Module):
    """Linear → BatchNorm1d on (N, C) → ReLU → Linear, cross-entropy."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.out = nn.Linear(32, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.out(F.relu(self.bn(self.fc(x)))), y)


def image_batches(n, batch=16, size=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 3, size, size, generator=g) * 2 + 1, torch.randint(0, 10, (batch,), generator=g))
            for _ in range(n)]


def full(t):
    """The whole value of a DTensor (no collective when it is replicated) or of a plain tensor."""
    if not isinstance(t, DTensor):
        return t
    return t.to_local() if all(isinstance(p, Replicate) for p in t.placements) else t.full_tensor()


def train_parity(ref, batches, mesh_shape, sim_mesh, parallelism="auto"):
    """Train ``ref`` and its parallel copy side by side, one SGD step between batches: loss,
    every parameter gradient and every buffer (running statistics, ``num_batches_tracked``)
    must agree on every rank after every forward. Links are bandwidth-bound (1 GB/s, 0.1 µs
    latency), so that moving activations costs more than all-reducing BatchNorm's
    statistics and the planner splits the batch. Returns the parallel module."""
    mesh = sim_mesh(mesh_shape)
    model = copy.deepcopy(ref)
    meta = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in batches[0])
    ranks = frozenset(range(mesh.size()))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, meta, device_mesh=mesh, cost_model=autoparallel.CostModel("cpu"),
                                              mesh_spec=autoparallel.MeshSpec(mesh_shape, alpha=1e-7, beta=1e-9),
                                              parallelism=parallelism)
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_params, ref_buffers = dict(ref.named_parameters()), dict(ref.named_buffers())
    assert set(dict(pmodel.named_buffers())) == set(ref_buffers)
    for step, batch in enumerate(batches):
        ref_opt.zero_grad()
        want = ref(*batch)
        want.backward()
        with LocalTensorMode(ranks):
            opt.zero_grad()
            got = pmodel(*batch)
            assert isinstance(got, torch.Tensor) and got.dim() == 0  # the buffers' outputs stay internal
            got.backward()
            assert_close(f"step {step} loss", got.detach(), want.detach())
            for name, p in pmodel.named_parameters():
                assert_close(f"step {step} grad of {name} {placements_of(p)}", full(p.grad), ref_params[name].grad)
            for name, b in pmodel.named_buffers():
                assert_close(f"step {step} buffer {name}", full(b), ref_buffers[name])
            if step < len(batches) - 1:
                opt.step()
        if step < len(batches) - 1:
            ref_opt.step()
    return pmodel


def batch_split_axes(plan, module):
    """Mesh axes splitting the batch dim of ``module``'s batch-norm input (its first mean)."""
    node = next(n for n in plan.nodes.values() if n.op == "mean.dim" and n.module_path == module)
    return [a for a, p in enumerate(node.input_specs[0]) if p == Shard(0)]


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_batchnorm2d_train_parity(mesh_shape, sim_mesh):
    torch.manual_seed(0)
    pmodel = train_parity(BNCNN().train(), image_batches(3), mesh_shape, sim_mesh)
    for module in ("bn", "bn2"):
        axes = batch_split_axes(pmodel.plan, module)
        assert axes, f"the plan should split {module}'s batch:\n{pmodel.plan}"
        # per statistic (mean, variance), one all-reduce per split axis or one over them all
        # (sum_over_axes), shared by the normalization and the running update
        reduced = [len(n.args[1]) if n.target is sum_over_axes else 1 for n in pmodel.graph_module.graph.nodes
                   if n.target in (c10d.all_reduce.default, sum_over_axes)
                   and n.meta.get("source") and pmodel.plan.nodes[n.meta["source"]].module_path == module]
        assert sum(reduced) == 2 * len(axes) and len(reduced) in (2, 2 * len(axes)), pmodel.graph_module.code
    assert int(full(pmodel.bn.num_batches_tracked)) == 3


def test_batchnorm2d_eval_parity(sim_mesh):
    torch.manual_seed(0)
    ref = BNCNN()
    for bn in (ref.bn, ref.bn2):
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
    ref.eval()
    assert ColoTracer().trace(ref, image_batches(1)[0]).buffer_mutations == {}
    before = {k: v.clone() for k, v in ref.state_dict().items()}
    pmodel = train_parity(ref, image_batches(2), (2,), sim_mesh)
    for name, b in pmodel.named_buffers():
        torch.testing.assert_close(full(b), before[name])


def test_batchnorm1d_train_parity(sim_mesh):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(128, 16, generator=g), torch.randint(0, 10, (128,), generator=g)) for _ in range(3)]
    pmodel = train_parity(BN1dMLP().train(), batches, (2, 2), sim_mesh)
    assert batch_split_axes(pmodel.plan, "bn")


def test_capture_returns_buffer_updates_after_user_outputs():
    model = BNCNN().train()
    traced = ColoTracer().trace(model, image_batches(1)[0])
    assert not any(n.target == aten.batch_norm.default for n in traced.gm.graph.nodes)
    assert sorted(traced.buffer_mutations.values()) == sorted(
        f"{m}.{b}" for m in ("bn", "bn2") for b in ("running_mean", "running_var", "num_batches_tracked"))
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    assert len(out.args[0]) == 1 + 6 and sorted(traced.buffer_mutations) == list(range(1, 7))
    assert traced.out_spec.num_leaves == 1  # the user's output structure is unchanged


class Ema(nn.Module):
    """Buffers updated in place by hand: a step counter and a chained ``mul_().add_()``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 10)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x, y):
        self.steps += 1
        self.ema.mul_(0.9).add_(0.1 * x.mean(0))
        return F.cross_entropy(self.lin(x - self.ema), y)


def test_buffers_updated_in_place_by_hand(sim_mesh):
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(32, 16, generator=g), torch.randint(0, 10, (32,), generator=g)) for _ in range(2)]
    torch.manual_seed(0)
    train_parity(Ema(), batches, (2,), sim_mesh)


class WritesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(2)
        return self.lin(x).sum()


class WritesParameter(WritesInput):
    def forward(self, x):
        with torch.no_grad():
            self.lin.weight.mul_(0.5)
        return self.lin(x).sum()


class WritesBufferView(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x):
        self.b[:2] = 1.0
        return (x * self.b).sum()


@pytest.mark.parametrize("model, match", [
    (WritesInput(), r"writes in place into its input 'x' \(node mul_"),
    (WritesParameter(), r"writes in place into parameter 'lin.weight'"),
    (WritesBufferView(), r"writes into a view of buffer 'b'"),
], ids=["input", "parameter", "buffer-view"])
def test_other_mutations_are_refused(model, match):
    with pytest.raises(autoparallel.CaptureError, match=match):
        autoparallel.plan(model, (torch.empty(8, 4, device="meta"),), mesh_shape=(2,))


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_timm_resnet18_train_parity(mesh_shape, sim_mesh):
    pytest.importorskip("timm", reason="timm (with torchvision==0.28.0) comes with the test extras")
    ref = build_model("timm_resnet18")
    # parameters replicated, as ResNets are trained: with 11M parameters against small
    # activations, "auto" shards the convolutions' channels instead
    pmodel = train_parity(ref, image_batches(2, batch=8, size=32, seed=3), mesh_shape, sim_mesh, parallelism="data")
    bns = [name for name, m in ref.named_modules() if isinstance(m, nn.BatchNorm2d)]
    split = [name for name in bns if batch_split_axes(pmodel.plan, name)]
    # the deepest layers (8×512×1×1 activations) may take the channels instead
    assert "model.bn1" in split and len(split) >= len(bns) // 2, f"batch split in {split} of {bns}"
    assert int(full(dict(pmodel.named_buffers())["model.layer4.1.bn2.num_batches_tracked"])) == 2
