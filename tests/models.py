"""Small models for the tests: a plain MLP and CNN, Hugging Face architectures from configs and
timm's ViT and ResNet-18, all with random weights."""

import torch

import autoparallel


class ShardParams(autoparallel.CostModel):
    """Gradient reduction made expensive: the planner splits every parameter it can, which
    exercises tensor-parallel rules, all-to-alls and reduce-scatters on these toy models."""

    def grad_reduction_time(self, axis, nbytes):
        return 1e-3


def without_dtensor_overhead(preset: str) -> autoparallel.DevicePreset:
    """Preset ``preset`` with DTensor's per-op dispatch left out of the optimizer step: on the
    tests' toy models that overhead (paid for every parameter once any is sharded) outweighs
    every saving of sharding, so tests of what sharding choices the planner makes use this."""
    import dataclasses

    from autoparallel.solver.costs import PRESETS

    return dataclasses.replace(PRESETS[preset], dtensor_op_overhead=0.0)


def whole(t):
    """The whole value of a parallel module's parameter or gradient: a DTensor's
    ``full_tensor()``, or the tensor itself where the module holds plain tensors (a plan that
    replicates every parameter)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def placements_of(t) -> tuple:
    """A parameter's or gradient's placements; ``()`` for a plain tensor."""
    return tuple(getattr(t, "placements", ()))


class MLP(torch.nn.Module):
    def __init__(self, hidden=256, layers=4, bias=True):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden, bias=bias) for _ in range(layers)])

    def forward(self, x, y):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.nn.functional.gelu(x)
        return torch.nn.functional.mse_loss(x, y)


class TwoLinear(torch.nn.Module):
    """``(relu(x @ w1) @ w2).sum()``, x (N, 64): the second matmul keeps its weight (for its
    input's gradient) and its input, which the relu saves too."""

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(64, 64))
        self.w2 = torch.nn.Parameter(torch.randn(64, 32))

    def forward(self, x):
        return (torch.relu(x @ self.w1) @ self.w2).sum()


class CNN(torch.nn.Module):
    """Convolutions (plain, depthwise, pointwise), pooling, adaptive pooling, flatten,
    LayerNorm over channels and GELU/SiLU/ReLU: the vision building blocks."""

    def __init__(self):
        super().__init__()
        nn = torch.nn
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.pw = nn.Conv2d(32, 64, 1, bias=False)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 10)

    def forward(self, x, y):
        F = torch.nn.functional
        x = F.max_pool2d(torch.relu(self.stem(x)), 2)
        x = F.avg_pool2d(self.pw(F.silu(self.dw(x))), 2)
        x = F.gelu(self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return F.cross_entropy(self.head(x), y)


def hf_model(name, layers=2):
    import transformers as T

    T.logging.set_verbosity_error()
    if name == "gpt2":
        cfg = T.GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=128, n_positions=32, resid_pdrop=0,
                           embd_pdrop=0, attn_pdrop=0, use_cache=False, bos_token_id=0, eos_token_id=0)
        return T.GPT2LMHeadModel(cfg)
    if name == "llama":
        cfg = T.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=128, max_position_embeddings=32, use_cache=False)
        return T.LlamaForCausalLM(cfg)
    if name == "bert":
        cfg = T.BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128,
                           vocab_size=128, max_position_embeddings=32, hidden_dropout_prob=0,
                           attention_probs_dropout_prob=0)
        return T.BertForMaskedLM(cfg)
    if name == "t5":
        cfg = T.T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=layers, num_decoder_layers=layers,
                         num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
        return T.T5ForConditionalGeneration(cfg)
    if name in FAMILIES:
        return FAMILIES[name](T)
    if name in MOE:
        return MOE[name](T)
    raise ValueError(name)


_D = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, max_position_embeddings=32)
FAMILIES = {  # more architectures sharing the building blocks above, tiny, dropout 0
    # decoders: rotary on part of the head and parallel attention/MLP (NeoX, Phi, GPT-J), GQA with
    # qkv bias (Qwen2), sliding-window GQA (Mistral), learned positions with an offset (OPT, tied)
    "gpt_neox": lambda T: T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
        **_D, intermediate_size=128, rotary_pct=0.5, use_cache=False, hidden_dropout=0, attention_dropout=0)),
    "qwen2": lambda T: T.Qwen2ForCausalLM(T.Qwen2Config(
        **_D, intermediate_size=128, num_key_value_heads=2, use_cache=False)),
    "mistral": lambda T: T.MistralForCausalLM(T.MistralConfig(
        **_D, intermediate_size=128, num_key_value_heads=2, sliding_window=8, use_cache=False)),
    "opt": lambda T: T.OPTForCausalLM(T.OPTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128, max_position_embeddings=32,
        ffn_dim=128, word_embed_proj_dim=64, dropout=0, attention_dropout=0, use_cache=False)),
    "phi": lambda T: T.PhiForCausalLM(T.PhiConfig(
        **_D, intermediate_size=128, partial_rotary_factor=0.5, resid_pdrop=0, embd_pdrop=0, attention_dropout=0,
        use_cache=False)),
    "gptj": lambda T: T.GPTJForCausalLM(T.GPTJConfig(
        n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=32, rotary_dim=8, resid_pdrop=0, embd_pdrop=0,
        attn_pdrop=0, use_cache=False)),
    # encoders related to BERT (MLM heads; RoBERTa's positions count non-padding tokens)
    "roberta": lambda T: T.RobertaForMaskedLM(T.RobertaConfig(
        **dict(_D, max_position_embeddings=40), intermediate_size=128, hidden_dropout_prob=0,
        attention_probs_dropout_prob=0)),
    "distilbert": lambda T: T.DistilBertForMaskedLM(T.DistilBertConfig(
        dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=128, max_position_embeddings=32, dropout=0,
        attention_dropout=0)),
    # shapes no mesh axis divides: vocabulary 131 (prime), batch 6 and sequence 15 (batch_for)
    "gpt2_uneven": lambda T: T.GPT2LMHeadModel(T.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=131, n_positions=32, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
        use_cache=False)),
    # vision: patch embedding by convolution, CLS token, classification head
    "vit": lambda T: T.ViTForImageClassification(T.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=32,
        patch_size=8, num_labels=10, hidden_dropout_prob=0, attention_probs_dropout_prob=0)),
}
ENCODERS = {"bert", "roberta", "distilbert"}
# mixtures of experts (tests/test_moe_rules.py), tiny: 4 experts, 2 per token, the router's
# load-balancing loss added to the LM loss; Qwen2-MoE with a gated shared expert beside them.
# transformers 5 runs the experts as one grouped matmul (transformers::grouped_mm_fallback on CPU)
_MOE = dict(_D, vocab_size=256, num_key_value_heads=2, num_experts_per_tok=2, output_router_logits=True,
            use_cache=False)
MOE = {
    "mixtral": lambda T: T.MixtralForCausalLM(T.MixtralConfig(**_MOE, intermediate_size=128, num_local_experts=4)),
    "qwen2_moe": lambda T: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
        **_MOE, intermediate_size=128, moe_intermediate_size=64, shared_expert_intermediate_size=128, num_experts=4)),
    # a shared expert beside 8 routed ones, top-4 by group-limited routing, the first layer dense
    "deepseek_v3": lambda T: T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        **dict(_MOE, num_experts_per_tok=4, num_key_value_heads=4), intermediate_size=128, moe_intermediate_size=32,
        n_routed_experts=8, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=2, q_lora_rank=None,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)),
}

EXPERT_PARALLEL = {  # mesh → (experts held and read, the experts' output): tokens and experts split together
    (4,): ("S0 -> S0", "S0"),
    (2, 2): ("S0(0) S0(1) -> S0(0) S0(1)", "S0(0) S0(1)"),  # all-to-all along both axes, one after the other
}
"""Constraints that force expert parallelism on a MOE model (``*.experts.gate_up_proj`` and
``down_proj`` held and read as the first, ``*.mlp.experts`` computed as the second)."""


class WithLoss(torch.nn.Module):
    """A classifier and its cross-entropy loss in one forward."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.model(x), y)


def _timm_vit():
    """timm's ViT-Tiny reduced: 32×32 images in 8×8 patches (16 tokens and the CLS token), 2
    blocks of width 64 with 4 heads, every dropout off."""
    import timm

    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                             embed_dim=64, num_heads=4, num_classes=10, drop_rate=0.0, pos_drop_rate=0.0,
                             patch_drop_rate=0.0, proj_drop_rate=0.0, attn_drop_rate=0.0, drop_path_rate=0.0)


def _timm_resnet18():
    """timm's ResNet-18 as it is (11.2 M parameters, BatchNorm in training mode)."""
    import timm

    return timm.create_model("resnet18", pretrained=False, num_classes=10)


TIMM = {"timm_vit": _timm_vit, "timm_resnet18": _timm_resnet18}  # inputs (x: N×3×32×32, y: N)


def build_model(name):
    """The model ``name`` of this file in training mode, weights from seed 0."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP()
    if name == "cnn":
        return CNN()
    if name in TIMM:
        return WithLoss(TIMM[name]()).train()
    return hf_model(name).train()


def batch_for(name, seed, batch=8, seq=16):
    g = torch.Generator().manual_seed(seed)
    if name in TIMM:
        return {"x": torch.randn(batch, 3, 32, 32, generator=g), "y": torch.randint(0, 10, (batch,), generator=g)}
    if name == "gpt2_uneven":
        batch, seq = 6, 15
    if name == "cnn":
        return {"x": torch.randn(batch, 3, 16, 16, generator=g), "y": torch.randint(0, 10, (batch,), generator=g)}
    if name == "mlp":
        return {"x": torch.randn(batch, 256, generator=g), "y": torch.randn(batch, 256, generator=g)}
    if name == "vit":
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=g),
                "labels": torch.randint(0, 10, (batch,), generator=g)}
    b = {"input_ids": torch.randint(0, 128, (batch, seq), generator=g),
         "labels": torch.randint(0, 128, (batch, seq if name != "t5" else seq - 4), generator=g)}
    if name in ENCODERS:
        b["attention_mask"] = torch.ones(batch, seq, dtype=torch.long)
        b["labels"][:, ::3] = -100  # MLM: most positions are ignored
    return b


def to_meta(batch):
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batch.items()}


class CheapComm(autoparallel.CostModel):
    """Communication at a thousandth of its price: on these toy models the planner then splits
    nearly every op it can, so that parity checks sharded layouts, not a replicated plan."""

    def collective_time(self, kind, axis, nbytes):
        return 1e-3 * super().collective_time(kind, axis, nbytes)

    def grad_reduction_time(self, axis, nbytes):
        return 1e-3 * super().grad_reduction_time(axis, nbytes)
