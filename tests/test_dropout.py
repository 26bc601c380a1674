"""Dropout on sharded data: one independent mask per distinct shard, one mask for a replicated
tensor, torch's distribution and scaling, the backward through the same mask, the same masks
when a checkpointed region is recomputed, and parity with one device at p = 0 (simulated ranks)."""

import copy
import dataclasses
import itertools
import math

import pytest
import torch
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard

import autoparallel
from autoparallel.codegen.emit import emit
from autoparallel.runtime_kernels import random as rk
from autoparallel.tracer import ColoTracer
from models import whole

F = torch.nn.functional
MESHES = [(2,), (2, 2)]
P = 0.5  # 1 / (1 - P) = 2 exactly: kept values are checked bit for bit
CPU = autoparallel.CostModel("cpu")


def per_rank(t):
    return [t._local_tensors[r] for r in sorted(t._local_tensors)] if isinstance(t, LocalTensor) else [t]


def one(t):
    """The value of a returned (replicated) output: the same on every rank."""
    vals = per_rank(t)
    for v in vals[1:]:
        assert torch.equal(v, vals[0])
    return vals[0]


def dropout_spec(pmodel):
    [node] = [n for n in pmodel.plan.nodes.values() if n.op.startswith("dropout")]
    return node.output_specs[0]


def blocks(shape, spec, mesh_shape):
    """The distinct shards of a tensor of global ``shape`` placed by ``spec``: slices per dim."""
    out = set()
    for coord in itertools.product(*[range(n) for n in mesh_shape]):
        sl = []
        for d, size in enumerate(shape):
            axes = [a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == d]
            n, k = 1, 0
            for a in axes:
                n, k = n * mesh_shape[a], k * mesh_shape[a] + coord[a]
            sl.append(slice(k * size // n, (k + 1) * size // n))
        out.add(tuple((s.start, s.stop) for s in sl))
    return [tuple(slice(*s) for s in b) for b in sorted(out)]


class Drop(torch.nn.Module):
    """Two GELU layers (the planner splits the batch), then dropout."""

    def __init__(self, hidden=64):
        super().__init__()
        self.l1, self.l2 = torch.nn.Linear(hidden, hidden), torch.nn.Linear(hidden, hidden)

    def forward(self, x):
        return F.dropout(self.hidden(x), P)

    def hidden(self, x):
        return F.gelu(self.l2(F.gelu(self.l1(x))))


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_batch_shards_draw_independent_masks(mesh_shape, sim_mesh):
    mesh = sim_mesh(mesh_shape)
    torch.manual_seed(0)
    model, x = Drop(), torch.randn(64, 64)
    with LocalTensorMode(frozenset(range(mesh.size()))):
        pmodel = autoparallel.autoparallelize(model, (x.to("meta"),), device_mesh=mesh, cost_model=CPU,
                                              parallelism="data", cache_dir=False, outputs="replicated")  # y whole
        spec = dropout_spec(pmodel)
        parts = blocks(x.shape, spec, mesh_shape)
        assert len(parts) == mesh.size(), f"the batch should be split over every device, got {spec}"
        assert "random_dropout" in pmodel.graph_module.code
        torch.manual_seed(1)
        y = one(pmodel(x))
        torch.manual_seed(1)
        y2 = one(pmodel(x))
        y3 = one(pmodel(x))
    h = model.hidden(x).detach()
    keep = y != 0
    torch.testing.assert_close(y, h * 2 * keep, rtol=1e-5, atol=1e-6)  # kept values scaled by 1/(1-p)
    assert abs(keep.float().mean().item() - (1 - P)) < 0.05  # 4096 draws: 6.4 standard deviations
    masks = [keep[b] for b in parts]
    for a, b in itertools.combinations(range(len(masks)), 2):
        assert not torch.equal(masks[a], masks[b]), f"shards {parts[a]} and {parts[b]} drew the same mask"
    assert torch.equal(y2, y)  # the same seed gives the same masks
    assert not torch.equal(y3 != 0, keep)  # the next forward draws new ones


class WeightDrop(torch.nn.Module):
    """Dropout on a weight (DropConnect): replicated under data parallelism."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 32))

    def forward(self, x):
        wd = F.dropout(self.w, P)
        return F.linear(x, wd), wd


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_replicated_tensor_draws_one_mask(mesh_shape, sim_mesh):
    mesh = sim_mesh(mesh_shape)
    torch.manual_seed(0)
    model, x = WeightDrop(), torch.randn(64, 32)
    with LocalTensorMode(frozenset(range(mesh.size()))):
        pmodel = autoparallel.autoparallelize(model, (x.to("meta"),), device_mesh=mesh, cost_model=CPU,
                                              parallelism="data", cache_dir=False, outputs="replicated")
        assert all(p == Replicate() for p in dropout_spec(pmodel))
        torch.manual_seed(1)
        out, wd = pmodel(x)
    masks = [v != 0 for v in per_rank(wd)]  # each rank's own mask: wd is returned without a collective
    assert len(masks) == mesh.size() and all(torch.equal(m, masks[0]) for m in masks)
    assert abs(masks[0].float().mean().item() - (1 - P)) < 0.1
    assert torch.equal(per_rank(wd)[0][masks[0]], model.w.detach()[masks[0]] * 2)
    # every batch shard was computed with that one weight
    torch.testing.assert_close(one(out), F.linear(x, per_rank(wd)[0]), rtol=1e-5, atol=1e-5)


def test_devices_holding_the_same_shard_draw_the_same_mask(sim_mesh):
    """(Shard(0), Replicate()) on a 2 x 2 mesh: ranks (i, 0) and (i, 1) hold the same shard."""
    sim_mesh((2, 2))
    strides = rk.shard_strides((Shard(0), Replicate()), (2, 2))
    assert strides == (1, 0)
    with LocalTensorMode(frozenset(range(4))):
        coord = LocalTensor({r: torch.tensor([r // 2, r % 2]) for r in range(4)})
        seed = LocalTensor({r: torch.tensor([12345]) for r in range(4)})
        x = LocalTensor({r: torch.ones(16, 16) for r in range(4)})
        m = [v != 0 for v in per_rank(rk.dropout(seed, 0, coord, strides, x, P, True))]
        m1 = [v != 0 for v in per_rank(rk.dropout(seed, 1, coord, strides, x, P, True))]
    assert torch.equal(m[0], m[1]) and torch.equal(m[2], m[3]) and not torch.equal(m[0], m[2])
    assert not torch.equal(m1[0], m[0])  # another op (stream) draws another mask
    # a real process computes what its simulated rank computes; kept values scaled exactly
    x = torch.randn(16, 16)
    for r in range(4):
        got = rk.dropout(torch.tensor([12345]), 0, torch.tensor([r // 2, r % 2]), strides, x, P, True)
        assert torch.equal(got != 0, m[r])
        assert torch.equal(got, x * 2 * m[r])


def test_shard_strides():
    S0, S1, R, Pa = Shard(0), Shard(1), Replicate(), Partial()
    assert rk.shard_strides((S0,), (2,)) == (1,)
    assert rk.shard_strides((R,), (4,)) == (0,)
    assert rk.shard_strides((Pa, S0), (2, 2)) == (0, 1)
    assert rk.shard_strides((S0, S0), (2, 4)) == (4, 1)  # dim 0 in 8 pieces, axis 0 outermost
    assert rk.shard_strides((S1, S0), (2, 4)) == (1, 2)  # row-major over dims: dim 0 (axis 1) outer
    assert rk.shard_strides((S0, S1), (2, 4), dims=(0,)) == (1, 0)


class ScaledDrop(torch.nn.Module):
    """Dropout of an elementwise product with a parameter: its gradient shows the mask."""

    def __init__(self, batch=64, hidden=64):
        super().__init__()
        self.l1 = torch.nn.Linear(hidden, hidden)
        self.s = torch.nn.Parameter(torch.rand(batch, hidden) + 0.5)

    def forward(self, x):
        return F.dropout(F.gelu(self.l1(x)) * self.s, P)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_backward_goes_through_the_same_mask(mesh_shape, sim_mesh):
    mesh = sim_mesh(mesh_shape)
    torch.manual_seed(0)
    model, x, c = ScaledDrop(), torch.randn(64, 64), torch.randn(64, 64)
    g = F.gelu(model.l1(x)).detach()
    with LocalTensorMode(frozenset(range(mesh.size()))):
        pmodel = autoparallel.autoparallelize(model, (x.to("meta"),), device_mesh=mesh, cost_model=CPU,
                                              cache_dir=False, outputs="replicated")  # y whole
        torch.manual_seed(1)
        y = pmodel(x)
        (y * c).sum().backward()
        grad = one(whole(pmodel.s.grad))
    keep = one(y) != 0
    assert 0.4 < keep.float().mean().item() < 0.6
    assert torch.equal(grad == 0, ~keep)  # zero exactly where the mask dropped
    torch.testing.assert_close(grad, c * g * 2 * keep, rtol=1e-4, atol=1e-5)


class DropMLP(torch.nn.Module):
    def __init__(self, hidden=128, layers=6, p=P):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden) for _ in range(layers)])
        self.p = p

    def forward(self, x, y):
        for layer in self.layers:
            x = F.dropout(F.gelu(layer(x)), self.p)
        return F.mse_loss(x, y)


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_checkpoint_recompute_draws_the_forward_masks(mesh_shape, sim_mesh):
    """The same plan with and without its checkpoint regions: equal losses and gradients for
    the same seed (a recompute drawing other masks would change the gradients), other
    gradients for another seed."""
    mesh = sim_mesh(mesh_shape)
    torch.manual_seed(0)
    model = DropMLP()
    x, y = torch.randn(256, 128), torch.randn(256, 128)
    meta = (x.to("meta"), y.to("meta"))
    free = autoparallel.plan(model, meta, mesh_shape=mesh_shape, cost_model=CPU, cache_dir=False)
    for fraction in (0.8, 0.7, 0.6, 0.55, 0.5):  # the tightest budget sharding alone cannot meet: per mesh
        plan = autoparallel.plan(model, meta, mesh_shape=mesh_shape, cost_model=CPU, cache_dir=False,
                                 memory_budget=int(fraction * free.estimate.peak_memory_bytes), offload=False)
        if plan.checkpoint and plan.checkpoint.regions:
            break
    assert plan.checkpoint and plan.checkpoint.regions, "the budget should need recomputation"
    traced = ColoTracer().trace(model, meta)
    with LocalTensorMode(frozenset(range(mesh.size()))):
        ck = emit(copy.deepcopy(model), traced, plan, mesh)
        plain = emit(copy.deepcopy(model), traced, dataclasses.replace(plan, checkpoint=None), mesh)
        regions = [m.code for n, m in ck.graph_module.named_children() if n.startswith("checkpoint")]
        assert any("random_dropout" in code for code in regions), "dropout should run inside a checkpoint region"
        results = []
        for m, seed in [(ck, 1), (plain, 1), (ck, 2)]:
            torch.manual_seed(seed)
            loss = m(x, y)
            loss.backward()
            results.append((one(loss.detach()), {n: one(whole(p.grad)).clone() for n, p in m.named_parameters()}))
            m.zero_grad(set_to_none=True)
    (l_ck, g_ck), (l_plain, g_plain), (_, g_other) = results
    assert torch.equal(l_ck, l_plain)
    for name in g_plain:
        torch.testing.assert_close(g_ck[name], g_plain[name], rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.equal(g_other["layers.0.weight"], g_ck["layers.0.weight"])


@pytest.mark.parametrize("mesh_shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_parity_with_one_device_at_p0(mesh_shape, sim_mesh):
    mesh = sim_mesh(mesh_shape)
    torch.manual_seed(0)
    ref = DropMLP(hidden=64, layers=3, p=0.0)
    model = copy.deepcopy(ref)
    x, y = torch.randn(64, 64), torch.randn(64, 64)
    want = ref(x, y)
    want.backward()
    with LocalTensorMode(frozenset(range(mesh.size()))):
        pmodel = autoparallel.autoparallelize(model, (x.to("meta"), y.to("meta")), device_mesh=mesh,
                                              cost_model=CPU, cache_dir=False)
        assert "draw_seed" not in pmodel.graph_module.code  # p = 0 draws nothing
        loss = pmodel(x, y)
        loss.backward()
        torch.testing.assert_close(one(loss.detach()), want.detach(), rtol=1e-4, atol=1e-5)
        ref_params = dict(ref.named_parameters())
        for name, p in pmodel.named_parameters():
            torch.testing.assert_close(one(whole(p.grad)), ref_params[name].grad, rtol=1e-4, atol=1e-5,
                                       msg=name)


@pytest.mark.parametrize("case", ["causal", "bool_mask", "float_mask", "gqa"])
def test_attention_kernel_matches_sdpa(case):
    """The attention the pass substitutes for SDPA with dropout: at p = 0 it is SDPA."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 8, 16, generator=g)
    hk = 2 if case == "gqa" else 4
    k, v = torch.randn(2, hk, 8, 16, generator=g), torch.randn(2, hk, 8, 16, generator=g)
    kw = {"is_causal": case == "causal", "enable_gqa": case == "gqa"}
    if case == "bool_mask":
        kw["attn_mask"] = torch.rand(2, 1, 8, 8, generator=g) > 0.3
        kw["attn_mask"][..., 0] = True
    if case == "float_mask":
        kw["attn_mask"] = torch.randn(8, 8, generator=g)
    want = F.scaled_dot_product_attention(q, k, v, **kw)
    got = rk.scaled_dot_product_attention(torch.tensor([1]), 0, torch.tensor([0]), (0,), q, k, v,
                                          kw.pop("attn_mask", None), 0.0, **kw)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_attention_kernel_drops_weights():
    """With v the identity the output is the dropped attention weights."""
    q, k = torch.randn(2, 4, 32, 32), torch.randn(2, 4, 32, 32)
    v = torch.eye(32).expand(2, 4, 32, 32)
    weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(32), -1)
    got = rk.scaled_dot_product_attention(torch.tensor([1]), 0, torch.tensor([0]), (0,), q, k, v, None, P)
    keep = got != 0
    assert abs(keep.float().mean().item() - (1 - P)) < 0.05
    torch.testing.assert_close(got[keep], weights[keep] * 2, rtol=1e-5, atol=1e-6)
