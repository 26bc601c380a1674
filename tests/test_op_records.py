"""The ops that have records since issue 15, end to end: a model built from them trains on
simulated ranks as on one device (tests/test_parity.py's check), and the planner and
``apply_plan`` reach them only through their records."""

import pytest
import torch
import torch.nn.functional as F

from autoparallel.strategies import record_of
from test_parity import run_parity

aten = torch.ops.aten


class Mixed(torch.nn.Module):
    """Token ids through an LSTM, GroupNorm, an einsum, a bidirectional GRU, an in-place
    hardswish and bags of embeddings, into a binary cross-entropy with logits."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(128, 16)
        self.lstm = torch.nn.LSTM(16, 16, batch_first=True)
        self.norm = torch.nn.GroupNorm(4, 16)
        self.mix = torch.nn.Parameter(torch.randn(16, 16) / 4)
        self.gru = torch.nn.GRU(16, 8, bidirectional=True)
        self.bag = torch.nn.EmbeddingBag(128, 16, mode="mean")
        self.head = torch.nn.Linear(16, 1)

    def forward(self, input_ids, labels):
        h = self.lstm(self.emb(input_ids))[0]
        h = self.norm(h.transpose(1, 2)).transpose(1, 2)
        h = torch.einsum("bsd,de->bse", h, self.mix)
        h = self.gru(h.transpose(0, 1))[0].transpose(0, 1)
        z = F.hardswish(h + self.bag(input_ids)[:, None], inplace=True)
        return F.binary_cross_entropy_with_logits(self.head(z).squeeze(-1), (labels % 2).float())


@pytest.mark.parametrize("mesh_shape,cost", [((4,), "cheap-comm"), ((2, 2), "cheap-comm")], ids=["4", "2x2"])
def test_a_model_of_the_new_records_trains_as_on_one_device(mesh_shape, cost, sim_mesh):
    pmodel = run_parity("mixed", mesh_shape, cost, sim_mesh, steps=2, ref=Mixed().train())
    split = {n.op for n in pmodel.plan.nodes.values() if n.output_specs and any(
        p.is_shard() for s in n.output_specs for p in s)}
    for op in ("lstm.input", "gru.input", "group_norm.default", "einsum.default", "embedding_bag.padding_idx",
               "hardswish_.default"):
        assert op in split, f"{op} should run on a split batch; split: {sorted(split)}"
    assert not pmodel.plan.inspection.fallback_ops


def test_the_records_hold_the_special_cases():
    """The rewrites and costs that apply_plan and the planner used to special-case."""
    for op in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
               aten.squeeze.dim, aten.conv2d.default, aten.mean.dim, aten.cross_entropy_loss.default,
               aten.group_norm.default, aten.embedding_bag.padding_idx,
               aten.binary_cross_entropy_with_logits.default):
        assert record_of(op).local is not None, op
    assert record_of(aten.cross_entropy_loss.default).cost is not None
    assert record_of(aten.add.Tensor).local is None and record_of(aten.add.Tensor).cost is None


def _hf(T, name):
    """Tiny random-weight Hugging Face models of the families whose ops ran replicated."""
    layers = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    if name == "falcon":
        return T.FalconForCausalLM(T.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                  vocab_size=128, use_cache=False))
    if name == "electra":  # the discriminator's loss: binary_cross_entropy_with_logits
        return T.ElectraForPreTraining(T.ElectraConfig(vocab_size=128, embedding_size=32, hidden_size=64,
                                                       max_position_embeddings=32, **layers))
    if name == "funnel":  # relative attention by einsum
        return T.FunnelForMaskedLM(T.FunnelConfig(vocab_size=128, block_sizes=[1, 1], d_model=64, n_head=4,
                                                  d_head=16, d_inner=128))
    if name == "clip":
        return T.CLIPModel(T.CLIPConfig(
            text_config=dict(vocab_size=128, hidden_size=64, max_position_embeddings=32, **layers),
            vision_config=dict(hidden_size=64, image_size=32, patch_size=8, **layers), projection_dim=32))
    # wav2vec2: group_norm and _weight_norm in the feature encoder and positional convolution
    return T.Wav2Vec2ForCTC(T.Wav2Vec2Config(vocab_size=32, hidden_size=64, conv_dim=(32, 32), conv_stride=(5, 2),
                                             conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                             num_conv_pos_embedding_groups=4, mask_time_prob=0.0, layerdrop=0.0,
                                             **layers))


def _inputs(name, batch=4, seq=16):
    meta = dict(device="meta")
    if name == "wav2vec2":
        return {"input_values": torch.empty(batch, 1600, **meta)}
    if name in ("poolformer", "mobilenetv3"):
        return {"x": torch.empty(batch, 3, 32, 32, **meta), "y": torch.empty(batch, dtype=torch.long, **meta)}
    ids = {"input_ids": torch.empty(batch, seq, dtype=torch.long, **meta)}
    if name == "clip":
        return dict(ids, pixel_values=torch.empty(batch, 3, 32, 32, **meta), return_loss=True)
    return dict(ids, labels=torch.empty(batch, seq, dtype=torch.long, **meta))


@pytest.mark.parametrize("name", ["falcon", "electra", "funnel", "clip", "wav2vec2", "poolformer", "mobilenetv3"])
def test_families_that_ran_replicated_have_a_rule_for_every_op(name):
    """coverage() of each family that had ops running replicated for want of a record
    (GroupNorm, einsum, BCE with logits, in-place hardswish, weight norm, x.T, fill_,
    index_put_) now lists no replicate fallback."""
    from autoparallel import coverage
    from autoparallel.strategies.coverage import FALLBACK
    from models import WithLoss

    T = pytest.importorskip("transformers")
    timm = pytest.importorskip("timm")
    T.logging.set_verbosity_error()
    torch.manual_seed(0)
    with torch.device("meta"):
        if name in ("poolformer", "mobilenetv3"):
            arch = {"poolformer": "poolformer_s12", "mobilenetv3": "mobilenetv3_small_050"}[name]
            model = WithLoss(timm.create_model(arch, pretrained=False, num_classes=10))
        else:
            model = _hf(T, name)
    report = coverage(model.train(), _inputs(name))
    assert not [r.op for r in report.rows if r.source == FALLBACK], str(report)
