"""The emitted module behaves like the model: train()/eval(), non-tensor call arguments, loading a
single-device state dict (simulated ranks, DESIGN §4 tier 2)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode

import autoparallel
from models import MLP, ShardParams, batch_for, to_meta, whole
from test_batchnorm import BNCNN, full, image_batches
from test_parity import assert_close

RANKS2 = frozenset(range(2))


class DropoutBN(nn.Module):
    """BatchNorm1d and dropout, the two layers whose behaviour depends on the mode."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.bn = nn.BatchNorm1d(32)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(32, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.out(self.drop(F.relu(self.bn(self.fc(x))))), y)


def _batch(seed, n=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randint(0, 10, (n,), generator=g)


def _parallel(model, example, sim_mesh, shape=(2,), **kwargs):
    mesh = sim_mesh(shape)
    with LocalTensorMode(frozenset(range(mesh.size()))):
        meta = tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in example)
        return autoparallel.autoparallelize(model, meta, device_mesh=mesh, cost_model=ShardParams("cpu"), **kwargs)


def test_eval_after_planning_in_train_mode(sim_mesh):
    torch.manual_seed(0)
    ref = DropoutBN()
    pmodel = _parallel(copy.deepcopy(ref), _batch(0), sim_mesh)
    x, y = _batch(0)  # made outside LocalTensorMode, where a generator would draw per rank
    with LocalTensorMode(RANKS2):
        pmodel(x, y)  # training: dropout on, running statistics updated
    ref(x, y)
    torch.testing.assert_close(full(pmodel.bn.running_mean), ref.bn.running_mean)
    ref.eval()
    assert pmodel.eval() is pmodel and not pmodel.training
    before = full(pmodel.bn.running_mean).clone()
    for seed in (1, 2):  # eval: deterministic, equal to the model in eval mode, statistics untouched
        x, y = _batch(seed)
        with LocalTensorMode(RANKS2):
            got = pmodel(x, y)
        assert_close(f"eval loss {seed}", got.detach(), ref(x, y).detach())
    torch.testing.assert_close(full(pmodel.bn.running_mean), before)
    assert len(pmodel.plans) == 2 and [k[0] for k in pmodel.plans] == [True, False]
    for p in pmodel.plans.values():  # the eval graph does not read num_batches_tracked
        assert all(pmodel.plan.param_placements[k] == s for k, s in p.param_placements.items())
    pmodel.train()
    x, y = _batch(3)
    with LocalTensorMode(RANKS2):
        pmodel(x, y)  # back to the training graph: statistics move again
    assert not torch.equal(full(pmodel.bn.running_mean), before)
    assert len(pmodel.plans) == 2  # no third capture


def test_train_after_planning_in_eval_mode_turns_dropout_on(sim_mesh):
    torch.manual_seed(0)
    ref = DropoutBN().eval()
    pmodel = _parallel(copy.deepcopy(ref), _batch(0), sim_mesh)
    x, y = _batch(1)
    with LocalTensorMode(RANKS2):
        assert_close("eval loss", pmodel(x, y).detach(), ref(x, y).detach())
        pmodel.train()
        torch.manual_seed(5)
        a = pmodel(x, y).detach()
        torch.manual_seed(6)
        b = pmodel(x, y).detach()
    assert not torch.equal(a, b), "dropout should draw new masks in training mode"
    assert [k[0] for k in pmodel.plans] == [False, True]


def test_training_after_an_eval_pass_keeps_parity(sim_mesh):
    torch.manual_seed(0)
    ref = BNCNN()
    batches = image_batches(3)
    pmodel = _parallel(copy.deepcopy(ref), batches[0], sim_mesh)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    with LocalTensorMode(RANKS2):
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches):
        ref.eval()
        pmodel.eval()
        with torch.no_grad(), LocalTensorMode(RANKS2):
            assert_close(f"eval {i}", pmodel(x, y), ref(x, y))
        ref.train()
        pmodel.train()
        ref_opt.zero_grad()
        want = ref(x, y)
        want.backward()
        with LocalTensorMode(RANKS2):
            opt.zero_grad()
            got = pmodel(x, y)
            got.backward()
            assert_close(f"train {i}", got.detach(), want.detach())
            for name, p in pmodel.named_parameters():
                assert_close(f"grad {name} {i}", whole(p.grad), dict(ref.named_parameters())[name].grad)
            opt.step()
        ref_opt.step()
        for name, b in pmodel.named_buffers():
            torch.testing.assert_close(full(b), ref.state_dict()[name], msg=name)


def test_non_tensor_arguments_are_part_of_the_signature(sim_mesh):
    pytest.importorskip("transformers")
    from models import build_model

    ref = build_model("gpt2")
    batch = batch_for("gpt2", 0)
    mesh = sim_mesh((2,))
    meta = dict(to_meta(batch), use_cache=False, return_dict=True)
    with LocalTensorMode(RANKS2):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), meta, device_mesh=mesh,
                                              cost_model=ShardParams("cpu"), replan=False)
        got = pmodel(**batch, use_cache=False, return_dict=True)
        assert_close("loss", got.loss.detach(), ref(**batch, use_cache=False, return_dict=True).loss.detach())
        with pytest.raises(autoparallel.InputMismatchError) as info:
            pmodel(**batch, use_cache=False, return_dict=False)
    msg = str(info.value)
    assert "argument return_dict has value False" in msg and "value True" in msg and "replan=True" in msg

    with LocalTensorMode(RANKS2):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), meta, device_mesh=mesh,
                                              cost_model=ShardParams("cpu"))
        got = pmodel(**batch, use_cache=False, return_dict=False)
    assert isinstance(got, tuple)
    assert_close("tuple loss", got[0].detach(), ref(**batch, use_cache=False, return_dict=False)[0].detach())


def test_load_state_dict_takes_a_single_device_state_dict(sim_mesh):
    torch.manual_seed(0)
    ref = MLP()
    batch = batch_for("mlp", 0)
    mesh = sim_mesh((2, 2))
    with LocalTensorMode(frozenset(range(4))):
        pmodel = autoparallel.autoparallelize(MLP(), to_meta(batch), device_mesh=mesh, cost_model=ShardParams("cpu"))
    assert any(not p.placements[0].is_replicate() for p in pmodel.parameters())
    with LocalTensorMode(frozenset(range(4))):
        result = pmodel.load_state_dict(ref.state_dict())  # plain tensors of another initialization
        assert not result.missing_keys and not result.unexpected_keys
        got = pmodel(**batch)
        for name, p in pmodel.named_parameters():
            assert isinstance(p.data, torch.distributed.tensor.DTensor)
            assert_close(name, whole(p), ref.state_dict()[name])
        assert_close("loss", got.detach(), ref(**batch).detach())
        bad = {k: v[:1] for k, v in ref.state_dict().items()}
        with pytest.raises(RuntimeError, match="size mismatch"):
            pmodel.load_state_dict(bad)


def test_ranks_passing_different_batches_are_stopped(sim_mesh):
    torch.manual_seed(0)
    pmodel = _parallel(MLP(), tuple(batch_for("mlp", 0).values()), sim_mesh, check_batch_every=3)
    with LocalTensorMode(RANKS2):
        g = torch.Generator().manual_seed(1)  # under LocalTensorMode it draws per rank: each rank its own batch
        per_rank = tuple(torch.randn(8, 256, generator=g) for _ in range(2))
        with pytest.raises(autoparallel.InputMismatchError, match="different inputs to call 0"):
            pmodel(*per_rank)
    same = tuple(batch_for("mlp", 1).values())
    with LocalTensorMode(RANKS2):
        pmodel(*same)
        pmodel(*per_rank)  # call 2: not checked
        with pytest.raises(autoparallel.InputMismatchError, match="call 3"):
            pmodel(*per_rank)
    with pytest.raises(ValueError, match="check_batch_every"):
        _parallel(MLP(), same, sim_mesh, check_batch_every=-1)


def test_a_plan_handed_in_is_validated(sim_mesh):
    batch = batch_for("mlp", 0)
    good = autoparallel.plan(MLP(), to_meta(batch), mesh_shape=(2,), cost_model=ShardParams("cpu"), cache_dir=False)
    other = autoparallel.plan(MLP(layers=3), to_meta(batch), mesh_shape=(2,), cache_dir=False)
    wide = autoparallel.plan(MLP(), to_meta(batch), mesh_shape=(4,), cache_dir=False)
    mesh = sim_mesh((2,))
    torch.manual_seed(0)
    ref = MLP()
    with LocalTensorMode(RANKS2):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(batch), device_mesh=mesh,
                                              plan=good.to_json())
        assert pmodel.plan == good
        assert_close("loss", pmodel(**batch).detach(), ref(**batch).detach())
        for bad in (other, wide):
            with pytest.raises(autoparallel.PlanMismatchError):
                autoparallel.autoparallelize(MLP(), to_meta(batch), device_mesh=mesh, plan=bad)
        with pytest.raises(TypeError, match="device_mesh must be"):
            autoparallel.autoparallelize(MLP(), to_meta(batch), device_mesh=(2,))
