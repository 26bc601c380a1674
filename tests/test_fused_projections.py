"""Fused projections split into one projection per part (autoparallel/tracer/fused.py).

Node-level checks: the rewritten graph module computes the original's values and gradients (the
fused parameter's included) on random weights, and the pass leaves alone every pattern where it
would not be exact. Then parity through ``autoparallelize`` on simulated meshes, with plans that
split the attention by heads."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Shard

import autoparallel
from autoparallel.tracer import ColoTracer
from autoparallel.tracer.fused import split_fused_projections
from models import CheapComm, to_meta

aten = torch.ops.aten


class GateUp(torch.nn.Module):
    """A gated MLP whose gate and up projections are one linear, chunked in two."""

    def __init__(self, d=32, f=48):
        super().__init__()
        self.gate_up_proj = torch.nn.Linear(d, 2 * f, bias=False)
        self.down_proj = torch.nn.Linear(f, d)

    def forward(self, x, y):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return F.mse_loss(self.down_proj(F.silu(gate) * up), y)


class GQAttention(torch.nn.Module):
    """Grouped-query attention with one fused ``qkv_proj`` (with bias) split into unequal parts:
    ``heads`` query heads, ``kv_heads`` key and value heads of ``head_dim``."""

    def __init__(self, d=64, heads=4, kv_heads=2, slices=False):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.slices = heads, kv_heads, d // heads, slices
        self.qkv_proj = torch.nn.Linear(d, (heads + 2 * kv_heads) * self.head_dim)
        self.o_proj = torch.nn.Linear(d, d)

    def forward(self, x, y):
        b, s, d = x.shape
        qkv = self.qkv_proj(x)
        nq, nkv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        if self.slices:  # as Phi-3 writes it
            q, k, v = qkv[..., :nq], qkv[..., nq:nq + nkv], qkv[..., nq + nkv:]
        else:
            q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = (t.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
                .repeat_interleave(self.heads // self.kv_heads, dim=1) for t in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.mse_loss(self.o_proj(o.transpose(1, 2).reshape(b, s, d)), y)


class MatmulQKV(torch.nn.Module):
    """q, k, v from ``x @ W`` with a bare ``[d, 3d]`` parameter, split equally."""

    def __init__(self, d=32):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(d, 3 * d) / d ** 0.5)

    def forward(self, x, y):
        q, k, v = (x @ self.w).split(x.shape[-1], dim=-1)
        return F.mse_loss(q * k + v, y)


class NotFused(torch.nn.Module):
    """Patterns the pass must leave alone, by ``kind``."""

    def __init__(self, kind, d=32):
        super().__init__()
        self.kind = kind
        self.proj = torch.nn.Linear(d, 2 * d)

    def forward(self, x, y):
        h = self.proj(x)
        d = h.shape[-1] // 2
        if self.kind == "also_used":  # the fused output is read beside the split
            a, b = h.chunk(2, dim=-1)
            out = a * b + h[..., :d].sum()
        elif self.kind == "gap":  # slices that leave columns out
            out = h[..., :d - 4] @ torch.ones(d - 4, d) + h[..., d:]
        elif self.kind == "overlap":
            out = h[..., :d + 2][..., :d] * h[..., d - 2:][..., 2:]
        elif self.kind == "step":
            out = h[..., ::2] * h[..., 1::2]
        elif self.kind == "other_dim":  # a split of the batch, not of the out-features
            a, b = h.chunk(2, dim=0)
            out = torch.cat([b, a])[..., :d]
        else:  # "heads_first": a view moves the out-features into [heads, 3 · head_dim] (GPT-NeoX)
            a, b = h.view(*h.shape[:-1], 4, 2 * d // 4).chunk(2, dim=-1)
            out = (a * b).flatten(-2)
        return F.mse_loss(out, y)


def _inputs(seed, b=2, s=8, d=32, dy=None):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(b, s, d, generator=g), "y": torch.randn(b, s, dy or d, generator=g)}


def _rewritten(model, inputs):
    """(number of rewrites, the exported module, its rewritten copy)."""
    gm = torch.export.export(model, (), inputs, strict=False).module()
    new = copy.deepcopy(gm)
    count = split_fused_projections(new.graph)
    new.graph.lint()
    new.recompile()
    return count, gm, new


def _ops(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _same_values(gm, new, inputs, loss=lambda out: out):
    """The loss and every parameter gradient agree (float32, up to the GEMM's summation order)."""
    want, got = loss(gm(**inputs)), loss(new(**inputs))
    want.backward()
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    grads = dict(gm.named_parameters())
    for name, p in new.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-6, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("make,parts,target", [
    (GateUp, 2, aten.linear.default),
    (lambda: GQAttention(), 3, aten.linear.default),
    (lambda: GQAttention(slices=True), 3, aten.linear.default),
    (MatmulQKV, 3, aten.matmul.default),
], ids=["gate_up_chunk", "gqa_split_with_sizes", "gqa_slices", "matmul_split"])
def test_rewrite_keeps_values(make, parts, target):
    """One projection per part on a slice of the fused weight (and bias), no split left, and
    the same loss and gradients as the fused graph."""
    torch.manual_seed(0)
    model = make()
    d = 64 if isinstance(model, GQAttention) else 32
    inputs = _inputs(0, d=d)
    count, gm, new = _rewritten(model, inputs)
    assert count == 1
    assert _ops(new).count(target) == _ops(gm).count(target) + parts - 1
    left = {aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default} & set(_ops(new))
    assert not left, left
    _same_values(gm, new, inputs)


def test_gpt2_conv1d_rewritten():
    """GPT-2's ``c_attn`` (``view → addmm → view → split``) becomes three addmm on column slices
    of its weight and bias, per layer; logits, loss and every gradient unchanged."""
    pytest.importorskip("transformers")
    from models import batch_for, hf_model

    torch.manual_seed(0)
    model = hf_model("gpt2")
    inputs = batch_for("gpt2", 0, batch=2, seq=8)
    count, gm, new = _rewritten(model, inputs)
    assert count == 2  # one c_attn per layer
    assert aten.split.Tensor not in _ops(new)
    assert _ops(new).count(aten.addmm.default) == _ops(gm).count(aten.addmm.default) + 4
    torch.testing.assert_close(new(**inputs).logits, gm(**inputs).logits, rtol=1e-5, atol=1e-6)
    _same_values(gm, new, inputs, loss=lambda out: out.loss)


@pytest.mark.parametrize("kind", ["also_used", "gap", "overlap", "step", "other_dim", "heads_first"])
def test_not_rewritten_where_inexact(kind):
    """The fused output read beside its split, slices that leave a gap, overlap or stride, a
    split of another dim, and a view that reshapes the out-features dim: nothing changes."""
    model = NotFused(kind)
    inputs = _inputs(0)
    count, gm, new = _rewritten(model, inputs)
    assert count == 0
    assert _ops(new) == _ops(gm)


def test_capture_rewrites_phi3():
    """Capture runs the pass: Phi-3's fused ``qkv_proj`` (GQA: unequal slices) and ``gate_up_proj``
    (chunk) are two and three linears on slices of their weights, the parameters keep their names
    and shapes, and the stamped capture of a deep model equals the full one node for node."""
    T = pytest.importorskip("transformers")
    from models import batch_for

    T.logging.set_verbosity_error()
    cfg = T.Phi3Config(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                       vocab_size=128, max_position_embeddings=32, intermediate_size=96, use_cache=False,
                       pad_token_id=0)
    with torch.device("meta"):
        model = T.Phi3ForCausalLM(cfg)
    inputs = to_meta(batch_for("llama", 0))
    stamped, full = ColoTracer(stamp=True).trace(model, inputs), ColoTracer(stamp=False).trace(model, inputs)
    assert stamped.stamped_layers == 2
    for traced in (stamped, full):
        nodes = list(traced.gm.graph.nodes)
        assert not [n for n in nodes if n.target is aten.chunk.default]
        linears = [n for n in nodes if n.target is aten.linear.default]
        assert len(linears) == 6 * (3 + 1 + 2 + 1) + 1  # q, k, v, o; gate, up, down; the head
        w = traced.gm.get_parameter("model.layers.5.self_attn.qkv_proj.weight")
        assert tuple(w.shape) == (128, 64) and "model.layers.5.self_attn.qkv_proj.weight" in traced.params
    sig = [(n.op, str(n.target), tuple(n.meta["val"].shape) if isinstance(n.meta.get("val"), torch.Tensor) else None)
           for n in stamped.gm.graph.nodes]
    assert sig == [(n.op, str(n.target), tuple(n.meta["val"].shape)
                    if isinstance(n.meta.get("val"), torch.Tensor) else None) for n in full.gm.graph.nodes]


# ---------------------------------------------------------------- parity on simulated meshes

def _parity(ref, batches, mesh, cost_model, loss, **options):
    """Train a copy of ``ref`` on ``mesh`` beside ``ref`` on one device (test_parity's check)."""
    from test_parity import train_side_by_side

    model = copy.deepcopy(ref)
    ranks = frozenset(range(mesh.size()))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, to_meta(batches[0]), device_mesh=mesh, cost_model=cost_model,
                                              **options)
    assert set(dict(pmodel.named_parameters())) == set(dict(ref.named_parameters()))
    assert set(pmodel.state_dict()) == set(ref.state_dict())
    train_side_by_side(ref, pmodel, batches, ranks, loss)
    return pmodel


def _split_axes(spec, dim):
    """Mesh axes that split ``dim`` in ``spec``."""
    return {a for a, p in enumerate(spec) if isinstance(p, Shard) and p.dim == dim}


def _gpt2(n_embd=128, n_head=8):
    import transformers as T

    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    return T.GPT2LMHeadModel(T.GPT2Config(n_layer=2, n_embd=n_embd, n_head=n_head, vocab_size=128, n_positions=32,
                                          resid_pdrop=0, embd_pdrop=0, attn_pdrop=0, use_cache=False))


def _heads_axes(plan, layer):
    """The mesh axes that split layer ``layer``'s attention by heads: each of the q, k, v
    projections' out-features and the attention's heads dim. (How ``c_proj`` runs after it is left
    to the costs: row-split as Megatron does, or the heads gathered and ``c_proj`` column-split,
    which also shards its bias and so its optimizer step; with communication nearly free the two
    are within a microsecond of each other.)"""
    attn = f"transformer.h.{layer}.attn"
    nodes = [n for n in plan.nodes.values() if n.module_path.startswith(attn)]
    qkv = [n for n in nodes if n.module_path == attn + ".c_attn" and n.op == "addmm.default"]
    sdpa = [n for n in nodes if n.op == "scaled_dot_product_attention.default"]
    assert len(qkv) == 3 and len(sdpa) == 1, [n.name for n in nodes]
    return set.intersection(*[_split_axes(n.output_specs[0], 1) for n in qkv + sdpa])


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,batch", [((2,), 1), ((2, 2), 2)], ids=["2", "2x2"])
def test_gpt2_attention_split_by_heads(mesh_shape, batch, sim_mesh):
    """HF GPT-2 (8 heads, n_embd 128) at a batch the mesh cannot split alone, communication nearly
    free (a100 preset): every layer's attention runs split by heads over one mesh axis (q, k, v
    column-split, SDPA by heads), and the loss and every gradient (the fused
    ``c_attn`` parameters' included) equal one device's over SGD steps."""
    pytest.importorskip("transformers")
    from models import batch_for

    batches = [batch_for("gpt2", seed, batch=batch) for seed in range(2)]
    pmodel = _parity(_gpt2(), batches, sim_mesh(mesh_shape), CheapComm("a100"), loss=lambda out: out.loss)
    for layer in range(2):
        assert _heads_axes(pmodel.plan, layer), f"layer {layer} is not split by heads:\n{pmodel.plan}"


def _count(pmodel, target) -> int:
    return sum(n.target is target for n in pmodel.graph_module.graph.nodes)


@pytest.mark.parametrize("mesh_shape", [(1,), (2,)], ids=["1", "2"])
def test_parts_rejoined_where_a_device_computes_them_whole(mesh_shape, sim_mesh):
    """Data parallel: every device computes ``c_attn`` from its whole weight, so the emitted graph
    runs one ``addmm`` and one ``split_with_sizes`` per layer, as eager GPT-2 does, instead of three
    products on slices of the weight (rewrites/fused_parts.py); the loss and every gradient equal one
    device's. With the heads split the parts stay apart (test_gpt2_attention_split_by_heads)."""
    pytest.importorskip("transformers")
    from models import batch_for

    batches = [batch_for("gpt2", seed, batch=4) for seed in range(2)]
    pmodel = _parity(_gpt2(n_embd=64, n_head=4), batches, sim_mesh(mesh_shape), autoparallel.CostModel("cpu"),
                     loss=lambda out: out.loss, parallelism="data")
    assert _count(pmodel, aten.split_with_sizes.default) == 2
    assert _count(pmodel, aten.addmm.default) == 2 * 4  # c_attn, attn.c_proj, c_fc, mlp.c_proj
    sliced = [n.args[0].name for n in pmodel.graph_module.graph.nodes if n.target is aten.slice.Tensor]
    assert not [name for name in sliced if "c_attn" in name], sliced


@pytest.mark.parametrize("make,mesh_shape", [
    (GateUp, (2,)),
    (lambda: GQAttention(), (2,)),
    pytest.param(lambda: GQAttention(slices=True), (2, 2), marks=pytest.mark.slow),
], ids=["gate_up-2", "gqa_split-2", "gqa_slices-2x2"])
def test_fused_parity(make, mesh_shape, sim_mesh):
    """A chunked gate_up and GQA's unequal qkv parts (split and slices): with communication
    nearly free each part's out-features are split over some mesh axis, and the loss and every
    gradient, the fused weight's included, equal one device's."""
    torch.manual_seed(0)
    ref = make()
    d = 64 if isinstance(ref, GQAttention) else 32
    batches = [_inputs(seed, b=2, s=16, d=d) for seed in range(2)]
    pmodel = _parity(ref, batches, sim_mesh(mesh_shape), CheapComm("cpu"), loss=lambda out: out)
    fused = "gate_up_proj" if isinstance(ref, GateUp) else "qkv_proj"
    parts = [n for n in pmodel.plan.nodes.values() if n.module_path == fused and n.op == "linear.default"]
    assert len(parts) == (2 if fused == "gate_up_proj" else 3)
    assert all(_split_axes(n.output_specs[0], 2) for n in parts), [n.specs_str() for n in parts]
