"""The registry of emit-time rewrites (autoparallel/rewrites/): every rewrite says where it applies,
what it changes in memory and how it rewrites the per-device graph, and the memory model and the
lowering read the same registry: a rewrite taken out of it is gone from both."""

import inspect

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode

import autoparallel
from autoparallel import rewrites
from autoparallel.tracer import ColoTracer
from models import to_meta
from test_causal_mask import MaskedAttention

aten = torch.ops.aten


def test_every_rewrite_has_its_three_parts():
    names = [r.name for r in rewrites.REWRITES]
    assert names == ["fused_parts", "gqa", "causal_mask", "cross_entropy"]  # the order they run in
    for r in rewrites.REWRITES:
        assert isinstance(r, rewrites.Rewrite) and not inspect.isabstract(type(r))
        for method in ("applies", "saved_size", "apply"):
            assert method in vars(type(r)), f"{type(r).__name__} does not say its own {method}"
        doc = inspect.getdoc(type(r))
        assert all(part in doc for part in ("Matches:", "Exact:", "Memory:")), type(r).__name__


class FusedAndLoss(torch.nn.Module):
    """A fused projection split in three (capture makes one product of each part) and a
    cross-entropy over 2-D logits."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 24)

    def forward(self, x, t):
        a, b, c = self.proj(x).split(8, dim=-1)
        return torch.nn.functional.cross_entropy(a * b + c, t)


@pytest.mark.parametrize("model,inputs,found", [
    (lambda: MaskedAttention(0), {"x": torch.randn(4, 12, 16)}, {"causal_mask"}),
    (lambda: MaskedAttention(1), {"x": torch.randn(4, 12, 16)}, set()),
    (FusedAndLoss, {"x": torch.randn(6, 8), "t": torch.randint(0, 8, (6,))}, {"fused_parts", "cross_entropy"}),
], ids=["causal", "not-causal", "fused-and-loss"])
def test_applies_reads_the_captured_graph(model, inputs, found):
    traced = ColoTracer().trace(model(), to_meta(inputs))
    nodes = [n for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert {r.name for r in rewrites.REWRITES for n in nodes if r.applies(n)} == found


def _plan_and_emit(sim_mesh):
    """The modelled peak and the SDPA call of the causal-mask model on a simulated (2,) mesh."""
    torch.manual_seed(0)
    mesh, model = sim_mesh((2,)), MaskedAttention(0)  # outside LocalTensorMode: plain weights
    with LocalTensorMode(frozenset(range(2))):
        pmodel = autoparallel.autoparallelize(model, to_meta({"x": torch.randn(4, 12, 16)}), device_mesh=mesh,
                                              cost_model=autoparallel.CostModel("cpu"), cache_dir=False)
    (call,) = [n for n in pmodel.graph_module.graph.nodes if n.target is aten.scaled_dot_product_attention.default]
    return pmodel.plan.estimate.peak_memory_bytes, bool(call.kwargs.get("is_causal"))


def test_memory_model_and_lowering_read_one_registry(sim_mesh, monkeypatch):
    peak, flag = _plan_and_emit(sim_mesh)
    monkeypatch.setattr(rewrites, "REWRITES", tuple(r for r in rewrites.REWRITES if r.name != "causal_mask"))
    peak_without, flag_without = _plan_and_emit(sim_mesh)
    assert flag and not flag_without
    assert peak < peak_without  # the mask's copy SDPA keeps for the backward is counted again
