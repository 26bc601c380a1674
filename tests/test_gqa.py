"""Grouped-query attention handed to SDPA unrepeated (autoparallel/rewrites/gqa.py): HF Llama's
``repeat_kv`` copies, captured by torch.export, become ``enable_gqa=True`` in the per-device
graph, and the loss and every gradient still equal one device's, with attention whole on each
device (data parallel) and split by heads (tensor parallel)."""

import pytest
import torch
from torch.distributed.tensor import Shard

from test_parity import run_parity

aten = torch.ops.aten


def _attention_calls(pmodel):
    return [n for n in pmodel.graph_module.graph.nodes if n.target is aten.scaled_dot_product_attention.default]


def _five_dim_expands(pmodel):
    return [n for n in pmodel.graph_module.graph.nodes if n.target is aten.expand.default and len(n.args[1]) == 5]


@pytest.mark.parametrize("cost,batch,heads_split", [("cpu", 8, False), ("cheap-comm", 1, True)],
                         ids=["data", "heads"])
def test_llama_kv_heads_unrepeated(cost, batch, heads_split, sim_mesh):
    pytest.importorskip("transformers")
    pmodel = run_parity("llama", (2,), cost, sim_mesh, steps=2, batch=batch)
    sdpa = [n for n in pmodel.plan.nodes.values() if n.op == "scaled_dot_product_attention.default"]
    assert all((Shard(1) in n.output_specs[0]) == heads_split for n in sdpa), [n.specs_str() for n in sdpa]
    calls = _attention_calls(pmodel)
    assert len(calls) == 2 and all(n.kwargs.get("enable_gqa") for n in calls), [n.format_node() for n in calls]
    assert not _five_dim_expands(pmodel)
