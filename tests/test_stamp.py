"""Layer stamping (autoparallel.tracer.stamp): a graph captured from four layers and
stamped equals the full capture, node for node; every guard falls back to a full capture;
the stamped module trains with parity and the plan costs what the full capture's costs."""


import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.utils._pytree as pytree

import autoparallel
from autoparallel.tracer import ColoTracer
from autoparallel.tracer.stamp import MIN_LAYERS, _val_sig, find_layer_list
from models import batch_for, hf_model, to_meta
from test_parity import COST_MODELS, run_parity

T = pytest.importorskip("transformers")


def canonical(traced):
    """The graph as data, node names left out: op, target, wiring, output metadata and
    module path of every node, plus the parameter and buffer tables."""
    nodes = list(traced.gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}

    def ref(x):
        return ("attr", x.target) if x.op == "get_attr" else ("node", pos[x])

    rows = [(n.op, str(n.target), repr(pytree.tree_map_only(fx.Node, ref, (n.args, n.kwargs))),
             _val_sig(n.meta.get("val")), tuple((k, v[0]) for k, v in (n.meta.get("nn_module_stack") or {}).items()),
             n.meta["autoparallel"].module_path if "autoparallel" in n.meta else None)
            for n in nodes]
    return rows, traced.params, traced.buffers, traced.requires_grad


def deep(name, layers=MIN_LAYERS, **overrides):
    torch.manual_seed(0)
    model = hf_model(name, layers=layers).train()
    for k, v in overrides.items():
        setattr(model.config, k, v)
    return model


def both(model, name):
    inputs = to_meta(batch_for(name, 0))
    return ColoTracer().trace(model, inputs), ColoTracer(stamp=False).trace(model, inputs)


@pytest.mark.parametrize("name,layers", [("gpt2", 7), ("llama", 6), ("bert", 6)])
def test_stamped_graph_equals_full_capture(name, layers):
    stamped, full = both(deep(name, layers), name)
    assert stamped.stamped_layers == layers - 4
    assert full.stamped_layers == 0
    assert canonical(stamped) == canonical(full)


def tiny_deepseek(layers=8, dense=2):
    """DeepSeek-V3 in miniature: ``dense`` dense layers, then mixture-of-experts ones (shared
    expert, grouped routing) of another parameter signature."""
    torch.manual_seed(0)
    cfg = T.DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                             num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                             q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                             n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                             first_k_dense_replace=dense, max_position_embeddings=64, use_cache=False)
    return T.DeepseekV3ForCausalLM(cfg).train()


def test_stamped_tail_after_differing_layers():
    """Layers that differ before an interchangeable tail (DeepSeek's dense layers before its
    MoE ones) are traced as they are, and the tail is stamped: the graph equals the full
    capture node for node."""
    model = tiny_deepseek()
    assert (find_layer_list(model).start, find_layer_list(model).keep) == (2, [0, 1, 2, 3, 4, 7])
    ids = torch.randint(0, 128, (2, 16))
    inputs = to_meta({"input_ids": ids, "labels": ids})
    stamped, full = ColoTracer().trace(model, inputs), ColoTracer(stamp=False).trace(model, inputs)
    assert stamped.stamped_layers == 2
    assert canonical(stamped) == canonical(full)
    assert find_layer_list(tiny_deepseek(layers=7, dense=2)) is None  # a tail of 5 layers: too short


def test_layer_index_in_forward_falls_back():
    """GPT-2 scaling attention by 1/(layer index + 1): the layers' ``scaling`` attributes
    differ, so stamping must not apply, and the capture is the full one."""
    torch.manual_seed(0)
    cfg = T.GPT2Config(n_layer=6, n_embd=64, n_head=4, vocab_size=128, n_positions=32, use_cache=False,
                       scale_attn_by_inverse_layer_idx=True, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0)
    model = T.GPT2LMHeadModel(cfg)
    assert find_layer_list(model) is None
    stamped, full = both(model, "gpt2")
    assert stamped.stamped_layers == 0
    assert canonical(stamped) == canonical(full)


class LinearLayers(nn.Module):
    def __init__(self, n=8, acts=None):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(n))
        self.acts = acts or ["relu"] * n

    def forward(self, x):
        for layer, act in zip(self.layers, self.acts):
            x = getattr(torch, act)(layer(x))
        return x.sum()


def test_guards_before_tracing():
    assert find_layer_list(LinearLayers()) is not None
    assert find_layer_list(LinearLayers(n=MIN_LAYERS - 1)) is None  # too shallow to gain anything
    tied = LinearLayers()
    tied.layers[3].weight = tied.layers[2].weight
    assert find_layer_list(tied) is None
    odd = LinearLayers()
    odd.layers[4] = nn.Linear(16, 16, bias=False)
    assert find_layer_list(odd) is None  # a tail of three interchangeable layers
    head = LinearLayers()
    head.layers[1] = nn.Linear(16, 16, bias=False)
    assert find_layer_list(head).start == 2  # layers 2..7 interchangeable
    head.layers[0].some_mode = head.layers[1].some_mode = "first"  # attributes before the tail do not matter
    assert find_layer_list(head).start == 2
    head.layers[5].some_mode = "other"  # ... in the tail they do
    assert find_layer_list(head) is None
    flagged = LinearLayers()
    flagged.layers[5].some_mode = "other"
    flagged.layers[0].some_mode = flagged.layers[1].some_mode = flagged.layers[2].some_mode = "one"
    for i in (3, 4, 6, 7):
        flagged.layers[i].some_mode = "one"
    assert find_layer_list(flagged) is None
    # per-layer config lists: Qwen2 with sliding-window and full-attention layers
    cfg = T.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, use_cache=False, use_sliding_window=True,
                        sliding_window=8, max_window_layers=3)
    assert len(set(cfg.layer_types)) == 2
    assert find_layer_list(T.Qwen2ForCausalLM(cfg)) is None


class Doubling(nn.Module):
    def forward(self, x):
        return torch.relu(x) * 2


class ParameterFreeLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.layers = nn.ModuleList(Doubling() for _ in range(8))

    def forward(self, x):
        x = self.lin(x)
        for layer in self.layers:
            x = layer(x)
        return x.sum()


def test_layers_without_parameters_are_stamped():
    x = torch.randn(4, 16)
    stamped = ColoTracer().trace(ParameterFreeLayers(), (x,))
    full = ColoTracer(stamp=False).trace(ParameterFreeLayers(), (x,))
    assert stamped.stamped_layers == 4
    assert canonical(stamped) == canonical(full)


def test_forward_that_differs_per_layer_falls_back():
    """A layer list whose forward treats some layers differently (by position, not by module
    attributes) is caught after tracing: layers 1, 2 and L-1 disagree."""
    model = LinearLayers(acts=["relu", "relu", "relu", "relu", "relu", "relu", "relu", "tanh"])
    x = torch.randn(4, 16)
    stamped = ColoTracer().trace(model, (x,))
    full = ColoTracer(stamp=False).trace(model, (x,))
    assert stamped.stamped_layers == 0
    assert canonical(stamped) == canonical(full)


@pytest.mark.slow  # 4-15 s: in the full tier (make test), not the everyday one
def test_stamped_plan_costs_the_same():
    model = deep("llama", 8)
    inputs = to_meta(batch_for("llama", 0))
    kw = dict(mesh_shape=(2, 2), cost_model=COST_MODELS["shard-params"](), cache_dir=False)
    a = autoparallel.plan(model, inputs, **kw)
    b = autoparallel.plan(model, inputs, stamp_layers=False, **kw)
    assert a.solver_stats.stamped_layers == 4 and b.solver_stats.stamped_layers == 0
    assert a.solver_stats.objective_s == pytest.approx(b.solver_stats.objective_s, rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_shape,cost", [((2, 2), "shard-params"), ((4,), "cpu")])
def test_stamped_module_parity(sim_mesh, mesh_shape, cost):
    """GPT-2 with 6 layers (2 stamped): loss and every gradient equal to one device, before
    and after an SGD step; the stamped layers' parameters are the model's own."""
    pmodel = run_parity("gpt2", mesh_shape, cost, sim_mesh, steps=2, ref=deep("gpt2", 6))
    assert pmodel.plan.solver_stats.stamped_layers == 2
