"""The overlapped runtime: gradient buckets launched during the backward, forward waits
moved to the first reader, parameter all-gathers issued one ahead."""

import copy

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode

import autoparallel
from autoparallel.passes.grad_buckets import grad_buckets
from autoparallel.passes.overlap import data_dependent
from autoparallel.tracer import ColoTracer
from models import MLP, ShardParams, batch_for, build_model, to_meta, whole
from test_parity import assert_close, loss_of

_c10d = torch.ops._c10d_functional


def _mlp_inputs():
    return {"x": torch.empty(8, 64, device="meta"), "y": torch.empty(8, 64, device="meta")}


def test_buckets_follow_the_backward_and_respect_the_cap():
    model = MLP(hidden=64, layers=4)
    traced = ColoTracer().trace(model, _mlp_inputs())
    plan = autoparallel.plan(model, _mlp_inputs(), mesh_shape=(2,), parallelism="data", cache_dir=False)
    param_bytes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    cap = param_bytes["layers.0.weight"] + param_bytes["layers.0.bias"]  # one layer per bucket
    buckets = grad_buckets(traced.gm, plan, set(traced.params), bucket_cap_bytes=cap)
    names = [[m.target for m in b.members] for b in buckets]
    assert names == [[f"layers.{i}.bias", f"layers.{i}.weight"] for i in (3, 2, 1, 0)] or \
        names == [[f"layers.{i}.weight", f"layers.{i}.bias"] for i in (3, 2, 1, 0)]
    assert all(b.nbytes <= cap and b.axes == (0,) for b in buckets)
    one = grad_buckets(traced.gm, plan, set(traced.params))  # 25 MiB default: all in one
    assert len(one) == 1 and len(one[0].members) == 8
    small = grad_buckets(traced.gm, plan, set(traced.params), bucket_cap_bytes=1)  # each its own
    assert [len(b.members) for b in small] == [1] * 8
    with pytest.raises(ValueError, match="bucket_cap_bytes"):
        grad_buckets(traced.gm, plan, set(traced.params), bucket_cap_bytes=0)


@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_bucketed_reduction_keeps_gradients_and_accumulates(sim_mesh, shape):
    """Several buckets reduced at the end of the backward give the single-device gradients,
    also when two backward passes accumulate into .grad without zero_grad in between; on
    (2, 2) each bucket is replicated along both axes and reduced once over the world."""
    mesh = sim_mesh(shape)
    ref = MLP(hidden=64, layers=4)
    model = copy.deepcopy(ref)
    x, y = torch.randn(8, 64), torch.randn(8, 64)
    with LocalTensorMode(frozenset(range(mesh.size()))):
        pmodel = autoparallel.autoparallelize(model, _mlp_inputs(), device_mesh=mesh, parallelism="data",
                                              bucket_cap_mb=0.02)
        assert pmodel.graph_module.code.count("reduce_grads_in_bucket(") >= 3
        for _ in range(2):
            pmodel(x=x, y=y).backward()
    for _ in range(2):
        ref(x=x, y=y).backward()
    for name, p in pmodel.named_parameters():
        assert_close(f"grad of {name}", whole(p.grad), dict(ref.named_parameters())[name].grad)


def test_each_bucket_reduces_before_the_earlier_layers_backward(sim_mesh, monkeypatch):
    """A bucket's reduction runs as soon as its gradients exist, while the backward of the
    earlier layers is still to run: the autograd engine runs the ready node created last first,
    so a bucket created ahead of the whole forward ran after the whole backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autoparallel.runtime_kernels import grad_reduction

    events = []

    class Products(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
                events.append("mm")
            return func(*args, **(kwargs or {}))

    backward = grad_reduction._BucketReduction.backward

    def logged(ctx, *grads):
        events.append("bucket")
        return backward(ctx, *grads)

    monkeypatch.setattr(grad_reduction._BucketReduction, "backward", staticmethod(logged))
    mesh = sim_mesh((2,))
    with LocalTensorMode(frozenset(range(mesh.size()))):
        pmodel = autoparallel.autoparallelize(MLP(hidden=64, layers=4), _mlp_inputs(), device_mesh=mesh,
                                              parallelism="data", bucket_cap_mb=0.02)
        loss = pmodel(x=torch.randn(8, 64), y=torch.randn(8, 64))
        with Products():
            loss.backward()
    assert events.count("bucket") >= 3
    last_mm = max(i for i, e in enumerate(events) if e == "mm")
    assert events.index("bucket") < last_mm, events


def _check_schedule(graph) -> int:
    """Every wait is followed, up to its first reader, only by ops computed from parameters
    (prefetched gathers and their inputs); returns how many parameter gathers are issued
    before the previous gathered parameter is read."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    nodes = list(graph.nodes)
    data = data_dependent(graph)
    for n in nodes:
        if n.op == "call_function" and n.target is _c10d.wait_tensor.default and n.users:
            first = order[min(n.users, key=order.__getitem__)]
            between = nodes[order[n] + 1:first]
            assert all(b not in data for b in between), f"{n.name} waits before {between}"
    gathers = [n for n in nodes if n.target is _c10d.all_gather_into_tensor.default and n not in data]
    ahead = 0
    for prev, cur in zip(gathers, gathers[1:]):
        (wait,) = prev.users
        ahead += order[cur] < min(order[u] for u in wait.users)
    return ahead


def test_waits_move_to_first_reader_and_gathers_run_ahead(sim_mesh):
    """GPT-2 with parameters kept sharded: every wait sits right before the first op reading
    its result, parameter gathers are issued before the previous gathered weight is used,
    and the loss and every gradient still equal one device's."""
    mesh = sim_mesh((2, 2))
    ref = build_model("gpt2")
    model = copy.deepcopy(ref)
    inputs = batch_for("gpt2", 0)
    with LocalTensorMode(frozenset(range(4))):
        pmodel = autoparallel.autoparallelize(model, to_meta(inputs), device_mesh=mesh,
                                              cost_model=ShardParams("cpu"))
        assert _check_schedule(pmodel.graph_module.graph) > 0
        got = loss_of(pmodel(**inputs))
        got.backward()
    want = loss_of(ref(**inputs))
    want.backward()
    assert_close("loss", got.detach(), want.detach())
    for name, p in pmodel.named_parameters():
        assert_close(f"grad of {name}", whole(p.grad), dict(ref.named_parameters())[name].grad)


def test_bucket_buffer_is_reused_only_when_nobody_holds_it(tmp_path):
    """On a real (1-rank gloo) process group a bucket reduces in the same flat buffer step
    after step once the last step's gradients were dropped, and in a fresh one while the
    caller still holds a gradient (kept, or accumulated into): no gradient is overwritten."""
    import torch.distributed as dist

    from autoparallel.runtime_kernels import reduce_grads_in_bucket

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.FileStore(str(tmp_path / "store"), 1))
    try:
        group = dist.group.WORLD.group_name
        params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]

        def backward(scale):
            a, b = reduce_grads_in_bucket((group,), *params)
            (scale * (a.sum() + 2 * b.sum())).backward()

        want = [torch.ones(3, 4), torch.full((5,), 2.0)]
        backward(1.0)
        first = params[0].grad.data_ptr()
        assert all(torch.equal(p.grad, w) for p, w in zip(params, want))
        for p in params:
            p.grad = None
        backward(1.0)
        assert params[0].grad.data_ptr() == first  # reused: nothing held the buffer
        kept = params[0].grad
        for p in params:
            p.grad = None
        backward(3.0)
        assert params[0].grad.data_ptr() != first and torch.equal(kept, want[0])  # kept: a fresh buffer
        backward(1.0)  # accumulates into the gradients of the last backward
        assert all(torch.equal(p.grad, 4 * w) for p, w in zip(params, want))
    finally:
        dist.destroy_process_group()


def test_input_collectives_are_issued_first_and_returned_sums_fused():
    """A collective computed from the inputs alone (a loss's label count) is issued right after
    the inputs, one reading a parameter stays; a pending sum returned whole becomes
    deferred_reduced_output (waited late, no all-reduce in its backward)."""
    from autoparallel.passes.overlap import overlap_collectives
    from autoparallel.runtime_kernels import returned
    from autoparallel.runtime_kernels.grad_reduction import deferred_reduced_output

    g = torch.fx.Graph()
    x, labels = g.placeholder("x"), g.placeholder("labels")
    w = g.get_attr("w")
    y = g.call_function(torch.ops.aten.mm.default, (x, w))
    part = g.call_function(torch.ops.aten.sum.default, (y,))
    kept = g.call_function(_c10d.all_reduce.default, (part, "sum", "1"))
    part = g.call_function(_c10d.wait_tensor.default, (kept,))
    count = g.call_function(torch.ops.aten.sum.default, (g.call_function(torch.ops.aten.ne.Scalar, (labels, -100)),))
    total = g.call_function(_c10d.wait_tensor.default, (g.call_function(_c10d.all_reduce.default, (count, "sum", "1")),))
    loss = g.call_function(torch.ops.aten.div.Tensor, (part, total))
    loss = g.call_function(_c10d.wait_tensor.default, (g.call_function(_c10d.all_reduce.default, (loss, "sum", "1")),))
    g.output((g.call_function(returned, (loss, 2)),))
    stats = overlap_collectives(g)
    assert stats["hoisted"] == 1 and stats["fused_returned_sums"] == 1, stats
    nodes = list(g.nodes)
    reduces = [n for n in nodes if n.target is _c10d.all_reduce.default]
    assert len(reduces) == 2 and nodes.index(reduces[0]) < nodes.index(y) < nodes.index(reduces[1]) and reduces[1] is kept
    assert [n.target for n in nodes if n.op == "call_function"][-1] is deferred_reduced_output


def test_gathers_do_not_run_ahead_of_writes_into_their_inputs():
    """A gather whose input is read from a tensor written in place through a view (T5's shifted
    decoder ids: a ``zeros`` filled through a slice from the labels) stays after the write; the
    gather before it may still be prefetched up to it only through movable ops."""
    from autoparallel.passes.overlap import prefetch_param_gathers

    aten = torch.ops.aten
    g = torch.fx.Graph()
    labels, w = g.placeholder("labels"), g.get_attr("w")
    first = g.call_function(_c10d.all_gather_into_tensor.default, (w, 2, "1"))
    g.call_function(_c10d.wait_tensor.default, (first,))
    ids = g.call_function(aten.zeros.default, ([8, 12],), {"dtype": torch.int64})
    write = g.call_function(aten.copy_.default, (g.call_function(aten.slice.Tensor, (ids, 1, 1)), labels))
    rows = g.call_function(aten.embedding.default, (w, ids))
    second = g.call_function(_c10d.all_gather_into_tensor.default, (rows, 2, "1"))
    g.output((g.call_function(_c10d.wait_tensor.default, (second,)),))
    assert prefetch_param_gathers(g) == 0
    nodes = list(g.nodes)
    assert nodes.index(write) < nodes.index(rows) < nodes.index(second)


@pytest.mark.slow
def test_fused_returned_loss_keeps_parity(sim_mesh):
    """GPT-2 (the benchmark's quick size) split by batch on (2,): its loss's label count is
    all-reduced before the first layer and the loss returned through reduced_output; the loss
    and every gradient equal one device's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import vs_torch

    mesh = sim_mesh((2,))
    ref, sizes = vs_torch.build_model("gpt2", True)
    inputs = vs_torch.global_batch(sizes, torch.device("cpu"))
    with LocalTensorMode(frozenset(range(2))):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(inputs), device_mesh=mesh,
                                              parallelism="data", cost_model=autoparallel.CostModel("cpu"))
        code = pmodel.graph_module.code
        assert "reduced_output(" in code and code.index("all_reduce.default(") < code.index("addmm"), code
        got = pmodel(**inputs).loss
        got.backward()
    want = ref(**inputs).loss
    want.backward()
    assert_close("loss", got.detach(), want.detach())
    for name, p in pmodel.named_parameters():
        assert_close(f"grad of {name}", whole(p.grad), dict(ref.named_parameters())[name].grad)


def _data_parallel_worker(rank: int, shape: tuple) -> None:
    import sys
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import vs_torch

    ref, sizes = vs_torch.build_model("gpt2", True)
    batch = vs_torch.global_batch(sizes, torch.device("cpu"))
    pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(batch), device_mesh=init_device_mesh("cpu", shape),
                                          parallelism="data", cost_model=autoparallel.CostModel("cpu"), cache_dir=False)
    assert "reduced_output(" in pmodel.graph_module.code
    popt, ropt = torch.optim.SGD(pmodel.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    want_grads = dict(ref.named_parameters())
    for step in range(3):  # the bucket buffers are reused from the second step on
        popt.zero_grad(set_to_none=True)
        ropt.zero_grad(set_to_none=True)
        got, want = pmodel(**batch).loss, ref(**batch).loss
        got.backward()
        want.backward()
        if step == 1:  # a second backward accumulates into the gradients the buffer holds
            pmodel(**batch).loss.backward()
            ref(**batch).loss.backward()
        assert_close(f"loss {step}", got.detach(), want.detach())
        for name, p in pmodel.named_parameters():
            assert_close(f"grad of {name}, step {step}", whole(p.grad), want_grads[name].grad)
        popt.step()
        ropt.step()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape", [(2,), (2, 2)])
def test_data_parallel_runtime_on_gloo_ranks(shape):
    """On real gloo processes (where the bucket buffers are kept and, on (2, 2), reduced once over
    the world): GPT-2 split by batch trains three SGD steps, one with an accumulated second
    backward, with the loss and every gradient of one device."""
    import math

    from gloo_ranks import spawn

    spawn(_data_parallel_worker, math.prod(shape), shape)
