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
    assert not pmodel.plan.solver_stats["fallback_ops"]


def test_the_records_hold_the_special_cases():
    """The rewrites and costs that apply_plan and the planner used to special-case."""
    for op in (aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.expand.default,
               aten.squeeze.dim, aten.conv2d.default, aten.mean.dim, aten.cross_entropy_loss.default,
               aten.group_norm.default, aten.embedding_bag.padding_idx,
               aten.binary_cross_entropy_with_logits.default):
        assert record_of(op).local is not None, op
    assert record_of(aten.cross_entropy_loss.default).cost is not None
    assert record_of(aten.add.Tensor).local is None and record_of(aten.add.Tensor).cost is None
