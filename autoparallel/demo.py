"""The built-in demo models and the training recipe's settings, shared by the command line
(``python -m autoparallel``) and ``examples/train.py``.

A demo model is a Hugging Face architecture (GPT-2, Llama, BERT) built from a config with
random weights: on the meta device to plan, on the CPU (seeded, the same on every rank) to
train. Nothing is downloaded. Each has a TOML table of its own in a config file
(``[model]``, ``[train]``: :data:`autoparallel.config.SECTIONS`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal

import torch

from .config import ConfigError, check_keys, read_toml

MODELS = ("gpt2", "llama", "bert")


@dataclass(frozen=True)
class ModelConfig:
    """A demo model (Hugging Face architecture, random weights) and its batch.

    Raises (on construction):
        ConfigError: a size below 1, heads that do not divide ``hidden`` or ``kv_heads`` that do
            not divide ``heads``.
    """

    model: Literal[MODELS] = "gpt2"
    """architecture: gpt2, llama or bert (built from a config, random weights)"""
    factory: str | None = None
    """package.module:function returning (model, meta_inputs), instead of --model"""
    layers: int = 2
    """transformer layers"""
    hidden: int = 256
    """hidden size"""
    heads: int = 4
    """attention heads (they divide --hidden)"""
    kv_heads: int | None = None
    """llama's key/value heads (they divide --heads); default: --heads"""
    vocab: int = 1024
    """vocabulary size"""
    batch: int = 8
    """global batch: sequences per step over all devices"""
    seq: int = 128
    """tokens per sequence"""

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "vocab", "batch", "seq"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, not {v!r}")
        if self.hidden % self.heads:
            raise ConfigError(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ConfigError(f"kv_heads ({self.kv_heads}) must be a positive divisor of heads ({self.heads})")
        if self.factory is not None and ":" not in self.factory:
            raise ConfigError(f"factory {self.factory!r}: expected package.module:function")

    @classmethod
    def from_toml(cls, path) -> "ModelConfig":
        """The ``[model]`` table of a config file (all defaults when it has none)."""
        return cls(**check_keys(cls, read_toml(path).get("model", {}), f"{path} [model]"))

    def build(self, device: str = "meta", seed: int = 0):
        """``(model, example_inputs)``: the model on ``device`` (random weights from ``seed``, the
        same on every rank; dropout 0 so that a step is a function of the weights and the batch)
        and meta inputs of the global batch (``input_ids`` and ``labels``).

        Raises:
            ConfigError: a factory that cannot be imported or found.
        """
        if self.factory:
            mod, _, fn = self.factory.partition(":")
            try:
                return getattr(importlib.import_module(mod), fn)()
            except (ImportError, AttributeError) as e:
                raise ConfigError(f"factory {self.factory!r}: {e}") from None
        import transformers as T

        T.logging.set_verbosity_error()
        positions = max(self.seq, 32)
        if self.model == "gpt2":
            cfg = T.GPT2Config(n_layer=self.layers, n_embd=self.hidden, n_head=self.heads, vocab_size=self.vocab,
                               n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               use_cache=False, bos_token_id=0, eos_token_id=0)
            cls = T.GPT2LMHeadModel
        elif self.model == "llama":
            cfg = T.LlamaConfig(num_hidden_layers=self.layers, hidden_size=self.hidden,
                                num_attention_heads=self.heads, num_key_value_heads=self.kv_heads or self.heads,
                                intermediate_size=4 * self.hidden, vocab_size=self.vocab,
                                max_position_embeddings=positions, use_cache=False)
            cls = T.LlamaForCausalLM
        else:
            cfg = T.BertConfig(num_hidden_layers=self.layers, hidden_size=self.hidden, num_attention_heads=self.heads,
                               intermediate_size=4 * self.hidden, vocab_size=self.vocab,
                               max_position_embeddings=positions, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0)
            cls = T.BertForMaskedLM
        torch.manual_seed(seed)
        with torch.device(device):
            model = cls(cfg)
        ids = torch.empty(self.batch, self.seq, dtype=torch.long, device="meta")
        return model, {"input_ids": ids, "labels": ids.clone()}


@dataclass(frozen=True)
class TrainConfig:
    """The training recipe of ``examples/train.py`` (``python -m autoparallel train``).

    Raises (on construction):
        ConfigError: a non-positive step count, learning rate or clipping norm; ``save_at``
            outside the run.
    """

    steps: int = 10
    """optimizer steps to run (in all, counting those before a resumed checkpoint)"""
    lr: float = 1e-3
    """peak learning rate of AdamW"""
    weight_decay: float = 0.01
    """AdamW's weight decay"""
    warmup: int = 2
    """steps of linear warm-up, then cosine decay to 10 % of lr at the last step"""
    clip: float = 1.0
    """clip the gradients' global norm to this"""
    seed: int = 0
    """seed of the weights and of the synthetic data"""
    samples: int = 256
    """sequences in the synthetic dataset (random tokens with a learnable pattern)"""
    checkpoint_dir: str | None = None
    """folder of the torch.distributed.checkpoint saves (default: none saved or loaded)"""
    save_at: int | None = None
    """save a checkpoint after this many steps (needs --checkpoint-dir)"""
    resume: bool = False
    """resume from the checkpoint in --checkpoint-dir (its step, weights, optimizer, scheduler)"""
    log_every: int = 1
    """print the loss every this many steps (rank 0)"""

    def __post_init__(self):
        for name in ("steps", "log_every", "samples"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, not {v!r}")
        for name in ("lr", "clip"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ConfigError(f"{name} must be a positive number, not {v!r}")
        if self.warmup < 0 or self.weight_decay < 0:
            raise ConfigError("warmup and weight_decay must not be negative")
        if self.save_at is not None and not 0 < self.save_at <= self.steps:
            raise ConfigError(f"save_at must be a step in 1..steps ({self.steps}), not {self.save_at!r}")
        if (self.save_at is not None or self.resume) and not self.checkpoint_dir:
            raise ConfigError("save_at and resume need checkpoint_dir")

    @classmethod
    def from_toml(cls, path) -> "TrainConfig":
        """The ``[train]`` table of a config file (all defaults when it has none)."""
        return cls(**check_keys(cls, read_toml(path).get("train", {}), f"{path} [train]"))
