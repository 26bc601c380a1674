"""The optimizer step in the modelled step time (CostModel.optimizer_step_time), and the gradient
bucket spanning the world priced as the one all-reduce the runtime runs (docs/design.md,
"The optimizer step and the world-spanning bucket in the estimate")."""

import collections

import pytest
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Replicate
from torch.utils._python_dispatch import TorchDispatchMode

import autoparallel
from autoparallel.mesh import MeshSpec
from autoparallel.solver.costs import (OPTIMIZER_ELEMENTS, OPTIMIZER_OPS, CostModel, DevicePreset,
                                       optimizer_implementation)
from autoparallel.solver.memory import OPTIMIZER_STATES
from models import MLP

# no per-op overheads: the optimizer step is its memory traffic alone
TRAFFIC_ONLY = DevicePreset("traffic only", 1e12, 1e12, 1e10, 2**30)


def _plan(cost_model, mesh=(4,), **kw):
    with torch.device("meta"):
        model = MLP()
    x = torch.empty(64, 256, device="meta")
    return autoparallel.plan(model, {"x": x, "y": x}, mesh_shape=mesh, cache_dir=False, cost_model=cost_model,
                             **kw)


def test_every_optimizer_is_priced():
    assert set(OPTIMIZER_ELEMENTS) == set(OPTIMIZER_STATES)
    assert {k for k, _ in OPTIMIZER_OPS} == set(OPTIMIZER_STATES)
    assert optimizer_implementation("cpu") == "for-loop" and optimizer_implementation("cuda") == "foreach"
    with pytest.raises(ValueError, match="no optimizer cost for optimizer='lion'"):
        CostModel("cpu").optimizer_step_time(10, 4, "lion")


def test_cost_scales_with_the_local_shard():
    """A parameter sharded over 4 devices updates a quarter of its elements on each: a quarter
    of the traffic; the per-op overhead does not shrink."""
    n = 1 << 20
    cm = CostModel("cpu")
    whole, quarter = cm.optimizer_step_time(n, 4), cm.optimizer_step_time(n // 4, 4)
    traffic = OPTIMIZER_ELEMENTS["adamw"] * n * 4 / cm.device.mem_bw
    overhead = 8 * cm.device.dtensor_op_overhead + 2 * cm.device.op_overhead
    assert whole == pytest.approx(traffic + overhead)
    assert quarter == pytest.approx(traffic / 4 + overhead)
    # in a plan: sharding every parameter over the mesh of 4 (FSDP) against replicating them (DDP)
    data = _plan(CostModel(TRAFFIC_ONLY), parallelism="data").estimate.optimizer_s
    fsdp = _plan(CostModel(TRAFFIC_ONLY), parallelism="fsdp").estimate.optimizer_s
    params = 4 * (256 * 256 + 256)
    assert data == pytest.approx(OPTIMIZER_ELEMENTS["adamw"] * params * 4 / TRAFFIC_ONLY.mem_bw)
    assert fsdp == pytest.approx(data / 4)


def test_sgd_costs_less_than_adamw():
    cm = CostModel("cpu")
    for impl in ("for-loop", "foreach"):
        times = {o: cm.optimizer_step_time(4096, 4, o, impl, params=8) for o in OPTIMIZER_STATES}
        assert times["sgd"] < times["sgd_momentum"] < times["adam"] < times["adamw"], (impl, times)
    sgd = _plan(CostModel("cpu"), optimizer="sgd").estimate.optimizer_s
    adamw = _plan(CostModel("cpu"), optimizer="adamw").estimate.optimizer_s
    assert 0 < sgd < adamw


def test_foreach_shares_its_group_ops():
    """foreach: the group's ops are shared by its parameters, so the parameters' sum is the step."""
    dev = CostModel("cpu").device
    cm = CostModel("cpu")
    step = sum(cm.optimizer_step_time(0, 4, "adamw", "foreach", params=52) for _ in range(52))
    assert step == pytest.approx(8 * dev.dtensor_op_overhead + 2 * dev.op_overhead + 52 * 2 * dev.op_overhead)
    loop = sum(cm.optimizer_step_time(0, 4, "adamw", "for-loop", params=52) for _ in range(52))
    assert loop == pytest.approx(52 * (8 * dev.dtensor_op_overhead + 2 * dev.op_overhead))


def test_estimate_includes_the_optimizer_step():
    plan = _plan(CostModel("cpu"), mesh=(2, 2))
    est = plan.estimate
    assert 0 < est.optimizer_s < est.compute_s
    assert est.step_time_s == pytest.approx(est.compute_s + est.comm_s)
    assert plan.solver_stats.objective_s == pytest.approx(est.step_time_s, rel=1e-9)
    # each trainable parameter's row carries its update: the rows add up to optimizer_s
    params = [n for n in plan.nodes.values() if n.op == "get_attr"]
    assert sum(n.compute_s for n in params) == pytest.approx(est.optimizer_s)
    assert "(optimizer step " in str(plan)


def test_world_spanning_bucket_is_one_all_reduce():
    """A data-parallel plan on (2, 2): every gradient is all-reduced once over the 4 devices
    (2·3/4 = 1.5 buffers moved, one latency), below an all-reduce per axis (2 · 2·1/2 = 2
    buffers, two latencies)."""
    cm = CostModel("cpu")
    plan = _plan(cm, mesh=(2, 2), parallelism="data")
    mesh = cm.mesh
    nbytes = 4 * (4 * (256 * 256 + 256))
    per_axis = sum(cm.collective_time("all_reduce", a, nbytes) for a in range(2))
    world = cm.collective_time("all_reduce", None, nbytes)
    assert world == pytest.approx(mesh.alpha[0] + 1.5 * nbytes * mesh.beta[0])
    assert plan.estimate.grad_comm_s == pytest.approx(world)
    assert plan.estimate.grad_comm_s < per_axis
    # the slowest axis' link prices the ring over the world
    slow = CostModel("cpu").bind(MeshSpec((2, 2), alpha=(1e-6, 5e-6), beta=(1e-10, 4e-10)))
    assert slow.collective_time("all_reduce", None, nbytes) == pytest.approx(5e-6 + 1.5 * nbytes * 4e-10)


def test_world_bucket_from_a_profile():
    """With a profile, each axis' link is its all-reduce line over the ring factor."""
    from autoparallel.solver.costs import CollectiveTable, CommProfile, IDENTITY_FIELDS

    identity = dict.fromkeys(IDENTITY_FIELDS, "x") | {"world_size": 4, "mesh_shape": [2, 2], "hosts": ["h"] * 4}
    sizes = (4096, 1 << 20)
    tables = {(a, k): CollectiveTable.fit(sizes, [alpha + beta * b for b in sizes])
              for a, (alpha, beta) in enumerate(((1e-5, 1e-9), (2e-5, 3e-9)))
              for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    cm = CostModel.from_profile(CommProfile(identity, ("dp", "tp"), tables, TRAFFIC_ONLY)).bind(MeshSpec((2, 2)))
    # axis 1's line 2e-5 + 3e-9 B holds the ring factor 2·1/2 = 1: its link is 3e-9 s/B
    assert cm.collective_time("all_reduce", None, 1 << 20) == pytest.approx(2e-5 + 1.5 * (1 << 20) * 3e-9, rel=1e-6)


# ------------------------------------------------------------------ ops counted in real steps
class _CountOps(TorchDispatchMode):
    """Counts the ops dispatched, on DTensors and on plain tensors (the step's profiler
    record_function markers left out)."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not str(func).startswith("profiler."):
            on_dtensor = any(isinstance(a, DTensor) for a in pytree.tree_leaves((args, kwargs)))
            self.counts["dtensor" if on_dtensor else "plain"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def one_rank_mesh(tmp_path_factory):
    """A 1-device mesh of a real 1-rank gloo process group."""
    from torch.distributed.device_mesh import init_device_mesh

    store = dist.FileStore(str(tmp_path_factory.mktemp("gloo") / "store"), 1)
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def dtensor_params(one_rank_mesh):
    """DTensor parameters with gradients, as a module holds them when its plan shards some
    parameter (a 2-layer MLP's shapes; a 1-device mesh, on which every plan replicates)."""
    from torch.distributed.tensor import distribute_tensor

    params = []
    for shape in [(32, 32), (32,), (32, 32), (32,)]:
        p = torch.nn.Parameter(distribute_tensor(torch.randn(shape), one_rank_mesh, [Replicate()]))
        p.grad = distribute_tensor(torch.randn(shape), one_rank_mesh, [Replicate()])
        params.append(p)
    return params


def _count_second_step(opt) -> collections.Counter:
    opt.step()  # the first step creates the states
    with _CountOps() as counted:
        opt.step()
    return counted.counts


OPTIMIZERS = {"adamw": lambda ps, **kw: torch.optim.AdamW(ps, **kw),
              "adam": lambda ps, **kw: torch.optim.Adam(ps, **kw),
              "sgd": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, **kw),
              "sgd_momentum": lambda ps, **kw: torch.optim.SGD(ps, lr=0.1, momentum=0.9, **kw)}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZER_STATES))
@pytest.mark.parametrize("implementation", ["for-loop", "foreach"])
def test_op_counts_match_a_real_step(dtensor_params, optimizer, implementation):
    """OPTIMIZER_OPS (counted in the torch source) against the ops a real step dispatches."""
    counts = _count_second_step(OPTIMIZERS[optimizer](dtensor_params, foreach=implementation == "foreach"))
    ops, n = OPTIMIZER_OPS[(optimizer, implementation)], len(dtensor_params)
    assert counts["dtensor"] == ops.per_param * n + ops.per_group
    assert counts["plain"] == ops.per_param_plain * n + ops.per_group_plain


def test_replicated_plan_holds_plain_parameters(one_rank_mesh):
    """A plan that replicates every parameter (every plan on one device) holds them as plain
    tensors, as DDP does: its optimizer step dispatches no DTensor op."""
    x = torch.empty(8, 32, device="meta")
    pmodel = autoparallel.autoparallelize(MLP(hidden=32, layers=2), {"x": x, "y": x}, device_mesh=one_rank_mesh,
                                          cache_dir=False, cost_model=CostModel("cpu"))
    pmodel(x=torch.randn(8, 32), y=torch.randn(8, 32)).backward()
    params = list(pmodel.parameters())
    assert not pmodel.holds_dtensors and len(params) == 4
    assert all(not isinstance(p.data, DTensor) and p.grad is not None for p in params)
    ops = OPTIMIZER_OPS[("adamw", "for-loop")]
    assert _count_second_step(torch.optim.AdamW(params)) == {"plain": (ops.per_param + ops.per_param_plain) * 4}


def test_dtensor_overhead_is_paid_once_any_parameter_is_sharded():
    """The plan prices DTensor's dispatch in the optimizer step for every parameter as soon as
    one is sharded (the module then holds them all as DTensors), and not at all when every
    parameter is replicated."""
    overhead_only = CostModel(DevicePreset("overhead only", 1e12, 1e12, 1e30, 2**30, op_overhead=1e-6,
                                           dtensor_op_overhead=1e-5))
    ops, params = OPTIMIZER_OPS[("adamw", "for-loop")], 8
    data = _plan(overhead_only, parallelism="data")
    pinned = _plan(overhead_only, constraints={"layers.0.weight": "S0"})
    assert all(p == Replicate() for s in data.param_placements.values() for p in s)
    assert data.estimate.optimizer_s == pytest.approx(params * (ops.per_param + ops.per_param_plain) * 1e-6)
    assert pinned.estimate.optimizer_s == pytest.approx(params * (ops.per_param * 1e-5 + ops.per_param_plain * 1e-6))


def test_cpu_default_is_the_per_tensor_loop(dtensor_params):
    """torch.optim's default on CPU DTensors runs the per-tensor loop's ops."""
    assert _count_second_step(torch.optim.AdamW(dtensor_params)) == \
        _count_second_step(torch.optim.AdamW(dtensor_params, foreach=False))


def test_profiled_world_all_reduce_prices_the_world_bucket():
    """A profile's table over the world (profile_mesh measures it on meshes of two or more
    axes) prices the world-spanning bucket instead of the slowest-link estimate; it round-trips
    JSON, prints as a 'world' row, and a table without its axis is refused."""
    import json

    from autoparallel.solver.costs import CollectiveTable, CommProfile, IDENTITY_FIELDS

    identity = dict.fromkeys(IDENTITY_FIELDS, "x") | {"world_size": 4, "mesh_shape": [2, 2], "hosts": ["h"] * 4}
    sizes = (4096, 1 << 20)
    line = CollectiveTable.fit(sizes, [1e-5 + 1e-9 * b for b in sizes])
    world = CollectiveTable.fit(sizes, [5e-5 + 8e-9 * b for b in sizes])
    tables = {(a, k): line for a in range(2) for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")}
    profile = CommProfile(identity, ("dp", "tp"), tables | {(None, "all_reduce"): world}, TRAFFIC_ONLY)
    assert CommProfile.from_json(profile.to_json()) == profile
    assert "world" in profile.table()
    cm = CostModel.from_profile(profile).bind(MeshSpec((2, 2)))
    assert cm.collective_time("all_reduce", None, 1 << 20) == pytest.approx(world.time(1 << 20))
    assert cm.grad_reduction_time(None, 1 << 20) == pytest.approx(world.beta * (1 << 20))
    d = json.loads(profile.to_json())
    del d["tables"][-1]["axis"]
    with pytest.raises(ValueError, match="without its axis"):
        CommProfile.from_json(json.dumps(d))
    with pytest.raises(ValueError, match="over mesh axis None"):  # only where buckets can span the world
        CommProfile(identity | {"world_size": 2, "mesh_shape": [2, 1]}, ("dp", "tp"),
                    {(None, "all_reduce"): world}, TRAFFIC_ONLY)


def test_plan_for_cuda_on_any_build(caplog):
    """``plan(device="cuda")`` plans for GPUs on a machine without them, whatever this torch was
    built with: where torch has no CUDA backend the memory model measures saved tensors with
    CPU kernels (some ops on fake CUDA tensors abort the process there), saying so."""
    import logging

    pytest.importorskip("transformers")
    from models import batch_for, hf_model, to_meta

    with torch.device("meta"):
        model = hf_model("llama")
    with caplog.at_level(logging.WARNING, logger="autoparallel"):
        plan = autoparallel.plan(model, to_meta(batch_for("llama", 0)), mesh_shape=(2,), device="cuda",
                                 cost_model=CostModel(TRAFFIC_ONLY), cache_dir=False)
    assert plan.estimate.peak_memory_bytes > 0
    assert ("built without cuda" in caplog.text) == (not torch.backends.cuda.is_built())
