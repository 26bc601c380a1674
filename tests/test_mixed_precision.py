"""Mixed precision (torch's FSDP2 MixedPrecisionPolicy): capture, pricing, plan records and
parity with one device under the same policy (docs/design.md, "Mixed precision")."""

import copy
import json

import pytest
import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard

import autoparallel
from autoparallel import precision
from autoparallel.tracer import ColoTracer
from models import CheapComm, batch_for, build_model, placements_of, to_meta, whole

aten = torch.ops.aten
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16_REDUCE = MixedPrecisionPolicy(param_dtype=torch.bfloat16)  # gradients reduced in bf16 too (FSDP2's default)


def _mlp(width=64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))


# ---------------------------------------------------------------- the policy
@pytest.mark.parametrize("bad, error, match", [
    ("bf16", TypeError, "MixedPrecisionPolicy or None"),
    (MixedPrecisionPolicy(param_dtype=torch.int8), ValueError, "param_dtype must be one of"),
    (MixedPrecisionPolicy(reduce_dtype=torch.float32), ValueError, "reduce_dtype needs a param_dtype"),
])
def test_bad_policies_are_refused(bad, error, match):
    with pytest.raises(error, match=match):
        precision.check_policy(bad)
    with pytest.raises(error, match=match):
        autoparallel.plan(_mlp(), (torch.empty(8, 64, device="meta"),), mesh_shape=2, mp_policy=bad, cache_dir=False)


def test_policy_json_and_reduce_dtype():
    assert precision.check_policy(None) is None
    assert precision.check_policy(MixedPrecisionPolicy()) is None  # changes nothing
    for pol in (BF16, BF16_REDUCE, MixedPrecisionPolicy(torch.float16, None, torch.float32, False)):
        d = precision.policy_to_json(pol)
        assert precision.policy_from_json(json.loads(json.dumps(d))) == pol
    assert precision.reduce_dtype(BF16) == torch.float32
    assert precision.reduce_dtype(BF16_REDUCE) == torch.bfloat16  # FSDP2: None means the compute dtype
    assert precision.reduce_dtype(None) is None
    with pytest.raises(ValueError, match="not one of"):
        precision.policy_from_json({"param_dtype": "bf16", "reduce_dtype": None, "output_dtype": None,
                                    "cast_forward_inputs": True})


# ---------------------------------------------------------------- capture
def test_capture_keeps_fp32_master_and_casts_before_use():
    model = _mlp()
    pol = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    traced = ColoTracer(mp_policy=pol).trace(model, (torch.empty(8, 64, device="meta"),))
    nodes = list(traced.gm.graph.nodes)
    params = [n for n in nodes if n.op == "get_attr"]
    assert params and all(n.meta["val"].dtype == torch.float32 for n in params)
    assert all(traced.gm.get_parameter(n.target).dtype == torch.float32 for n in params)
    for p in params:  # read only through one cast to bf16, placed right before its first user
        (cast,) = p.users
        assert cast.target == aten._to_copy.default and cast.kwargs == {"dtype": torch.bfloat16}
        after = cast.next
        while after.target == aten._to_copy.default:  # the other casts of the same user
            after = after.next
        assert cast.name == f"{p.name}_bf16" and after.target == aten.linear.default and after in cast.users
    linears = [n for n in nodes if n.target == aten.linear.default]
    assert len(linears) == 2 and all(n.meta["autoparallel"].dtype == torch.bfloat16 for n in linears)
    assert traced.input_meta == [((8, 64), torch.float32)]  # the caller's dtype; cast in the graph
    (x,) = [n for n in nodes if n.op == "placeholder"]
    assert x.meta["val"].dtype == torch.float32 and next(iter(x.users)).kwargs == {"dtype": torch.bfloat16}
    (out,) = traced.gm.graph.output_node().args[0]
    assert out.target == aten._to_copy.default and out.meta["autoparallel"].dtype == torch.float32
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())  # untouched


# ---------------------------------------------------------------- pricing
def _linear_compute(plan):
    """Roofline seconds of each linear under the a100 preset: less its three calls' overhead
    (forward and two backward products), which does not scale with the dtype's rates."""
    calls = 3 * autoparallel.CostModel("a100").device.op_overhead
    return [n.compute_s - calls for n in plan.nodes.values() if n.op == "linear.default"]


def test_half_precision_is_priced_at_half_precision_rates():
    """The a100 preset's dense bf16 rate is twice its TF32 rate and bf16 moves half the bytes:
    a linear costs half under the policy, the same as in a model already in bf16 (no policy)."""
    meta = (torch.empty(4096, 1024, device="meta"),)
    kw = dict(mesh_shape=2, parallelism="data", cache_dir=False, cost_model=autoparallel.CostModel("a100"))
    fp32 = autoparallel.plan(_mlp(1024), meta, **kw)
    mixed = autoparallel.plan(_mlp(1024), meta, mp_policy=BF16, **kw)
    bf16_model = autoparallel.plan(_mlp(1024).to(torch.bfloat16), (torch.empty(4096, 1024, device="meta",
                                                                                dtype=torch.bfloat16),), **kw)
    for a, b, c in zip(_linear_compute(fp32), _linear_compute(mixed), _linear_compute(bf16_model)):
        assert a == pytest.approx(2 * b) and b == pytest.approx(c)
    mem = {name: p.estimate.memory.breakdown for name, p in
           (("fp32", fp32), ("mixed", mixed), ("bf16", bf16_model))}
    n_params = sum(p.numel() for p in _mlp(1024).parameters())
    # fp32 master parameters and two AdamW states (held the whole step, so at the peak too);
    # the all-bf16 model holds them in bf16
    for kind, copies in (("parameters", 1), ("optimizer", 2)):
        assert getattr(mem["mixed"], kind) == getattr(mem["fp32"], kind) == copies * 4 * n_params, kind
        assert getattr(mem["bf16"], kind) == copies * 2 * n_params, kind
    assert mem["mixed"].activations < mem["fp32"].activations


def test_gradients_are_priced_and_reduced_in_reduce_dtype():
    meta = (torch.empty(64, 1024, device="meta"),)
    kw = dict(mesh_shape=2, parallelism="data", cache_dir=False)
    comm = {pol: sum(n.comm_s for n in autoparallel.plan(_mlp(1024), meta, mp_policy=pol, **kw).nodes.values()
                     if n.op == "get_attr") for pol in (None, BF16, BF16_REDUCE)}
    assert comm[BF16] == pytest.approx(comm[None]) and comm[BF16_REDUCE] == pytest.approx(comm[None] / 2)


def test_cast_runs_on_the_shard_before_the_all_gather():
    """A parameter kept sharded and gathered for use is cast first: the all-gather moves
    bf16 bytes (half the fp32 ones)."""
    # weights pinned sharded (ZeRO-3 storage); a large batch makes gathering them cheaper
    # than splitting the activations
    p = autoparallel.plan(_mlp(256), (torch.empty(8192, 256, device="meta"),), mesh_shape=4, mp_policy=BF16,
                          constraints={"*weight": "S0"}, cache_dir=False)
    casts = [n for n in p.nodes.values() if n.op == "_to_copy.default" and n.name.endswith("_weight_bf16")]
    assert casts
    gathered = 0
    for c in casts:
        param = c.name.removesuffix("_bf16")
        assert c.input_specs == c.output_specs == p.nodes[param].output_specs  # on the parameter's shard
        for r in p.redistributions:
            if r.src == c.name:
                for m in r.moves:
                    if m.kind == "all_gather":
                        assert m.nbytes == 2 * torch.Size(c.out_shapes[0]).numel()  # bf16 bytes
                        gathered += 1
    assert gathered, "the plan should keep a weight sharded and gather it"


def test_fsdp_recipe_gathers_half_precision_weights():
    """parallelism="fsdp" under a policy: every weight stored sharded in fp32, cast on its shard,
    all-gathered in bf16 (as FSDP2 does), not gathered in fp32 and cast after."""
    p = autoparallel.plan(_mlp(256), (torch.empty(64, 256, device="meta"),), mesh_shape=4, parallelism="fsdp",
                          mp_policy=BF16, cache_dir=False)
    gathers = [(r.src, m.nbytes, r.shape) for r in p.redistributions for m in r.moves if m.kind == "all_gather"]
    assert len(gathers) == 4  # two weights, two biases
    for src, nbytes, shape in gathers:
        assert src.endswith("_bf16") and nbytes == 2 * torch.Size(shape).numel(), (src, nbytes, shape)
    assert all(isinstance(spec[0], Shard) for spec in p.param_placements.values())  # which dim: a tie


# ---------------------------------------------------------------- plan records
def test_plan_records_the_policy(tmp_path):
    meta = (torch.empty(8, 64, device="meta"),)
    p = autoparallel.plan(_mlp(), meta, mesh_shape=2, mp_policy=BF16, cache_dir=tmp_path)
    assert p.mp_policy == BF16 and p.solver_stats.cache == "miss"
    assert "compute in bfloat16" in p.table() and "gradients reduced in float32" in p.table()
    again = autoparallel.Plan.from_json(p.to_json())
    assert again == p and again.mp_policy == BF16
    assert json.loads(p.to_json())["mp_policy"]["param_dtype"] == "bfloat16"
    # the policy is part of the cache key: each policy is solved once, then loaded
    hit = autoparallel.plan(_mlp(), meta, mesh_shape=2, mp_policy=BF16, cache_dir=tmp_path)
    assert hit.solver_stats.cache == "hit" and hit.mp_policy == BF16
    other = autoparallel.plan(_mlp(), meta, mesh_shape=2, mp_policy=BF16_REDUCE, cache_dir=tmp_path)
    assert other.solver_stats.cache == "miss" and other.mp_policy == BF16_REDUCE
    plain = autoparallel.plan(_mlp(), meta, mesh_shape=2, cache_dir=tmp_path)
    assert plain.mp_policy is None and json.loads(plain.to_json())["mp_policy"] is None
    old = json.loads(plain.to_json())
    del old["mp_policy"]  # plans saved before the field
    assert autoparallel.Plan.from_json(json.dumps(old)).mp_policy is None


# ---------------------------------------------------------------- parity
def _ranks(t):
    return list(t._local_tensors.values()) if isinstance(t, LocalTensor) else [t]


def _rel_err(got, want):
    return float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))


def reference_loss(model, inputs, policy):
    """The single-device step under ``policy``: the fp32 master copy, the forward with every
    floating parameter cast to ``param_dtype`` (a differentiable ``.to``, so gradients arrive
    in fp32 in the master's ``.grad``) and floating inputs cast as the policy says."""
    params = {n: p.to(policy.param_dtype) if p.is_floating_point() else p for n, p in model.named_parameters()}
    cast = {k: v.to(policy.param_dtype) if v.is_floating_point() and policy.cast_forward_inputs else v
            for k, v in inputs.items()}
    out = torch.func.functional_call(model, params, (), cast)
    return out if isinstance(out, torch.Tensor) else out.loss


LOSS_TOL = 1e-2  # relative; bf16 carries 8 significant bits (relative rounding 2^-8 = 0.4 %)
GRAD_TOL = 5e-2  # relative Frobenius norm, per gradient: sharded sums round in other orders


def run_mixed_parity(name, mesh_shape, policy, sim_mesh, steps=2):
    mesh = sim_mesh(mesh_shape)
    ref = build_model(name)
    model = copy.deepcopy(ref)
    ranks = frozenset(range(mesh.size()))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, to_meta(batch_for(name, 0)), device_mesh=mesh,
                                              cost_model=CheapComm("cpu"), mp_policy=policy)
        opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    assert pmodel.plan.mp_policy == policy and pmodel.plan.collectives
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_params = dict(ref.named_parameters())
    for step in range(steps):
        inputs = batch_for(name, step)
        ref_opt.zero_grad()
        want = reference_loss(ref, inputs, policy)
        want.backward()
        with LocalTensorMode(ranks):
            opt.zero_grad()
            out = pmodel(**inputs)
            got = out if isinstance(out, torch.Tensor) else out.loss
            got.backward()
            for v in _ranks(got.detach()):
                assert _rel_err(v, want.detach()) < LOSS_TOL, (step, float(v), float(want))
            for pname, p in pmodel.named_parameters():
                assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, pname  # master weights
                for g in _ranks(whole(p.grad)):
                    err = _rel_err(g, ref_params[pname].grad)
                    assert err < GRAD_TOL, f"step {step} grad of {pname} {placements_of(p)}: relative error {err:.3g}"
            opt.step()
        ref_opt.step()
    with LocalTensorMode(ranks):
        states = [t for s in opt.state.values() for t in s.values() if t.ndim]
        assert states and all(t.dtype == torch.float32 for t in states)  # optimizer states in fp32
    return pmodel


@pytest.mark.parametrize("mesh_shape", [(2,), pytest.param((2, 2), marks=pytest.mark.slow)])
def test_mlp_parity_under_bf16_policy(sim_mesh, mesh_shape):
    pmodel = run_mixed_parity("mlp", mesh_shape, BF16_REDUCE, sim_mesh, steps=1 if mesh_shape == (2,) else 2)
    if mesh_shape == (2, 2):  # (the slow tier) another mode, captured again under the same policy
        with LocalTensorMode(frozenset(range(pmodel.device_mesh.size()))), torch.no_grad():
            pmodel.eval()
            pmodel(**batch_for("mlp", 5))
            assert {p.mp_policy for p in pmodel.plans.values()} == {BF16_REDUCE} and len(pmodel.plans) == 2
            assert all("dtype = torch.bfloat16" in gm.code for gm in pmodel.graph_modules.values())
    code = pmodel.graph_module.code
    assert "dtype = torch.bfloat16" in code
    if "reduce_grads_in_bucket" in code:  # replicated parameters: their buckets are reduced in bf16
        assert "reduce_dtype = torch.bfloat16" in code


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_gpt2_parity_under_bf16_policy(sim_mesh, mesh_shape):
    pytest.importorskip("transformers")
    pmodel = run_mixed_parity("gpt2", mesh_shape, BF16, sim_mesh)
    # fp32 reduction: buckets in the gradients' own dtype, sharded weights reduce-scattered in fp32
    assert "reduce_dtype = torch.bfloat16" not in pmodel.graph_module.code


# ---------------------------------------------------------------- torch.autocast
class _InnerAutocast(nn.Module):
    """An autocast block inside the forward, with a block inside it that turns autocast off."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.a(x)
            with torch.autocast("cpu", enabled=False):
                z = self.b(y.float())
        return (y.float() + z).sum()


def test_autocast_casts_are_graph_nodes():
    ambient = ColoTracer(autocast=("cpu", torch.bfloat16)).trace(_mlp(), (torch.empty(8, 64, device="meta"),))
    linears = [n for n in ambient.gm.graph.nodes if n.target == aten.linear.default]
    for lin in linears:  # every input of a linear cast to bf16 by a node of its own
        assert lin.meta["autoparallel"].dtype == torch.bfloat16
        for x in lin.all_input_nodes:
            assert x.meta["autoparallel"].dtype == torch.bfloat16, x
        assert any(x.target == aten._to_copy.default for x in lin.all_input_nodes)
    params = [n for n in ambient.gm.graph.nodes if n.op == "get_attr"]
    assert all(n.meta["autoparallel"].dtype == torch.float32 for n in params)  # autocast keeps fp32 weights
    inner = ColoTracer().trace(_InnerAutocast(), (torch.empty(8, 64, device="meta"),))
    assert torch.ops.higher_order.wrap_with_autocast not in [n.target for n in inner.gm.graph.nodes]
    a, b = [n for n in inner.gm.graph.nodes if n.target == aten.linear.default]
    assert a.meta["autoparallel"].dtype == torch.bfloat16 and b.meta["autoparallel"].dtype == torch.float32
    assert all(x.target == aten._to_copy.default for x in a.all_input_nodes)
    assert not any(x.target == aten._to_copy.default for x in b.all_input_nodes)  # autocast off in there


def test_autocast_at_planning_is_priced_in_half_precision():
    meta = (torch.empty(4096, 1024, device="meta"),)
    kw = dict(mesh_shape=2, parallelism="data", cache_dir=False, cost_model=autoparallel.CostModel("a100"))
    fp32 = autoparallel.plan(_mlp(1024), meta, **kw)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = autoparallel.plan(_mlp(1024), meta, **kw)
    assert autocast.mp_policy is None
    for a, b in zip(_linear_compute(fp32), _linear_compute(autocast)):
        assert a == pytest.approx(2 * b)


def run_autocast_parity(name, mesh_shape, sim_mesh):
    """The module planned under ``torch.autocast`` (bf16, CPU) against the model run under it."""
    mesh = sim_mesh(mesh_shape)
    ref = build_model(name)
    model = copy.deepcopy(ref)
    ranks = frozenset(range(mesh.size()))
    with LocalTensorMode(ranks), torch.autocast("cpu", dtype=torch.bfloat16):
        pmodel = autoparallel.autoparallelize(model, to_meta(batch_for(name, 0)), device_mesh=mesh,
                                              cost_model=CheapComm("cpu"))
    assert any(n.op == "_to_copy.default" for n in pmodel.plan.nodes.values()) and pmodel.plan.collectives
    inputs = batch_for(name, 0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ref(**inputs)
    want = out if isinstance(out, torch.Tensor) else out.loss
    want.backward()
    with LocalTensorMode(ranks), torch.autocast("cpu", dtype=torch.bfloat16):
        out = pmodel(**inputs)
        got = out if isinstance(out, torch.Tensor) else out.loss
        got.backward()
        for v in _ranks(got.detach()):
            assert _rel_err(v, want.detach()) < LOSS_TOL
        ref_params = dict(ref.named_parameters())
        for pname, p in pmodel.named_parameters():
            for g in _ranks(whole(p.grad)):
                assert _rel_err(g, ref_params[pname].grad) < GRAD_TOL, pname


def test_mlp_parity_under_autocast(sim_mesh):
    run_autocast_parity("mlp", (2,), sim_mesh)


@pytest.mark.slow
def test_gpt2_parity_under_autocast(sim_mesh):
    pytest.importorskip("transformers")
    run_autocast_parity("gpt2", (2, 2), sim_mesh)


# ---------------------------------------------------------------- real processes
def _gloo_rank(rank, world, policy):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    ref = build_model("gpt2")
    pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(batch_for("gpt2", 0)), device_mesh=mesh,
                                          cost_model=autoparallel.CostModel("cpu"), parallelism="data",
                                          mp_policy=policy, cache_dir=False)
    assert "reduce_dtype = torch.bfloat16" in pmodel.graph_module.code  # bf16 buckets through gloo
    inputs = batch_for("gpt2", 0)
    want = reference_loss(ref, inputs, policy)
    want.backward()
    got = pmodel(**inputs).loss
    got.backward()
    assert _rel_err(got.detach(), want.detach()) < LOSS_TOL
    ref_params = dict(ref.named_parameters())
    for name, p in pmodel.named_parameters():
        assert p.grad.dtype == torch.float32
        err = _rel_err(whole(p.grad), ref_params[name].grad)
        assert err < GRAD_TOL, f"rank {rank}: grad of {name} {placements_of(p)}: relative error {err:.3g}"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_gpt2_bf16_policy_on_gloo_ranks():
    """Two real gloo processes, data parallel: the gradient buckets all-reduced in bf16 through
    c10d, parity as above."""
    pytest.importorskip("transformers")
    from gloo_ranks import spawn

    spawn(_gloo_rank, 2, 2, BF16_REDUCE)
