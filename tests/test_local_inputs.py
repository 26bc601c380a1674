"""``inputs="local"``: every rank passes its own batch (DDP, a DistributedSampler); the module
computes on the ranks' batches concatenated along dim 0 in rank order. Loss, every parameter
gradient and per-sample outputs equal the single-device model's on that global batch, on
simulated ranks that each pass different rows, for a plan that keeps the batch split (data
parallel) and one that gathers it (tensor parallel)."""

import copy

import pytest
import torch
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard

import autoparallel
from models import MLP, ShardParams, batch_for, placements_of, whole
from models import build_model as build
from test_parity import assert_close

MESHES = [(2,), (4,), (2, 2)]
IDS = ["x".join(map(str, m)) for m in MESHES]


def local_meta(batch, world):
    """The meta tensors of one rank's share of the global ``batch``."""
    return {k: torch.empty((v.shape[0] // world, *v.shape[1:]), dtype=v.dtype, device="meta")
            for k, v in batch.items()}


def per_rank_batch(batch, ranks):
    """``batch`` cut along dim 0, rank ``r`` holding the ``r``-th rows (call under the mode)."""
    world = len(ranks)
    return {k: LocalTensor({r: v.chunk(world)[r].clone() for r in ranks}) for k, v in batch.items()}


def local_parity(ref, batches, mesh, cost, outputs=None, **keywords):
    """Train ``ref`` on the global batches on one device and its copy on ``mesh``, each rank
    passing its rows of the batch: loss, gradients and (``outputs(out)``: a per-sample output)
    agree on every rank at every step, with an SGD step after each. Returns the module."""
    world = mesh.size()
    ranks = frozenset(range(world))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), local_meta(batches[0], world), device_mesh=mesh,
                                              cost_model=cost, inputs="local", cache_dir=False, **keywords)
        opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    assert pmodel.plan.inputs == "local"
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_params = dict(ref.named_parameters())
    for step, batch in enumerate(batches):
        ref_opt.zero_grad()
        ref_out = ref(**batch)
        want = ref_out if isinstance(ref_out, torch.Tensor) else ref_out.loss
        want.backward()
        with LocalTensorMode(ranks):
            opt.zero_grad()
            out = pmodel(**per_rank_batch(batch, ranks))
            got = out if isinstance(out, torch.Tensor) else out.loss
            got.backward()
            assert_close(f"step {step} loss", got.detach(), want.detach())
            for name, p in pmodel.named_parameters():
                assert_close(f"step {step} grad of {name} {placements_of(p)}", whole(p.grad), ref_params[name].grad)
            if outputs is not None:
                value = outputs(out)
                assert_close(f"step {step} output", whole(value).detach(), outputs(ref_out).detach())
            opt.step()
        ref_opt.step()
    return pmodel


def _input_moves(plan, name):
    return {m.kind for c in plan.redistributions if c.src == name for m in c.moves}


def _mlp_batches(hidden, rows, steps=2):
    out = []
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        out.append({"x": torch.randn(rows, hidden, generator=g), "y": torch.randn(rows, hidden, generator=g)})
    return out


@pytest.mark.parametrize("mesh_shape", MESHES + [(1, 2)], ids=IDS + ["1x2"])
def test_data_parallel_mlp_each_rank_its_batch(mesh_shape, sim_mesh):
    """An MLP at a large batch: the plan keeps each rank's rows where they are (no collective
    on the inputs) and all-reduces the gradients, as DDP does. (An axis of one device holds
    the rows whole: Replicate there.)"""
    mesh = sim_mesh(mesh_shape)
    torch.manual_seed(0)
    pmodel = local_parity(MLP(hidden=64, layers=3), _mlp_batches(64, 128), mesh, autoparallel.CostModel("cpu"))
    plan = pmodel.plan
    split = tuple(Shard(0) if n > 1 else Replicate() for n in mesh_shape)
    assert tuple(plan.nodes["x"].output_specs[0]) == split
    assert not _input_moves(plan, "x"), "a data-parallel plan takes each rank's rows as they are"
    assert all(all(not p.is_shard() for p in s) for s in plan.param_placements.values())


@pytest.mark.parametrize("mesh_shape", MESHES, ids=IDS)
def test_tensor_parallel_mlp_gathers_the_batch(mesh_shape, sim_mesh):
    """A wide MLP at one sample per rank: weights split (Megatron-style), the batch all-gathered
    from the ranks (in rank order) before the first layer."""
    mesh = sim_mesh(mesh_shape)
    world = mesh.size()
    torch.manual_seed(0)
    pmodel = local_parity(MLP(hidden=1024, layers=2), _mlp_batches(1024, world), mesh,
                          autoparallel.CostModel("cpu"))
    plan = pmodel.plan
    assert "all_gather" in _input_moves(plan, "x"), plan.table()
    assert any(p.is_shard() for s in plan.param_placements.values() for p in s)


@pytest.mark.parametrize("hidden", [64, 1024], ids=["data", "tensor"])
def test_input_gradients_are_each_ranks_rows(hidden, sim_mesh):
    """An input that requires grad gets, on each rank, the single-device gradient of its rows,
    whether the plan keeps the batch split (data parallel) or gathers it (tensor parallel)."""
    mesh = sim_mesh((2,))
    ranks = frozenset(range(2))
    torch.manual_seed(0)
    ref = MLP(hidden=hidden, layers=2)
    batch = _mlp_batches(hidden, 2 if hidden > 64 else 16, steps=1)[0]
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), local_meta(batch, 2), device_mesh=mesh,
                                              cost_model=autoparallel.CostModel("cpu"), inputs="local",
                                              cache_dir=False)
    x = batch["x"].clone().requires_grad_()
    ref(x=x, y=batch["y"]).backward()
    with LocalTensorMode(ranks):
        mine = per_rank_batch(batch, ranks)
        mine["x"].requires_grad_()
        pmodel(**mine).backward()
        got = mine["x"].grad
    for r in ranks:
        torch.testing.assert_close(got._local_tensors[r], x.grad.chunk(2)[r], rtol=1e-4, atol=1e-5)


class _PerSample(torch.nn.Module):
    """Returns per-sample outputs with the loss: their order shows whether the module computed
    on the ranks' batches in rank order (a mean loss would not tell)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(32, 32)

    def forward(self, x, y):
        out = self.lin(x)
        return torch.nn.functional.mse_loss(out, y), out


@pytest.mark.parametrize("mesh_shape", MESHES, ids=IDS)
def test_per_sample_outputs_in_rank_order(mesh_shape, sim_mesh):
    mesh = sim_mesh(mesh_shape)
    world = mesh.size()
    torch.manual_seed(0)
    ref = _PerSample()
    batch = _mlp_batches(32, 8 * world, steps=1)[0]
    ranks = frozenset(range(world))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), local_meta(batch, world), device_mesh=mesh,
                                              cost_model=autoparallel.CostModel("cpu"), inputs="local",
                                              cache_dir=False)
        loss, out = pmodel(**per_rank_batch(batch, ranks))
        want_loss, want_out = ref(**batch)
        assert_close("loss", loss.detach(), want_loss.detach())
        assert isinstance(out, DTensor) and tuple(out.shape) == tuple(want_out.shape)
        assert_close("per-sample outputs", out.full_tensor().detach(), want_out.detach())


def test_gpt2_local_batches(sim_mesh):
    """A small Hugging Face GPT-2, each of 4 ranks (2 × 2) passing 2 sequences of the global 8:
    loss, gradients and the logits (returned as a DTensor) are the global batch's."""
    pytest.importorskip("transformers")
    mesh = sim_mesh((2, 2))
    ref = build("gpt2")
    batches = [batch_for("gpt2", s) for s in range(2)]
    local_parity(ref, batches, mesh, autoparallel.CostModel("cpu"), outputs=lambda o: o.logits)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)], ids=["2", "2x2"])
def test_gpt2_local_batches_tensor_parallel(mesh_shape, sim_mesh):
    """GPT-2 with gradient reduction made expensive (every weight split): the ranks' token ids
    are all-gathered for the embedding, the loss and gradients still the global batch's."""
    pytest.importorskip("transformers")
    mesh = sim_mesh(mesh_shape)
    ref = build("gpt2")
    batches = [batch_for("gpt2", s) for s in range(2)]
    pmodel = local_parity(ref, batches, mesh, ShardParams("cpu"), outputs=lambda o: o.logits)
    assert "all_gather" in _input_moves(pmodel.plan, "input_ids")
    assert all(any(p.is_shard() for p in s) for s in pmodel.plan.param_placements.values())


def test_eager_calls_with_grad_run_on_the_global_batch(sim_mesh):
    """A call with grad that runs the model's own forward (a submodule with a forward hook)
    gathers the ranks' batches: the loss, every gradient and each rank's input gradient are the
    single-device model's on the global batch."""
    ref, mesh, ranks = MLP(16), sim_mesh((2,)), frozenset(range(2))
    batch = _mlp_batches(16, 8, steps=1)[0]
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), local_meta(batch, 2), device_mesh=mesh,
                                              cost_model=ShardParams("cpu"), inputs="local", cache_dir=False)
    pmodel.layers[0].register_forward_hook(lambda m, i, o: None)
    x = batch["x"].clone().requires_grad_()
    want = ref(x, batch["y"])
    want.backward()
    with LocalTensorMode(ranks):
        local = per_rank_batch(batch, ranks)
        local["x"].requires_grad_()
        with pytest.warns(UserWarning, match="forward hook"):
            got = pmodel(**local)
        got.backward()
        assert_close("loss", got.detach(), want.detach())
        for name, p in pmodel.named_parameters():
            assert_close(f"grad of {name}", whole(p.grad), dict(ref.named_parameters())[name].grad)
        for r in ranks:
            assert_close(f"rank {r}'s input gradient", local["x"].grad._local_tensors[r], x.grad.chunk(2)[r])


def test_zero_dim_input_raises(sim_mesh):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x, scale):
            return (self.lin(x) * scale).sum()

    meta = {"x": torch.empty(4, 8, device="meta"), "scale": torch.empty((), device="meta")}
    with pytest.raises(ValueError, match="argument scale is a 0-d tensor"):
        autoparallel.plan(Scaled(), meta, mesh_shape=(2,), inputs="local", cache_dir=False)
    with pytest.raises(ValueError, match="positional argument \\[1\\] is a 0-d tensor"):
        autoparallel.plan(Scaled(), tuple(meta.values()), mesh_shape=(2,), inputs="local", cache_dir=False)
    mesh = sim_mesh((2,))
    with LocalTensorMode(frozenset(range(2))), pytest.raises(ValueError, match="argument scale is a 0-d tensor"):
        autoparallel.autoparallelize(Scaled(), meta, device_mesh=mesh, inputs="local", cache_dir=False)


def test_inputs_option_checked():
    with pytest.raises(ValueError, match="inputs must be 'global' or 'local'"):
        autoparallel.PlanOptions(inputs="per-rank")


def test_plan_json_round_trips_inputs():
    meta = {"x": torch.empty(16, 64, device="meta"), "y": torch.empty(16, 64, device="meta")}
    p = autoparallel.plan(MLP(hidden=64, layers=2), meta, mesh_shape=(2, 2), inputs="local", cache_dir=False)
    assert p.inputs == "local"
    assert tuple(p.nodes["x"].out_shapes[0]) == (64, 64)  # planned for the global batch: 4 ranks × 16 rows
    q = autoparallel.Plan.from_json(p.to_json())
    assert q.inputs == "local" and q == p
    import json

    old = json.loads(p.to_json())
    del old["inputs"]  # a plan saved before the field: the global batch
    assert autoparallel.Plan.from_json(json.dumps(old)).inputs == "global"
    old["inputs"] = "sideways"
    with pytest.raises(ValueError, match="inputs must be"):
        autoparallel.Plan.from_json(json.dumps(old))
    assert "each rank passes its own batch" in str(p)


def test_plan_validated_against_its_inputs(sim_mesh):
    """A plan for local inputs runs only as one (its placeholders are split), and the plan's own
    ``inputs`` applies when it is handed in."""
    from autoparallel.errors import PlanMismatchError
    from autoparallel.tracer import capture
    from autoparallel.validate import validate_plan

    meta = {"x": torch.empty(8, 64, device="meta"), "y": torch.empty(8, 64, device="meta")}
    model = MLP(hidden=64, layers=2)
    local = autoparallel.plan(model, meta, mesh_shape=(2,), inputs="local", cache_dir=False)
    glob = autoparallel.plan(model, {k: torch.empty(16, 64, device="meta") for k in meta}, mesh_shape=(2,),
                             cache_dir=False)
    traced = capture(model, {k: torch.empty(16, 64, device="meta") for k in meta})
    validate_plan(local, traced)
    validate_plan(glob, traced)
    swapped = autoparallel.Plan.from_json(local.to_json().replace('"inputs": "local"', '"inputs": "global"'))
    with pytest.raises(PlanMismatchError, match="node x"):
        validate_plan(swapped, traced)
    mesh, ranks, ref, batch = _small_mlp(sim_mesh)
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), meta, device_mesh=mesh, plan=local.to_json())
        got = pmodel(**per_rank_batch(batch, ranks))
    assert_close("loss", got, ref(**batch).detach())


def _small_mlp(sim_mesh):
    """A (2,) mesh, its ranks, a 2-layer MLP of width 64 and a global batch of 16 rows for it."""
    mesh = sim_mesh((2,))
    torch.manual_seed(0)
    return mesh, frozenset(range(2)), MLP(hidden=64, layers=2), _mlp_batches(64, 16, steps=1)[0]


def test_calls_checked_against_local_shapes_and_replanned(sim_mesh):
    """The module checks calls against one rank's shapes; with replan=True a smaller local batch
    (an epoch's last) is planned for its global batch, and is still exact."""
    mesh, ranks, ref, batch = _small_mlp(sim_mesh)
    with LocalTensorMode(ranks):
        strict = autoparallel.autoparallelize(copy.deepcopy(ref), local_meta(batch, 2), device_mesh=mesh,
                                              inputs="local", cache_dir=False, replan=False)
        with pytest.raises(autoparallel.InputMismatchError, match=r"shape \(8, 64\)"):
            strict(**batch)  # the global batch on a rank that should pass its 8 rows
        short = _mlp_batches(64, 6, steps=1)[0]
        with pytest.raises(autoparallel.InputMismatchError):
            strict(**per_rank_batch(short, ranks))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), local_meta(batch, 2), device_mesh=mesh,
                                              inputs="local", cache_dir=False, replan=True)
        got = pmodel(**per_rank_batch(short, ranks))
    assert_close("loss of the short batch", got, ref(**short).detach())


def test_mesh_out_of_rank_order_raises(sim_mesh):
    """On a 2 × 2 mesh listing its ranks column-major, rank 1 would hold the third quarter of
    the global batch: refused rather than computed on a permuted batch."""
    from torch.distributed.device_mesh import DeviceMesh

    sim_mesh((2, 2))
    mesh = DeviceMesh("cpu", [[0, 2], [1, 3]])
    meta = {"x": torch.empty(4, 64, device="meta"), "y": torch.empty(4, 64, device="meta")}
    with LocalTensorMode(frozenset(range(4))), pytest.raises(autoparallel.MeshMismatchError, match="rank order"):
        autoparallel.autoparallelize(MLP(hidden=64, layers=2), meta, device_mesh=mesh, inputs="local",
                                     cache_dir=False)


def _sampler_worker(rank: int, world: int) -> None:
    """One gloo rank: its batches from a DistributedSampler over a small dataset, as a DDP loop
    draws them; the reference trains on the ranks' batches concatenated in rank order."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 32, generator=g), torch.randn(32, 32, generator=g))

    def loader(r):
        return DataLoader(data, batch_size=4, sampler=DistributedSampler(data, num_replicas=world, rank=r,
                                                                         shuffle=False))

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = _PerSample()
    meta = {"x": torch.empty(4, 32, device="meta"), "y": torch.empty(4, 32, device="meta")}
    pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), meta, device_mesh=mesh, inputs="local",
                                          cost_model=autoparallel.CostModel("cpu"), cache_dir=False)
    opt = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref_params = dict(ref.named_parameters())
    everyone = list(zip(*[loader(r) for r in range(world)]))  # each step: every rank's batch
    for step, (x, y) in enumerate(loader(rank)):
        xs, ys = zip(*everyone[step])
        ref_opt.zero_grad()
        want, want_out = ref(torch.cat(xs), torch.cat(ys))
        want.backward()
        opt.zero_grad()
        got, out = pmodel(x=x, y=y)
        got.backward()
        torch.testing.assert_close(got.detach(), want.detach(), rtol=1e-4, atol=1e-5)
        full = out.full_tensor() if isinstance(out, DTensor) else out
        torch.testing.assert_close(full.detach(), want_out.detach(), rtol=1e-4, atol=1e-5)
        for name, p in pmodel.named_parameters():
            torch.testing.assert_close(whole(p.grad), ref_params[name].grad, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {rank} step {step} grad of {name}: {m}")
        opt.step()
        ref_opt.step()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_distributed_sampler_2_gloo_ranks():
    from gloo_ranks import spawn

    spawn(_sampler_worker, 2, 2, timeout_s=60)
