"""Optimizer states sharded over the axes that replicate a parameter (ZeRO stage 1): offered when
the fastest plan does not fit, priced and counted, and exact at run time (the optimizer steps
the shard; the graphs read a whole copy gathered after each step)."""

import copy

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard

import autoparallel
from autoparallel.plan import Plan
from autoparallel.strategies.zero import state_spec, zero_axes, zero_dim
from models import batch_for, hf_model, to_meta
from test_parity import train_side_by_side


class SlowStep(autoparallel.CostModel):
    """The cpu preset on a device whose optimizer step costs a microsecond per element: sharding
    the optimizer states then pays for the all-gather after the step."""

    def __init__(self):
        super().__init__("cpu")

    def optimizer_step_time(self, numel, *args, **kwargs):
        return super().optimizer_step_time(numel, *args, **kwargs) + numel * 1e-6


class SlowScatter(SlowStep):
    """SlowStep where a reduce-scatter moves a byte a nanosecond (100 times the preset's all-reduce
    per byte; gloo's runs at a third of its all-reduce's bandwidth on these machines): the gradient
    is then all-reduced, ZeRO stage 1."""

    def collective_time(self, kind, axis, nbytes):
        t = super().collective_time(kind, axis, nbytes)
        return t + nbytes * 1e-9 if kind == "reduce_scatter" else t


KW = dict(cache_dir=False, cost_model=SlowScatter())


def _gpt2():
    torch.manual_seed(0)
    return hf_model("gpt2", layers=2).train()


def _tight(model, batch, mesh_shape) -> int:
    """A budget the fastest plan misses: 0.9 of its peak."""
    free = autoparallel.plan(model, to_meta(batch), mesh_shape=mesh_shape, **KW)
    assert not free.state_placements  # the fastest plan fits: nothing more is priced
    return int(0.9 * free.estimate.peak_memory_bytes)


def test_zero_axes_and_dims():
    assert zero_axes((Replicate(), Replicate()), (2, 2)) == [(0, 1)]  # the world's group
    assert zero_axes((Replicate(), Shard(0)), (2, 4)) == [(0,)]
    assert zero_axes((Replicate(), Replicate(), Shard(0)), (2, 2, 2)) == [(0,), (1,)]  # not one group
    assert zero_axes((Shard(0),), (4,)) == [] and zero_axes((Replicate(),), (1,)) == []
    assert zero_dim((6, 8), (Replicate(),), (4,), (0,)) == 1  # 6 rows do not split in 4
    assert zero_dim((8, 6), (Replicate(), Shard(0)), (2, 2), (0,)) == 1  # dim 0 is the tensor-parallel one
    assert zero_dim((3,), (Replicate(),), (2,), (0,)) is None
    assert state_spec((Replicate(), Shard(0)), (0,), 1) == (Shard(1), Shard(0))


def test_states_sharded_when_memory_is_short():
    """Not while the fastest plan fits; under a budget it misses, the plan shards optimizer states
    where that is the fastest way to fit, the estimate counts shards and all-gathers, and the plan's
    JSON keeps the state placements (and refuses ones the runtime cannot hold)."""
    model, batch = _gpt2(), batch_for("gpt2", 0, batch=4, seq=32)
    budget = _tight(model, batch, (2,))
    plan = autoparallel.plan(model, to_meta(batch), mesh_shape=(2,), memory_budget=budget, **KW)
    off = autoparallel.plan(model, to_meta(batch), mesh_shape=(2,), memory_budget=budget, zero=False, **KW)
    assert plan.state_placements and not off.state_placements and not plan.sharded_gradients
    assert plan.estimate.step_time_s < off.estimate.step_time_s
    assert plan.estimate.peak_memory_bytes <= budget and plan.holds_dtensors
    for name, state in plan.state_placements.items():
        held = plan.param_placements[name]
        assert [p for p in held] == [Replicate()] and isinstance(state[0], Shard), name
    assert Plan.from_json(plan.to_json()) == plan
    name = next(iter(plan.state_placements))
    bad = plan.to_json().replace(f'"state_placements": {{"{name}": ["S', f'"state_placements": {{"{name}": ["P')
    with pytest.raises(ValueError, match="state_placements"):
        Plan.from_json(bad)
    assert "optimizer states sharded" in str(plan)


@pytest.mark.parametrize("mesh_shape", [(2,), pytest.param((2, 2), marks=pytest.mark.slow)])
def test_sharded_states_train_exactly(sim_mesh, mesh_shape):
    """Loss and every gradient equal the single-device model's over three SGD steps (two on 2 x 2), the optimizer
    stepping each shard and the whole copies gathered after every step; ``state_dict`` holds the
    shards, and loading a single-device state dict reaches the whole copies."""
    ref = _gpt2()
    model = copy.deepcopy(ref)
    batches = [batch_for("gpt2", step, batch=4, seq=32) for step in range(3 if len(mesh_shape) == 1 else 2)]
    budget = _tight(ref, batches[0], mesh_shape)
    ranks = frozenset(range(int(torch.tensor(mesh_shape).prod())))
    mesh = sim_mesh(mesh_shape)  # outside LocalTensorMode: a mesh made inside it nests the ranks' tensors
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, to_meta(batches[0]), device_mesh=mesh, memory_budget=budget, **KW)
    states = pmodel.plan.state_placements
    assert states and not pmodel.plan.sharded_gradients
    name = next(iter(states))
    param = dict(pmodel.named_parameters())[name]
    assert isinstance(param, DTensor) and tuple(param.placements) == tuple(states[name])
    train_side_by_side(ref, pmodel, batches, ranks)
    with LocalTensorMode(ranks):
        torch.testing.assert_close(pmodel.state_dict()[name].full_tensor(), ref.state_dict()[name],
                                   rtol=1e-4, atol=1e-5)
        torch.manual_seed(1)
        fresh = {k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in ref.state_dict().items()}
        pmodel.load_state_dict(fresh)
        ref.load_state_dict(fresh)
    train_side_by_side(ref, pmodel, batches[:1], ranks)


def test_sharded_states_counted_by_the_memory_model():
    """Under a ZeRO strategy a parameter holds its whole copy and its shard, its gradient is whole
    (the bucket) and a shard, and each optimizer state is a shard."""
    from autoparallel.solver.memory import MemoryModel
    from autoparallel.strategies import StrategyGenerator
    from autoparallel.strategies.zero import with_zero
    from autoparallel.tracer import ColoTracer
    from models import TwoLinear

    traced = ColoTracer().trace(TwoLinear(), (torch.empty(128, 64, device="meta"),))
    gen = StrategyGenerator((4,))
    strategies = with_zero(gen.generate(traced.gm), (4,))
    w = next(n for n in traced.gm.graph.nodes if n.op == "get_attr" and n.target == "w2")
    plain = next(s for s in strategies[w] if s.outputs[0] == (Replicate(),) and not s.zero)
    zero = next(s for s in strategies[w] if s.outputs[0] == (Replicate(),) and s.zero == (0,))
    model = MemoryModel(traced.gm, gen.aliases, (4,), traced_on=traced.device)
    whole = 64 * 32 * 4
    for kind, want in (("parameters", whole + whole // 4), ("gradients", whole + whole // 4),
                       ("optimizer", 2 * whole // 4)):
        assert [it.bytes({w: zero}) for it in model.items if it.owner is w and it.kind == kind] == [want], kind
    assert [it.bytes({w: plain}) for it in model.items if it.owner is w and it.kind == "optimizer"] == [2 * whole]


class CheapScatter(SlowStep):
    """SlowStep where an all-reduced gradient costs a millisecond per parameter: reduce-scattering
    it onto the shard (ZeRO stage 2, priced by the reduce-scatter) then pays."""

    def grad_reduction_time(self, axis, nbytes):
        return 1e-3


def test_stage2_gradients_reduce_scattered_train_exactly(sim_mesh):
    """Where the all-reduce costs more, the plan reduce-scatters the gradients onto the shards
    (``sharded_gradients``, each shard's gradient held alone), and the module trains exactly."""
    ref = _gpt2()
    batches = [batch_for("gpt2", step, batch=4, seq=32) for step in range(3)]
    kw = dict(cache_dir=False, cost_model=CheapScatter())
    free = autoparallel.plan(ref, to_meta(batches[0]), mesh_shape=(2,), **kw)
    budget = int(0.9 * free.estimate.peak_memory_bytes)
    plan = autoparallel.plan(ref, to_meta(batches[0]), mesh_shape=(2,), memory_budget=budget, **kw)
    assert plan.sharded_gradients and set(plan.sharded_gradients) <= set(plan.state_placements)
    assert Plan.from_json(plan.to_json()) == plan
    name = plan.sharded_gradients[0]
    bad = plan.to_json().replace('"sharded_gradients": [', f'"sharded_gradients": ["{name}x", ')
    with pytest.raises(ValueError, match="sharded_gradients"):
        Plan.from_json(bad)
    model = copy.deepcopy(ref)
    ranks = frozenset(range(2))
    mesh = sim_mesh((2,))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, to_meta(batches[0]), device_mesh=mesh, memory_budget=budget, **kw)
    assert pmodel.plan.sharded_gradients
    assert "reduce-scattered onto their optimizer shards" in pmodel.graph_module.code
    train_side_by_side(ref, pmodel, batches, ranks)
