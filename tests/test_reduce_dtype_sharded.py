"""Parameters kept sharded under a mixed-precision policy: gathered in ``param_dtype``, their
gradients reduce-scattered in ``reduce_dtype`` (runtime_kernels.param_all_gather; docs/design.md,
"Sharded parameters' gradients in reduce_dtype")."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.fsdp import MixedPrecisionPolicy

import autoparallel
from autoparallel.runtime_kernels import param_all_gather
from models import CheapComm, batch_for, build_model, placements_of, to_meta, whole
from test_mixed_precision import GRAD_TOL, LOSS_TOL, _ranks, _rel_err, reference_loss

F32_REDUCE = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BF16_REDUCE = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


# ---------------------------------------------------------------- the kernel alone
def test_kernel_gathers_in_bf16_and_reduce_scatters_in_fp32(sim_mesh):
    """Two gathers on a (2, 2) mesh, one along dim 1 and one along an uneven dim 0 (5 rows:
    3 + 2): the forward is the whole tensor in bf16 on every rank, the backward each rank's
    shard of the fp32 sum of every rank's gradient (no bf16 rounding), the pads without one."""
    mesh = sim_mesh((2, 2))
    g0, g1 = mesh.get_group(0).group_name, mesh.get_group(1).group_name
    torch.manual_seed(0)
    full = torch.randn(5, 10)
    rows, cols = (slice(0, 3), slice(3, 5)), (slice(0, 5), slice(5, 10))
    shard = {2 * i + j: full[rows[i], cols[j]].clone() for i in range(2) for j in range(2)}
    grads = {r: (torch.randn(5, 10) * (1000 if r == 0 else 1)).bfloat16() for r in range(4)}
    steps = [(g1, 2, 1, 5, 10), (g0, 2, 0, 3, 5)]
    with LocalTensorMode(frozenset(range(4))) as mode:
        with mode.disable():
            x = LocalTensor(shard).requires_grad_()
            seed = LocalTensor(grads)
        y = param_all_gather(x, steps, dtype=torch.bfloat16, reduce_dtype=torch.float32)
        y.backward(seed)
    for r in range(4):
        assert torch.equal(y._local_tensors[r], full.bfloat16())
    total = sum(g.double() for g in grads.values())
    for i in range(2):
        for j in range(2):
            got = x.grad._local_tensors[2 * i + j]
            assert got.dtype == torch.float32 and got.shape == shard[2 * i + j].shape
            torch.testing.assert_close(got.double(), total[rows[i], cols[j]], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- a case bf16 reduction gets wrong
class Probe(nn.Module):
    """``(linear(x) * t).sum()``: the weight's gradient is ``tᵀ x``, exact small integers and
    halves in this test's batch, so every rank's partial gradient is exact in bf16 and only the
    reduction across ranks can round."""

    def __init__(self, out_features=64):
        super().__init__()
        self.linear = nn.Linear(64, out_features, bias=False)

    def forward(self, x, t):
        return (self.linear(x) * t).sum()


def probe_batch(out_features, ranks):
    """Two rows per rank; the first rank's give a partial gradient of 1000 per element, every
    other rank's 1: the sum is 1000 + (ranks - 1), which bf16 (8 significant bits, a step of 4
    between 512 and 1024) cannot hold, and to which a bf16 sum adds each 1 in vain."""
    x = torch.ones(2 * ranks, 64)
    t = torch.full((2 * ranks, out_features), 0.5)
    t[:2] = 500.0
    return {"x": x, "t": t}


def probe_plan(stored="S0"):
    """The batch split (each rank's gradient a partial sum), the weight stored as ``stored``
    and gathered for use."""
    return {"x": "S0", "t": "S0", "linear": "S0", "linear.weight": f"{stored} -> R"}


def probe_gradient(policy, mesh, out_features):
    """The weight gradient of :class:`Probe` planned as :func:`probe_plan` on simulated
    ranks, and the emitted code."""
    torch.manual_seed(0)
    model = Probe(out_features)
    inputs = probe_batch(out_features, mesh.size())
    with LocalTensorMode(frozenset(range(mesh.size()))):
        pmodel = autoparallel.autoparallelize(model, to_meta(inputs), device_mesh=mesh, constraints=probe_plan(),
                                              mp_policy=policy, cache_dir=False)
        pmodel(**inputs).backward()
        grads = _ranks(whole(pmodel.linear.weight.grad))
    return grads, pmodel.graph_module.code


@pytest.mark.parametrize("out_features", [64, 66])  # 66 rows on 4 devices: 17, 17, 16, 16 (padded gather)
def test_fp32_reduction_keeps_the_bits_bf16_loses(sim_mesh, out_features):
    mesh = sim_mesh((4,))
    inputs = probe_batch(out_features, 4)
    exact = (inputs["t"].double().T @ inputs["x"].double())  # 1003 everywhere
    fp32, code = probe_gradient(F32_REDUCE, mesh, out_features)
    assert "param_all_gather(" in code and "reduce_dtype = torch.float32" in code, code
    bf16, code16 = probe_gradient(BF16_REDUCE, mesh, out_features)
    assert "param_all_gather" not in code16  # gathered and reduce-scattered in bf16 by autograd, as before
    err32 = max(_rel_err(g.double(), exact) for g in fp32)
    err16 = max(_rel_err(g.double(), exact) for g in bf16)
    assert err16 > 1e-3, err16  # the premise: a bf16 reduce-scatter rounds this sum away
    assert err32 < 1e-6 < err16, (err32, err16)


# ---------------------------------------------------------------- GPT-2 parity
@pytest.mark.slow
def test_gpt2_fsdp_parity_with_fp32_reduce_scatter(sim_mesh):
    """GPT-2 with every weight sharded on (2, 2) and gathered for use (gathers along dims 0 and
    1, two per weight): loss and every gradient within bf16 tolerance of one device under the
    same policy."""
    pytest.importorskip("transformers")
    mesh = sim_mesh((2, 2))
    ranks = frozenset(range(4))
    ref = build_model("gpt2")
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(batch_for("gpt2", 0)), device_mesh=mesh,
                                              cost_model=CheapComm("cpu"), parallelism="fsdp", mp_policy=F32_REDUCE,
                                              cache_dir=False)
    code = pmodel.graph_module.code
    assert code.count("param_all_gather(") >= 20 and "reduce_dtype = torch.float32" in code
    inputs = batch_for("gpt2", 0)
    want = reference_loss(ref, inputs, F32_REDUCE)
    want.backward()
    ref_params = dict(ref.named_parameters())
    with LocalTensorMode(ranks):
        got = pmodel(**inputs).loss
        got.backward()
        for v in _ranks(got.detach()):
            assert _rel_err(v, want.detach()) < LOSS_TOL, (float(v), float(want))
        for name, p in pmodel.named_parameters():
            assert p.grad.dtype == torch.float32, name
            for g in _ranks(whole(p.grad)):
                err = _rel_err(g, ref_params[name].grad)
                assert err < GRAD_TOL, f"grad of {name} {placements_of(p)}: relative error {err:.3g}"


# ---------------------------------------------------------------- pricing
@pytest.mark.parametrize("policy, grad_bytes", [(F32_REDUCE, 4), (BF16_REDUCE, 2)])
def test_gather_backward_priced_in_reduce_dtype_bytes(policy, grad_bytes):
    """The redistribution of a bf16 weight gathered on (4,) costs an all-gather of 2 bytes per
    element and a reduce-scatter of 4 (fp32 reduce) or 2 (bf16) bytes per element."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    p = autoparallel.plan(model, (torch.empty(64, 256, device="meta"),), mesh_shape=4, parallelism="fsdp",
                          mp_policy=policy, cache_dir=False)
    cm = autoparallel.CostModel("cpu").bind(p.mesh)
    gathers = [r for r in p.redistributions if r.src.endswith("_bf16")]
    assert len(gathers) == 4  # two weights, two biases
    for r in gathers:
        (m,) = r.moves
        numel = torch.Size(r.shape).numel()
        assert m.kind == "all_gather" and m.nbytes == 2 * numel
        want = cm.collective_time("all_gather", 0, m.nbytes) + cm.collective_time("reduce_scatter", 0,
                                                                                  grad_bytes * numel)
        assert r.cost_s == pytest.approx(want, rel=1e-12), r.src


# ---------------------------------------------------------------- real processes
def _gloo_rank(rank):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    for out_features, stored in [(65, "S0"), (64, "S1")]:  # 65 rows: 33 and 32 (padded); 64 columns: a dim-1 gather
        inputs = probe_batch(out_features, 2)
        torch.manual_seed(0)
        pmodel = autoparallel.autoparallelize(Probe(out_features), to_meta(inputs), device_mesh=mesh,
                                              constraints=probe_plan(stored), mp_policy=F32_REDUCE, cache_dir=False)
        assert "param_all_gather(" in pmodel.graph_module.code
        pmodel(**inputs).backward()
        exact = inputs["t"].double().T @ inputs["x"].double()  # 1001 everywhere: bf16 holds 1000 or 1002
        got = whole(pmodel.linear.weight.grad)
        assert got.dtype == torch.float32 and torch.equal(got.double(), exact), (rank, stored, got)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fp32_reduce_scatter_on_gloo_ranks():
    """Two real gloo processes: an uneven dim-0 gather and a dim-1 gather, both exact."""
    from gloo_ranks import spawn

    spawn(_gloo_rank, 2)
