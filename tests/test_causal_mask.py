"""Constant causal masks become SDPA's ``is_causal`` flag (autoparallel/rewrites/causal_mask.py):
only a mask that depends on no input and evaluates to the causal mask, and only where the plan
keeps the sequence whole; the loss and every gradient still equal one device's."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode

import autoparallel
from models import to_meta
from test_parity import run_parity, train_side_by_side

aten = torch.ops.aten


class MaskedAttention(torch.nn.Module):
    """Self-attention (2 heads of 8) whose boolean mask is ``ones(S, S).tril(diagonal)``, built
    in the forward; ``diagonal`` 0 is the causal mask, 1 lets each token see the next one too.
    With ``padding``, the mask also reads the ``keep`` input."""

    def __init__(self, diagonal=0):
        super().__init__()
        self.diagonal = diagonal
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x, keep=None):
        b, s, _ = x.shape
        q, k, v = self.proj(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).tril(self.diagonal)
        if keep is not None:
            mask = mask & keep[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).square().mean()


def _sdpa_calls(pmodel):
    return [n for n in pmodel.graph_module.graph.nodes if n.target is aten.scaled_dot_product_attention.default]


def _train(ref, batches, sim_mesh):
    mesh = sim_mesh((2,))
    ranks = frozenset(range(mesh.size()))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), to_meta(batches[0]), device_mesh=mesh,
                                              cost_model=autoparallel.CostModel("cpu"))
    train_side_by_side(ref, pmodel, batches, ranks, loss=lambda out: out)
    return pmodel


@pytest.mark.parametrize("diagonal,padding,flag", [(0, False, True), (1, False, False), (0, True, False)],
                         ids=["causal", "not-causal", "padding-input"])
def test_only_a_constant_causal_mask_becomes_the_flag(diagonal, padding, flag, sim_mesh):
    torch.manual_seed(0)
    batches = []
    for _ in range(2):
        batch = {"x": torch.randn(4, 12, 16)}
        if padding:
            batch["keep"] = torch.rand(4, 12) > 0.2
            batch["keep"][:, 0] = True
        batches.append(batch)
    pmodel = _train(MaskedAttention(diagonal), batches, sim_mesh)
    (call,) = _sdpa_calls(pmodel)
    assert bool(call.kwargs.get("is_causal")) == flag, call.format_node()
    assert (len(call.args) <= 3 or call.args[3] is None) == flag, call.format_node()


def test_llama_attention_is_causal_without_its_mask(sim_mesh):
    """HF Llama under export builds its causal mask from aranges every step: on the data-parallel
    plan the per-device SDPA runs ``is_causal=True`` and the mask's ops are gone."""
    pytest.importorskip("transformers")
    pmodel = run_parity("llama", (2,), "cpu", sim_mesh, steps=2)
    calls = _sdpa_calls(pmodel)
    assert calls and all(n.kwargs.get("is_causal") and n.args[3] is None for n in calls)
    ops = {n.target for n in pmodel.graph_module.graph.nodes}
    assert aten.where.self not in ops and aten.bitwise_and.Tensor not in ops


def test_erasing_an_unread_mask_erases_a_shared_input_once():
    """A mask reading one value directly and through another op reaches it twice; it is erased
    once (torch.fx warns on a second erase_node, which the test configuration makes an error)."""
    import warnings

    import torch.fx as fx

    from autoparallel.rewrites.causal_mask import _erase_unread

    aten = torch.ops.aten
    graph = fx.Graph()
    x = graph.placeholder("x")
    base = graph.call_function(aten.ones.default, ([4, 4],))
    neg = graph.call_function(aten.neg.default, (base,))
    mask = graph.call_function(aten.add.Tensor, (base, neg))
    graph.output(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _erase_unread(graph, mask)
    assert [n.op for n in graph.nodes] == ["placeholder", "output"]
