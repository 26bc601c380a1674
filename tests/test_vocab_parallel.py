"""Vocab-parallel embedding and cross-entropy (Megatron-LM, Shoeybi et al. 2019, §3).

Every strategy of these samples, the class-split (vocab-parallel) ones among them, is run on
simulated ranks against the dense op, loss and gradients (tests/test_rules.py's check), with
classes that a (4,) mesh divides; the torch and triton local kernels are compared with
torch's cross-entropy directly; a GPT-2 plans vocab-parallel when communication matters
and trains as on one device.
"""

import pytest
import torch
import torch.nn.functional as F

import autoparallel
from models import without_dtensor_overhead
from test_rules import _check_all_strategies, _int

# the cpu preset, DTensor's dispatch in the optimizer step left out: on these 2-layer models it
# alone would decide between replicated storage and a vocabulary split
CPU = autoparallel.CostModel(without_dtensor_overhead("cpu"))

VOCAB_SAMPLES = {
    "vp_cross_entropy_reductions": (
        lambda x, t: (F.cross_entropy(x, t), F.cross_entropy(x, t, reduction="sum"),
                      F.cross_entropy(x, t, reduction="none")),
        [(8, 16), _int(16, 8)]),
    "vp_cross_entropy_ignore_weight_smoothing": (
        lambda x, t, w: (F.cross_entropy(x, t.masked_fill(t > 10, -100), weight=w.detach().abs() + 0.5,
                                         label_smoothing=0.1),
                         F.cross_entropy(x, t, ignore_index=3, reduction="sum", label_smoothing=0.2),
                         F.cross_entropy(x, t.masked_fill(t < 4, 7), weight=w.detach().abs() + 0.5,
                                         ignore_index=7, reduction="none", label_smoothing=0.3),
                         F.cross_entropy(x, t, weight=w.detach().abs() + 0.5)),
        [(8, 16), _int(16, 8), (16,)]),
    # classes in dim 1 of a 3-D input (N, C, d1)
    "vp_cross_entropy_spatial": (
        lambda x, t: (F.cross_entropy(x, t, label_smoothing=0.1), F.cross_entropy(x, t, reduction="none")),
        [(4, 8, 4), _int(8, 4, 4)]),
    # the log_softmax + nll_loss pattern, each op with its classes split
    "vp_log_softmax_nll_loss": (
        lambda x, t, w: (F.nll_loss(F.log_softmax(x, 1), t),
                         F.nll_loss(F.log_softmax(x, -1), t.masked_fill(t > 10, -100), weight=w.detach().abs() + 0.5),
                         F.nll_loss(x.log_softmax(1), t, weight=w.detach().abs() + 0.5, ignore_index=3,
                                    reduction="none"),
                         F.nll_loss(torch.log_softmax(x, 1, dtype=torch.float64), t, reduction="sum"),
                         F.softmax(x, 1)),
        [(8, 16), _int(16, 8), (16,)]),
    # 18 classes and 7 rows, which no axis of (4,) or (2, 2) divides: torch.chunk pieces (5, 5, 5, 3)
    "vp_uneven_cross_entropy": (
        lambda x, t, w: (F.cross_entropy(x, t.masked_fill(t > 14, -100), weight=w.detach().abs() + 0.5,
                                         label_smoothing=0.1),
                         F.cross_entropy(x, t, label_smoothing=0.2, reduction="sum"),
                         F.cross_entropy(x, t, ignore_index=3, reduction="none")),
        [(7, 18), _int(18, 7), (18,)]),
    "vp_uneven_log_softmax_nll_loss": (
        lambda x, t, w: (F.nll_loss(F.log_softmax(x, 1), t),
                         F.nll_loss(x.log_softmax(-1), t, weight=w.detach().abs() + 0.5, ignore_index=3,
                                    reduction="sum")),
        [(7, 18), _int(18, 7), (18,)]),
    "vp_embedding": (lambda w, i: (F.embedding(i, w), F.embedding(i, w, padding_idx=5) * 2),
                     [(32, 16), _int(32, 4, 8)]),
}


# on (2, 2) (classes split over both axes, or with the batch): 5-12 s each, the full tier; the
# fast tier has (2, 2) class splits in tests/test_rules.py (embedding, cross_entropy_ignore)
@pytest.mark.parametrize("name,mesh_shape",
                         [(n, (4,)) for n in sorted(VOCAB_SAMPLES)]
                         + [pytest.param(n, (2, 2), marks=pytest.mark.slow) for n in sorted(VOCAB_SAMPLES)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_every_vocab_parallel_strategy_matches_the_dense_op(name, mesh_shape, sim_mesh):
    _check_all_strategies(name, mesh_shape, sim_mesh, set(), samples=VOCAB_SAMPLES)


# ---------------------------------------------------------------- the local kernels
CASES = {  # (rows, classes, pieces, weight, ignore_index, label_smoothing, dtype)
    "plain": (6, 16, 4, False, -100, 0.0, torch.float32),
    "weight_ignore_smoothing": (7, 12, 3, True, 5, 0.2, torch.float32),
    "smoothing_no_weight": (5, 20, 2, False, -100, 0.1, torch.float32),
    "one_piece_weight": (4, 9, 1, True, -100, 0.0, torch.float32),
    "bf16_logits": (6, 16, 4, True, 2, 0.1, torch.bfloat16),
    "long_rows": (3, 2 * 4096 + 40, 2, True, -100, 0.1, torch.float32),  # several blocks per row
    "uneven_pieces_weight": (5, 18, 4, True, 3, 0.1, torch.float32),  # torch.chunk: 5, 5, 5, 3 classes
    "uneven_pieces_smoothing": (5, 18, 4, False, -100, 0.2, torch.float32),
}


def check_kernels(impl: str, case: str) -> None:
    """The classes cut into ``pieces``, each handled as one device would (statistics, then the
    global log-sum-exp combined as the all-reduces do, then the loss share and the gradient):
    the shares sum to ``F.cross_entropy(reduction='none')`` and the gradients, side by side,
    equal autograd's. ``impl``: "torch" (the torch code) or "triton" (the kernels; on CPU
    only under ``TRITON_INTERPRET=1`` set before triton is imported)."""
    from autoparallel.runtime_kernels import cross_entropy as ce

    if impl == "torch":
        stats, loss_fn, grad_fn = ce.torch_logsumexp_stats, ce.torch_loss, ce.torch_grad
    else:
        from autoparallel.runtime_kernels import cross_entropy_triton as tri
        stats, loss_fn, grad_fn = tri.triton_logsumexp_stats, tri.triton_loss, tri.triton_grad
    rows, n, pieces, has_w, ignore, eps, dtype = CASES[case]
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, n, generator=g) * 3).to(dtype)
    t = torch.randint(0, n, (rows,), generator=g)
    t[1] = ignore if ignore >= 0 else -100
    w = torch.rand(n, generator=g) + 0.5 if has_w else None
    up = torch.randn(rows, generator=g)

    xd = x.float().requires_grad_()
    ref = F.cross_entropy(xd, t, weight=w, ignore_index=ignore, label_smoothing=eps, reduction="none")
    ref.backward(up)

    parts = [p.contiguous() for p in x.chunk(pieces, dim=1)]  # torch.chunk pieces, as the plan cuts
    ms, ss = zip(*(stats(p) for p in parts))
    top = torch.stack(ms).amax(0)  # the all-reduce (max)
    lse = top + torch.log(sum(s * torch.exp(m - top) for m, s in zip(ms, ss)))  # the all-reduce (sum)
    firsts = [torch.tensor([k * -(-n // pieces)]) for k in range(len(parts))]
    share = sum(loss_fn(p, t, w, lse, f, n, ignore, eps) for p, f in zip(parts, firsts))
    grad = torch.cat([grad_fn(p, t, w, lse, f, up, n, ignore, eps) for p, f in zip(parts, firsts)], 1)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(share, ref.detach(), **tol, msg=lambda m: f"{impl} {case}, loss: {m}")
    torch.testing.assert_close(grad, xd.grad, **tol, msg=lambda m: f"{impl} {case}, gradient: {m}")


@pytest.mark.parametrize("case", sorted(CASES))
def test_torch_kernels_sum_to_torch_cross_entropy(case):
    check_kernels("torch", case)


@pytest.mark.slow  # 8-11 s here, mostly the fresh interpreter's imports
def test_triton_kernels_sum_to_torch_cross_entropy_under_the_interpreter():
    """:func:`check_kernels` for the triton kernels, every case, in a fresh interpreter with
    ``TRITON_INTERPRET=1``: triton reads it when its own language functions are decorated,
    at its first import, so it cannot be switched on in a process that imported triton."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[triton]')")
    code = "import test_vocab_parallel as t\nfor c in sorted(t.CASES): t.check_kernels('triton', c)\n"
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(__file__), env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


# ---------------------------------------------------------------- a language model
def _gpt2(vocab):
    T = pytest.importorskip("transformers")
    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=vocab, n_positions=32, resid_pdrop=0,
                       embd_pdrop=0, attn_pdrop=0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return T.GPT2LMHeadModel(cfg)


def _lm_batch(step, vocab, batch=2, seq=16):
    """Token ids over the whole vocabulary (every device owns some targets), a few ignored."""
    g = torch.Generator().manual_seed(step)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[:, ::5] = -100
    return {"input_ids": torch.randint(0, vocab, (batch, seq), generator=g), "labels": labels}


def test_the_loss_prices_its_own_all_reduces():
    """Classes split four ways: two all-reduces (max, sum) of one float32 per row (the
    backward has none); with the batch split too, each device's rows only, and 'mean' adds
    the denominator's all-reduce over the batch axis."""
    from autoparallel.mesh import MeshSpec
    from autoparallel.placement import P, R
    from autoparallel.strategies.engine import Strategy
    from autoparallel.strategies.losses import cross_entropy_cost
    from test_rules import _captured
    from torch.distributed.tensor import Shard

    _, traced = _captured(lambda x, t: F.cross_entropy(x, t), ((64, 256), _int(256, 64)))
    node = next(n for n in traced.gm.graph.nodes if n.target == torch.ops.aten.cross_entropy_loss.default)
    cm = autoparallel.CostModel("a100").bind(MeshSpec((4,)))
    vocab = Strategy(((Shard(1),), (R,)), ((P,),), 4)
    assert cross_entropy_cost(node, vocab, cm) == pytest.approx(2 * cm.collective_time("all_reduce", 0, 4 * 64))
    cm = autoparallel.CostModel("a100").bind(MeshSpec((2, 2)))
    both = Strategy(((Shard(0), Shard(1)), (Shard(0), R)), ((P, P),), 4)
    want = 2 * cm.collective_time("all_reduce", 1, 4 * 32) + cm.collective_time("all_reduce", 0, 8)
    assert cross_entropy_cost(node, both, cm) == pytest.approx(want)


def test_gpt2_plan_splits_the_vocabulary_when_the_batch_cannot_be():
    """Planning only (no devices): GPT-2 with a 2048-word vocabulary at batch 2 on (4,), cpu
    preset (:data:`CPU`), splits the embedding's vocabulary and the loss's classes (at batch 8 the same
    model is data-parallel: see the design notes)."""
    from torch.distributed.tensor import Shard

    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in _lm_batch(0, 2048).items()}
    plan = autoparallel.plan(_gpt2(2048), meta, mesh_shape=(4,), cost_model=CPU, cache_dir=False)
    loss = next(n for n in plan.nodes.values() if n.op == "cross_entropy_loss.default")
    wte = next(n for n in plan.nodes.values() if n.op == "embedding.default" and n.module_path == "transformer.wte")
    assert loss.input_specs[0] == (Shard(1),), loss.specs_str()
    assert wte.input_specs[0] == (Shard(0),), wte.specs_str()


@pytest.mark.slow  # about 10 s each here
@pytest.mark.parametrize("vocab", [2048, 2050])
def test_gpt2_plans_vocab_parallel_and_trains_as_on_one_device(vocab, sim_mesh):
    """GPT-2 (2 layers) at batch 2 on (4,), cpu preset: the batch cannot be split four ways,
    and gathering the logits or reducing the gradient of the tied embedding costs more than
    the loss's own all-reduces (2 × 32 floats), so the plan splits the vocabulary: the LM head
    by its output columns and the cross-entropy by its classes, and with 2048 words the token
    embedding (a pending sum) too. 2050 words split as ``torch.chunk`` cuts them (513, 513,
    513, 511 classes): the local kernels take each device's own class count. Loss and every
    gradient equal one device's, before and after an SGD step."""
    import copy

    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import Shard

    from models import to_meta
    from test_parity import train_side_by_side

    mesh = sim_mesh((4,))
    ref = _gpt2(vocab)
    ranks = frozenset(range(4))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(_lm_batch(0, vocab)), device_mesh=mesh,
                                              cost_model=CPU)
    nodes = pmodel.plan.nodes.values()
    loss = next(n for n in nodes if n.op == "cross_entropy_loss.default")
    wte = next(n for n in nodes if n.op == "embedding.default" and n.module_path == "transformer.wte")
    assert loss.input_specs[0] == (Shard(1),), f"the loss should split the classes: {loss.specs_str()}"
    if vocab % 4 == 0:  # the embedding's rule keeps the vocabulary even
        assert wte.input_specs[0] == (Shard(0),), f"the embedding should split the vocabulary: {wte.specs_str()}"
    code = pmodel.graph_module.code
    assert "local_logsumexp" in code and "vocab_parallel_cross_entropy" in code and "'max'" in code
    train_side_by_side(ref, pmodel, [_lm_batch(step, vocab) for step in range(2)], ranks)


def _gloo_worker(rank: int, world: int) -> None:
    """One of ``world`` gloo ranks: GPT-2 (vocabulary 2048) planned vocab-parallel on
    (world,), trained two SGD steps beside the single-device model through real c10d."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from models import to_meta
    from test_multiprocess import _check

    vocab = 2048
    mesh = init_device_mesh("cpu", (world,))
    ref = _gpt2(vocab)
    pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(_lm_batch(0, vocab)), device_mesh=mesh,
                                          cost_model=CPU, cache_dir=False)
    loss_node = next(n for n in pmodel.plan.nodes.values() if n.op == "cross_entropy_loss.default")
    assert loss_node.input_specs[0] == (Shard(1),), loss_node.specs_str()
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (pmodel, ref))
    ref_params = dict(ref.named_parameters())
    for step in range(2):
        batch = _lm_batch(step, vocab)
        ref_opt.zero_grad()
        opt.zero_grad()
        want = ref(**batch).loss
        want.backward()
        got = pmodel(**batch).loss
        got.backward()
        _check(rank, f"step {step}", got, want, pmodel, ref_params)
        opt.step()
        ref_opt.step()


@pytest.mark.multiprocess
def test_gpt2_vocab_parallel_parity_on_4_gloo_ranks():
    """The vocab-parallel plan through real c10d (gloo): max and sum all-reduces, the mesh
    coordinate of each process, the triton-free local kernel on CPU."""
    from gloo_ranks import spawn

    spawn(_gloo_worker, 4, 4)


def test_embedding_keeps_its_vocabulary_whole_with_scale_grad_by_freq():
    """Frequencies counted over the masked local ids would differ from the dense ones."""
    from test_rules import _captured
    from torch.distributed.tensor import Shard

    from autoparallel.strategies import StrategyGenerator

    _, traced = _captured(lambda w, i: F.embedding(i, w, scale_grad_by_freq=True), ((32, 16), _int(32, 4, 8)))
    strategies = StrategyGenerator((4,)).generate(traced.gm)
    node = next(n for n in strategies if n.target == torch.ops.aten.embedding.default)
    assert strategies[node] and not [s for s in strategies[node] if s.inputs[0] == (Shard(0),)]


def test_a_class_weight_that_requires_a_gradient_is_refused():
    from autoparallel.runtime_kernels import vocab_parallel_cross_entropy

    x, t, w = torch.randn(4, 8, requires_grad=True), torch.randint(0, 8, (4,)), torch.rand(8, requires_grad=True)
    lse = torch.logsumexp(x.detach(), 1)
    with pytest.raises(ValueError, match="class weight requires a gradient"):
        vocab_parallel_cross_entropy(x, t, w, lse, torch.tensor([0]), 8)
