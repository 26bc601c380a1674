"""Host-memory offload of parameters: a strategy the planner takes only when nothing else fits
device memory, counted off the device by the memory model, priced over the host link, and
exact at run time."""

import copy
import re

import pytest
import torch

import autoparallel
from autoparallel.errors import InfeasiblePlanError
from autoparallel.plan import Plan
from autoparallel.solver.costs import PRESETS, DevicePreset
from autoparallel.strategies.offload import offload_ok
from autoparallel.placement import R, Shard
from models import TwoLinear, batch_for, hf_model, to_meta
from test_parity import train_side_by_side

KW = dict(cache_dir=False, cost_model=autoparallel.CostModel("cpu"))


def _smallest_without_offload(model, inputs, mesh_shape) -> int:
    with pytest.raises(InfeasiblePlanError, match="even recomputing") as err:
        autoparallel.plan(model, inputs, mesh_shape=mesh_shape, memory_budget="64KiB", offload=False, **KW)
    return int(re.search(r"\((\d+) bytes\)", str(err.value)).group(1))


@pytest.fixture(scope="module")
def gpt2():
    with torch.device("meta"):
        model = hf_model("gpt2", layers=2)
    return model, to_meta(batch_for("gpt2", 0, batch=4, seq=32))


@pytest.fixture(scope="module")
def need(gpt2):
    """The smallest peak GPT-2 reaches on 2 devices without offload (one failed search, shared)."""
    return _smallest_without_offload(*gpt2, (2,))


def test_offloaded_when_device_memory_is_short(gpt2, need):
    """Not while the fastest plan fits; below the smallest peak reachable on the device, the
    only plans that fit offload; in between, offloading wins where it is faster than
    recomputing (host copies of these small parameters cost little)."""
    model, inputs = gpt2
    free = autoparallel.plan(model, inputs, mesh_shape=(2,), **KW)
    assert free.offloaded == ()
    at_need = autoparallel.plan(model, inputs, mesh_shape=(2,), memory_budget=need, **KW)
    kept = autoparallel.plan(model, inputs, mesh_shape=(2,), memory_budget=need, offload=False, **KW)
    assert at_need.estimate.step_time_s <= kept.estimate.step_time_s
    tight = autoparallel.plan(model, inputs, mesh_shape=(2,), memory_budget=int(0.8 * need), **KW)
    assert tight.offloaded and tight.estimate.peak_memory_bytes <= int(0.8 * need)
    assert "in host memory" in str(tight)
    for name in tight.offloaded:  # only parameters no mesh axis replicates
        assert offload_ok(tight.param_placements[name], (2,)), name
    assert Plan.from_json(tight.to_json()) == tight
    assert tight.estimate.step_time_s > free.estimate.step_time_s  # host copies and a host step cost time


def test_offload_off_raises_and_says_so(gpt2, need):
    model, inputs = gpt2
    with pytest.raises(InfeasiblePlanError, match="even with parameters offloaded"):
        autoparallel.plan(model, inputs, mesh_shape=(2,), memory_budget="64KiB", **KW)
    with pytest.raises(InfeasiblePlanError) as err:
        autoparallel.plan(model, inputs, mesh_shape=(2,), memory_budget=int(0.8 * need), offload=False, **KW)
    assert "offloaded" not in str(err.value)


def test_offload_rule_and_old_plans():
    assert offload_ok((Shard(0), Shard(1)), (2, 4)) and offload_ok((R, Shard(0)), (1, 4))
    assert not offload_ok((R, Shard(0)), (2, 4))
    old = DevicePreset.to_json(PRESETS["a100"])
    for key in ("host_link_bw", "host_mem_bw"):
        old.pop(key)
    assert DevicePreset.from_json(old).host_link_bw == 25e9  # a preset cached before the host rates


@pytest.mark.slow
def test_offloaded_module_trains_exactly(sim_mesh):
    """Loss and every gradient equal the single-device model's over three SGD steps on the
    host-held parameters."""
    from torch.distributed._local_tensor import LocalTensorMode

    torch.manual_seed(0)
    ref = hf_model("gpt2", layers=2).train()
    model = copy.deepcopy(ref)
    batch = batch_for("gpt2", 0, batch=4, seq=32)
    need = _smallest_without_offload(ref, to_meta(batch), (2,))
    ranks = frozenset(range(2))
    mesh = sim_mesh((2,))  # outside LocalTensorMode: a mesh made inside it nests the ranks' tensors
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, to_meta(batch), device_mesh=mesh, memory_budget=int(0.8 * need),
                                              **KW)
    assert pmodel.plan.offloaded and "onto_device(" in pmodel.graph_module.code
    train_side_by_side(ref, pmodel, [batch_for("gpt2", step, batch=4, seq=32) for step in range(3)], ranks)


def test_offloaded_weight_copied_onto_a_gpu_read_in_place_on_a_cpu():
    """An offloaded weight that its reader takes in the layout held is copied onto a GPU (the
    copy autograd keeps, and its gradient, are ``gathered`` items) but read in place on a CPU,
    whose memory is the host's (``benchmarks/memory_bound.py``'s offloading rows were modelled
    +14 % and +11 % over their measured device peaks while the CPU copies were counted); a weight
    all-gathered for its reader is a new tensor on both. The ILP's linear terms stay a lower
    bound of every item."""
    from autoparallel.solver.memory import MemoryModel
    from autoparallel.strategies import StrategyGenerator
    from autoparallel.strategies.offload import with_offload
    from autoparallel.tracer import ColoTracer

    traced = ColoTracer().trace(TwoLinear(), (torch.empty(128, 64, device="meta"),))
    gen = StrategyGenerator((2,))
    strategies = with_offload(gen.generate(traced.gm), (2,))
    w = next(n for n in traced.gm.graph.nodes if n.op == "get_attr" and n.target == "w2")
    mm = next(n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.matmul.default and w in n.args)
    held = next(s for s in strategies[w] if s.offload and s.outputs[0] == (Shard(1),))
    in_place = next(s for s in strategies[mm] if s.inputs[1] == (Shard(1),))
    gathered = next(s for s in strategies[mm] if s.inputs[1] == (R,))
    shard, whole = 64 * 16 * 4, 64 * 32 * 4

    def copies(cost_model):
        model = MemoryModel(traced.gm, gen.aliases, (2,), traced_on=traced.device, cost_model=cost_model)
        items = [it for it in model.items if it.source == (w, 0)]
        assert len(items) == 2  # the copy from the forward to the backward, its gradient in the backward
        out = []
        for reader in (in_place, gathered):
            choice = {w: held, mm: reader}
            out.append([it.bytes(choice) for it in items])
            for it in items:
                assert sum(size(choice[node]) for node, size in it.linear(model._held_bytes)) <= it.bytes(choice)
        return out

    gpu_like = autoparallel.CostModel(DevicePreset(**{**PRESETS["cpu"].__dict__, "name": "gpu-like"}))
    assert not gpu_like.host_is_device and autoparallel.CostModel("cpu").host_is_device
    assert copies(gpu_like) == [[shard, shard], [whole, whole]]
    assert copies(autoparallel.CostModel("cpu")) == [[0, 0], [whole, whole]]


class _FusedPair(torch.nn.Module):
    """One weight read as two halves (``split``), as a fused QKV weight is."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(64, 64))
        self.scale = torch.nn.Parameter(torch.ones(64))

    def forward(self, x):
        a, b = self.w.split(32, dim=1)
        h = x * self.scale
        return h @ a + h @ b


def test_offloaded_fused_weight_copied_onto_a_gpu_when_read_through_its_parts():
    """An offloaded weight read through views of it (the halves of a split) is copied onto a GPU
    for each reader as it is when read whole: the copies are counted though the views' own
    strategies hold nothing in host memory (they were counted as read in place); on a CPU
    none is."""
    from autoparallel.solver.memory import MemoryModel
    from autoparallel.strategies import StrategyGenerator
    from autoparallel.strategies.offload import with_offload
    from autoparallel.tracer import ColoTracer

    traced = ColoTracer().trace(_FusedPair(), (torch.empty(128, 64, device="meta"),))
    gen = StrategyGenerator((2,))
    strategies = with_offload(gen.generate(traced.gm), (2,))
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    w, split = nodes["w"], nodes["split"]
    choice = {n: strategies[n][0] for n in strategies}  # replicated everywhere ...
    choice[w] = next(s for s in strategies[w] if s.offload and s.outputs[0] == (Shard(0),))  # ... but w
    choice[split] = next(s for s in strategies[split] if s.inputs[0] == (Shard(0),))
    for mm in ("matmul", "matmul_1"):  # each half read in place, as held (row-split)
        choice[nodes[mm]] = next(s for s in strategies[nodes[mm]] if s.inputs[1] == (Shard(0),))
    half = 32 * 32 * 4

    def copies(cost_model):
        model = MemoryModel(traced.gm, gen.aliases, (2,), traced_on=traced.device, cost_model=cost_model)
        items = [it for it in model.items if it.source is not None and it.source[0] is split]
        assert len(items) == 4  # per half: the copy kept for the backward, its gradient
        return [it.bytes(choice) for it in items]

    gpu_like = autoparallel.CostModel(DevicePreset(**{**PRESETS["cpu"].__dict__, "name": "gpu-like"}))
    assert copies(gpu_like) == [half] * 4
    assert copies(autoparallel.CostModel("cpu")) == [0] * 4
