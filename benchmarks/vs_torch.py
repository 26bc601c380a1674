"""Training step time and peak memory of autoparallel next to PyTorch's hand-written recipes.

Models (Hugging Face architectures built from a config, random weights seeded alike, dropout 0,
AdamW, the loss of the model's own ``labels=`` path):

* ``gpt2``: GPT-2, 4 layers x 256 hidden, 4 heads, vocabulary 2048;
* ``llama``: Llama, 4 layers x 256 hidden, 8 heads / 4 key-value heads, MLP 688, vocabulary 2048;
* ``mixtral`` (only with ``--models mixtral``): Mixtral, 4 layers x 256 hidden, 8 heads / 4
  key-value heads, 8 experts of MLP 512, each token routed to 2, vocabulary 2048, no router
  loss (``output_router_logits=False``);

global batch 8 x 128 tokens. One row per variant and configuration (world size and mesh):

* ``eager``: the plain model on one device (world 1 only);
* ``autoparallel``: ``autoparallelize(model, meta_inputs, device_mesh=mesh)``, parallelism "auto";
* ``autoparallel data``: the same with ``parallelism="data"``;
* ``DDP``: ``DistributedDataParallel``, each rank its share of the global batch;
* ``FSDP2``: ``torch.distributed.fsdp.fully_shard`` on every transformer block, then the root;
* ``TP``: Megatron tensor parallelism with ``parallelize_module``: q/k/v and gate/up
  ``ColwiseParallel``, o and down ``RowwiseParallel``; every rank the whole batch;
* ``FSDP2+TP`` (mesh (2, 2)): TP over the second mesh axis, then ``fully_shard`` over the first.

Mixtral's rows (E experts, W ranks): eager and autoparallel (world 1), then autoparallel,
``autoparallel EP``, DDP, FSDP2 and ``torch EP + DDP`` (no autoparallel data, TP or FSDP2+TP):

* ``autoparallel EP``: expert parallelism forced by ``constraints=``: ``*.experts.gate_up_proj``
  and ``*.experts.down_proj`` held and read split by expert (``"S0 -> S0"``), ``*.mlp.experts``
  computed so (``"S0"``; on (2, 2) over both axes, ``"S0(0) S0(1)"``): every rank E/W experts,
  the tokens sent to their expert's rank by all-to-all;
* ``torch EP + DDP``: expert parallelism by hand, torchtitan's way (:func:`ep_module`): every
  rank E/W experts (its slice of ``gate_up_proj`` and ``down_proj`` along dim 0), each experts
  module's forward replaced by :func:`ep_forward` (the (token, expert) pairs sorted by expert,
  the counts exchanged, the token rows sent to their expert's rank and back with
  ``all_to_all_single``), the other parameters under DDP, which ignores the experts'; the expert
  gradients divided by W (each sums every rank's local-mean loss). With ``--quick``, a note says
  whether one AdamW step leaves the all-gathered experts those of the single-device model.

The autoparallel rows of Mixtral are planned with the batch's routing (:func:`routing_imbalance`,
measured by the single-device model) as the cost model's ``expert_imbalance``: the busiest
device's experts set the pace of every layer, on both sides; ``--balanced`` prices it even.

Configurations: world 1, mesh (1,) (eager against autoparallel); world 2, mesh (2,); world 4,
meshes (4,) and (2, 2) (DDP, FSDP2 and torch EP + DDP run over all 4 ranks and appear under
both). Each world size is one ``torchrun`` job; inside it every variant is built up front,
warmed up, then timed in interleaved rounds (each round times ``--steps`` steps of every variant
in turn, the order rotating from round to round); the step time is the median over rounds of
the slowest rank's mean step. A step is forward, backward, ``optimizer.step()``,
``zero_grad(set_to_none=True)``; ``fwd+bwd`` is its forward and backward part; the plan's
estimate (``plan.estimate.step_time_s``) predicts the whole step, the optimizer step included.

Peak memory per device, the largest rank: on CUDA, ``torch.cuda.max_memory_allocated`` over the
variant's warm-up steps (counter reset once it is built) minus what was allocated before it was
built, so the variants built earlier do not count and what the variant keeps (parameters, DDP's
buckets, optimizer states) does; on CPU, ``MemTracker`` (``torch.distributed._tools.mem_tracker``)
over one more steady-state step: the module's parameters, gradients and optimizer states plus
every tensor the step allocates through torch's dispatcher (buffers that c10d/gloo allocate
internally are not seen; DDP's gradient buckets, allocated by its reducer in C++, are counted: a
backward before the tracked step leaves the gradients as views of them). The ``loss0`` column is
the step-0 loss of the global batch (the mean over the data-parallel ranks where each holds a
share): every variant starts from the same weights and must match the eager model (``(!)`` where
it does not).

    python benchmarks/vs_torch.py                     # every model, worlds 1, 2 and 4: one table
    python benchmarks/vs_torch.py --quick             # tiny sizes, few steps (a smoke run)
    python benchmarks/vs_torch.py --models llama --worlds 2 --json out.json
    python benchmarks/vs_torch.py --models mixtral --worlds 2,4   # the mixture-of-experts rows
    torchrun --standalone --nproc-per-node 2 benchmarks/vs_torch.py --models gpt2   # one job, its table

Pipeline rows (``--pipeline``; world 4, GPT-2 of 8 layers, otherwise the sizes above): on meshes
(2, 2) with axes ``("pp", "dp")`` and (4,) with ``("pp",)``,

* ``autoparallel``: ``autoparallelize(model, meta_inputs, device_mesh=mesh, schedule="1F1B",
  microbatches=M)``, trained with ``loss = model.step(**batch)``, every rank the global batch;
* ``autoparallel ZB``: the same with ``schedule="InterleavedZeroBubble"`` (two stages per rank,
  each backward split into its input and weight halves);
* ``torch PP + DDP`` / ``torch PP``: the hand-written ``torch.distributed.pipelining`` recipe
  (torchtitan's way): the layers split evenly, each rank a deep copy of the model with the other
  stages' blocks deleted and the embeddings (but on the first stage) and final norm and head
  (but on the last) set to ``None`` (:class:`GPT2Stage`), under DDP over ``dp`` (nothing on
  pp=4), in a ``PipelineStage`` driven by ``Schedule1F1B`` over the same M microbatches (each
  ``dp`` rank its share of the batch), the loss :func:`causal_lm_loss` of the logits and the
  labels passed as ``target`` on the last stage. GPT-2 ties its token embedding to its head:
  both sides untie it (first stage ``wte``, last stage ``lm_head``, the same starting values)
  and sum the two gradients after every backward, which is what the tied model computes;
* ``torch PP ZB + dp`` / ``torch PP ZB``: the same recipe under ``ScheduleInterleavedZeroBubble``,
  the layers split evenly into two stages per rank (stage ``i`` on pp rank ``i % pp``), each
  stage's gradients all-reduced over ``dp`` after the schedule in one flat buffer (DDP's hooks
  never see the weight gradients the split backward computes with ``torch.autograd.grad``):
  ``autoparallel ZB`` is compared with it, like for like.

Their step is the schedule's forward and backward of every microbatch, then AdamW. Under the
table, per rank, where the step went (forward and backward chunks, point-to-point waits and
posts, the rest, the optimizer) as timed inside the pipelining runtime both rows run, and the
plan's per-stage times, p2p time and bubble beside it. Peak memory is not measured there.
``--microbatches`` (default 4) and ``--schedule`` (1F1B or GPipe) set both sides.

    python benchmarks/vs_torch.py --pipeline           # world 4: meshes (2, 2) pp,dp and (4,) pp
    python benchmarks/vs_torch.py --pipeline --quick   # tiny hidden size, few steps

Targets (printed, not asserted): autoparallel data <= 1.05x DDP; autoparallel <= 1.0x the best
hand-written recipe of its configuration (``autoparallel ZB``: the hand-written zero-bubble
one); the estimate within +-25 % of the measured step; on a 1-device mesh the emitted module within 5 % of the eager model.

Cost model: ``--cost-model default`` passes none, so autoparallelize prices the mesh as
``autoparallel.profile_mesh`` measures it (collective times per mesh axis and the device's
achieved rates, measured on first use and cached in the plan cache folder); ``--cost-model
cpu|a100|h100`` plans with that preset and the default links of ``MeshSpec`` instead. The
latency and bandwidth each plan used are printed above the table.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import autoparallel  # noqa: E402  (before transformers' model classes: see README, torchvision)

SEED = 0
LR = 1e-4
EP_RECIPE = "torch EP + DDP"
RECIPES = ("DDP", "FSDP2", "TP", "FSDP2+TP", EP_RECIPE)
OPTIMIZER_IMPLEMENTATIONS = ("foreach", "for-loop")
"""``--optimizer``: AdamW's ``foreach=True`` or ``False``, on every row. Foreach is the default
because it is torch's on CUDA, where these recipes train; on CPU torch picks the per-tensor
loop, under which each of a step's ~10 ops per parameter pays DTensor's dispatch (about 3x the
plain tensors' step on this machine: docs/design.md, "The optimizer as it is built")."""
AUTO = ("autoparallel", "autoparallel data")
GPT2_TP_NA = ("HF GPT-2's c_attn, c_proj and c_fc are transformers Conv1D modules (weight stored in x out), "
              "which ColwiseParallel/RowwiseParallel cannot shard (nn.Linear and nn.Embedding only), and c_attn "
              "fuses q, k and v and splits them at a fixed split_size")


# --------------------------------------------------------------------------- models

def model_sizes(name: str, quick: bool) -> dict:
    if quick:
        common = dict(layers=2, hidden=64, vocab=256, batch=8, seq=32)
    else:
        common = dict(layers=4, hidden=256, vocab=2048, batch=8, seq=128)
    if name == "gpt2":
        return dict(common, heads=4)
    if name == "llama":
        return dict(common, heads=8, kv_heads=4, intermediate=176 if quick else 688)
    if name == "mixtral":
        return dict(common, heads=8, kv_heads=4, intermediate=128 if quick else 512, experts=8, top_k=2)
    raise ValueError(f"unknown model {name!r}; choose gpt2, llama or mixtral")


def build_model(name: str, quick: bool, sizes: dict | None = None):
    """The model (seeded: the same weights on every rank and for every variant) and its sizes
    (``sizes``, default :func:`model_sizes`)."""
    import transformers as T

    T.logging.set_verbosity_error()
    s = sizes or model_sizes(name, quick)
    if name == "gpt2":
        cfg = T.GPT2Config(n_layer=s["layers"], n_embd=s["hidden"], n_head=s["heads"], vocab_size=s["vocab"],
                           n_positions=s["seq"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                           summary_first_dropout=0.0, use_cache=False)
        cls = T.GPT2LMHeadModel
    elif name == "mixtral":
        cfg = T.MixtralConfig(num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                              num_key_value_heads=s["kv_heads"], intermediate_size=s["intermediate"],
                              num_local_experts=s["experts"], num_experts_per_tok=s["top_k"], vocab_size=s["vocab"],
                              max_position_embeddings=s["seq"], attention_dropout=0.0, use_cache=False,
                              output_router_logits=False)
        cls = T.MixtralForCausalLM
    else:
        cfg = T.LlamaConfig(num_hidden_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
                            num_key_value_heads=s["kv_heads"], intermediate_size=s["intermediate"],
                            vocab_size=s["vocab"], max_position_embeddings=s["seq"], attention_dropout=0.0,
                            use_cache=False)
        cls = T.LlamaForCausalLM
    torch.manual_seed(SEED)
    model = cls(cfg)
    model.train()
    return model, s


def layers(model):
    """The ``nn.ModuleList`` of transformer blocks (what FSDP2 wraps one by one)."""
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def blocks(model):
    """The transformer blocks, a list."""
    return list(layers(model))


def global_batch(s: dict, device) -> dict:
    g = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}  # HF shifts the labels itself


def rows_of(batch: dict, index: int, parts: int) -> dict:
    n = batch["input_ids"].shape[0] // parts
    return {k: v[index * n:(index + 1) * n] for k, v in batch.items()}


# --------------------------------------------------------------------------- variants

class Variant:
    """One way to train the model: module, optimizer, the batch this rank passes."""

    def __init__(self, name, mesh, configs, module=None, batch=None, kind="recipe", na=None, mean_loss=False,
                 optimizer=None):
        self.name, self.mesh, self.configs, self.kind, self.na = name, mesh, configs, kind, na
        self.module, self.batch, self.mean_loss = module, batch, mean_loss
        self.optimizer_factory = optimizer  # (parameters, foreach) -> optimizer; default AdamW
        self.optimizer = None
        self.estimate = None          # autoparallel: plan.estimate.step_time_s
        self.est_parts = {}           # autoparallel: compute_s, comm_s, peak_memory_bytes of the estimate
        self.plan_s = None
        self.step_s, self.fb_s = [], []
        self.peak_bytes = None
        self.host_params = ()         # offload: parameters whose shards, gradients and states are host memory
        self.host_peak_bytes = None   # CPU, with host_params: the peak of what is held in host memory
        self.loss0 = None
        self.error = None
        self.hold_outputs = False     # keep the module's outputs through the step, as a loop reading logits does
        self.fwd_bwd = None           # pipelined: () -> loss, the schedule's forward and backward of the batch
        self.loss_value = None        # pipelined: loss -> float, the batch's loss (called on the first step only)
        self.pp_rank = None           # pipelined: this rank's coordinate along the pipeline axis
        self.note = None              # a line for the table's notes

    def make_optimizer(self, foreach: bool):
        """The variant's optimizer, ``foreach=`` as given (:data:`OPTIMIZER_IMPLEMENTATIONS`),
        but the per-tensor loop where the parameters mix DTensors and plain tensors (TP by
        ``parallelize_module`` leaves the norms plain), which torch's foreach ops refuse."""
        from torch.distributed.tensor import DTensor

        if foreach and len({isinstance(p, DTensor) for p in self.module.parameters()}) > 1:
            foreach = False
            self.note = f"{self.name}: AdamW's per-tensor loop (its parameters mix DTensors and plain tensors)"
        make = self.optimizer_factory or (lambda params, foreach: torch.optim.AdamW(params, lr=LR, foreach=foreach))
        self.optimizer = make(self.module.parameters(), foreach)

    def forward_backward(self):
        """The step's forward and backward; returns the loss."""
        if self.fwd_bwd is not None:
            return self.fwd_bwd()
        out = self.module(**self.batch)
        loss = out.loss
        if not self.hold_outputs:
            del out
        loss.backward()
        return loss

    def step(self, sync) -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = self.forward_backward()
        sync()
        t1 = time.perf_counter()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        if self.loss0 is None:
            self.loss0 = self.loss_value(loss) if self.loss_value else float(loss.detach().float().item())
        return t2 - t0, t1 - t0


def tp_plan(model):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i, _ in enumerate(blocks(model)):
        p = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[p + name] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[p + name] = RowwiseParallel()
    return plan


def tp_na_reason(name: str, s: dict, tp: int) -> str | None:
    if name == "gpt2":
        return GPT2_TP_NA
    for what in ("heads", "kv_heads", "intermediate"):
        if s[what] % tp:
            return f"{what} {s[what]} is not divisible by the TP degree {tp}"
    return None


def ddp_module(model, dev):
    """A copy of ``model`` under ``DistributedDataParallel``, gradients as views of its buckets."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(copy.deepcopy(model).to(dev), device_ids=[dev.index] if dev.type == "cuda" else None,
               gradient_as_bucket_view=True)


def fsdp_module(model, dev, mesh, checkpoint=False, **options):
    """A copy of ``model`` under FSDP2: ``fully_shard(block, mesh=mesh, **options)`` on every
    transformer block, then on the root; with ``checkpoint``, every block first wrapped in
    ``checkpoint_wrapper`` (its activations recomputed in the backward)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import fully_shard

    module = copy.deepcopy(model).to(dev)
    if checkpoint:
        stack = layers(module)
        for i, block in enumerate(stack):
            stack[i] = checkpoint_wrapper(block)
    for block in blocks(module):
        fully_shard(block, mesh=mesh, **options)
    fully_shard(module, mesh=mesh, **options)
    return module


def cost_model_of(args, device_mesh, expert_imbalance: float = 1.0):
    """The cost model ``args`` names: ``None`` for ``default`` (autoparallelize profiles the
    mesh), else the preset; with ``expert_imbalance`` other than 1, that routing set on it (on
    the profiled one for ``default``)."""
    if args.cost_model == "default" and expert_imbalance == 1.0:
        return None
    if args.cost_model == "default":
        cm = autoparallel.CostModel.from_profile(
            autoparallel.profile_mesh(device_mesh, cache_dir=False if args.no_cache else None))
    else:
        cm = autoparallel.CostModel(args.cost_model)
    cm.expert_imbalance = expert_imbalance
    return cm


def autoparallel_variant(args, name, model, batch, device_mesh, mesh_label, expert_imbalance: float = 1.0,
                         **options) -> Variant:
    """``autoparallelize`` on a copy of ``model`` with ``options`` and the cost model ``args``
    names (:func:`cost_model_of`), every rank passing the global ``batch``; a failure is the
    row's ``na``, with the error."""
    v = Variant(name, mesh_label, [mesh_label], batch=batch, kind="autoparallel")
    meta = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in batch.items()}
    cm = cost_model_of(args, device_mesh, expert_imbalance)
    if cm is not None:
        options["cost_model"] = cm
    options.setdefault("optimizer_foreach", args.optimizer == "foreach")  # priced and counted as built
    if args.no_cache:
        options["cache_dir"] = False
    t0 = time.perf_counter()
    try:
        v.module = autoparallel.autoparallelize(copy.deepcopy(model).to(next(iter(batch.values())).device), meta,
                                                device_mesh=device_mesh, **options)
    except Exception as e:  # noqa: BLE001  (reported in the table, the other rows still run)
        v.na = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:600]}"
    v.plan_s = time.perf_counter() - t0
    if v.module is not None:
        est = v.module.plan.estimate
        v.estimate = float(est.step_time_s)
        v.est_parts = {k: getattr(est, k) for k in ("compute_s", "comm_s", "peak_memory_bytes")}
        v.est_parts["forward_collectives"] = len(v.module.plan.collectives)
        v.est_parts["mesh_spec"] = v.module.plan.mesh.to_json()
    return v


def world_meshes(device_type, world) -> dict:
    """The meshes a world size is measured on, shape -> DeviceMesh (axes ``dp``, ``tp``): (1,);
    (2,); (world,) and (2, world // 2)."""
    from torch.distributed.device_mesh import init_device_mesh

    shapes = [(1,)] if world == 1 else [(2,)] if world == 2 else [(world,), (2, world // 2)]
    return {m: init_device_mesh(device_type, m, mesh_dim_names=("dp", "tp")[:len(m)]) for m in shapes}


def mesh_label(shape) -> str:
    return str(shape).replace(" ", "")


def build_variants(args, model_name, model, s, batch, device_type, rank, world):
    """Every variant of this world size, built one at a time as the caller asks for the next
    (a generator, so that each is measured right after it is built); the model's own weights are
    copied, never trained."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    dev = batch["input_ids"].device
    if world == 1:
        yield Variant("eager", "(1,)", ["(1,)"], copy.deepcopy(model).to(dev), batch, kind="eager")
    device_meshes = world_meshes(device_type, world)
    meshes = list(device_meshes)
    labels = {m: mesh_label(m) for m in meshes}
    flat = [labels[m] for m in meshes]

    # autoparallel: every rank passes the global batch
    for m in meshes:
        for name, parallelism in (("autoparallel", "auto"), ("autoparallel data", "data")):
            if world == 1 and parallelism == "data":
                continue
            yield autoparallel_variant(args, name, model, batch, device_meshes[m], labels[m], parallelism=parallelism)
    if world == 1:
        return

    # data parallel recipes over all ranks: each rank its share of the global batch
    local = rows_of(batch, rank, world)
    yield Variant("DDP", f"({world},)", flat, ddp_module(model, dev), local, mean_loss=True)
    yield Variant("FSDP2", f"({world},)", flat, fsdp_module(model, dev, device_meshes[(world,)]), local,
                  mean_loss=True)

    # Megatron TP over all ranks (every rank the global batch)
    reason = tp_na_reason(model_name, s, world)
    if reason:
        yield Variant("TP", f"({world},)", [labels[(world,)]], na=reason)
    else:
        tp = parallelize_module(copy.deepcopy(model).to(dev), device_meshes[(world,)], tp_plan(model))
        yield Variant("TP", f"({world},)", [labels[(world,)]], tp, batch)
        del tp

    # FSDP2 + TP on the 2-D mesh: TP over "tp", fully_shard over "dp"
    if len(meshes) > 1:
        m2 = meshes[1]
        reason = tp_na_reason(model_name, s, m2[1])
        if reason:
            yield Variant("FSDP2+TP", labels[m2], [labels[m2]], na=reason)
        else:
            mesh2 = device_meshes[m2]
            both = parallelize_module(copy.deepcopy(model).to(dev), mesh2["tp"], tp_plan(model))
            for block in blocks(both):
                fully_shard(block, mesh=mesh2["dp"])
            fully_shard(both, mesh=mesh2["dp"])
            dp_index = mesh2.get_coordinate()[0]
            yield Variant("FSDP2+TP", labels[m2], [labels[m2]], both, rows_of(batch, dp_index, m2[0]),
                          mean_loss=True)


# --------------------------------------------------------------------------- mixture-of-experts rows

MOE_MODELS = ("mixtral",)


def ep_constraints(shape) -> dict:
    """autoparallelize's constraints forcing expert parallelism over every axis of the mesh
    ``shape``: the experts held and read split by expert (dim 0), the routed experts computed
    split alike, the tokens sent to their expert's rank by all-to-all."""
    split = "S0" if len(shape) == 1 else " ".join(f"S0({i})" for i in range(len(shape)))
    return {"*.experts.gate_up_proj": f"{split} -> {split}", "*.experts.down_proj": f"{split} -> {split}",
            "*.mlp.experts": split}


def experts_modules(module) -> list:
    """The routed-experts modules (``MixtralExperts``) of ``module``, in order."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    return [m for m in module.modules() if isinstance(m, MixtralExperts)]


def local_experts(experts, x, counts: list[int]):
    """This rank's experts on the rows routed to them: ``x`` (R, H) grouped by local expert,
    ``counts[e]`` rows of expert e (E/W counts, summing to R); each group through
    ``down[e] @ (silu(gate[e] @ x) * (up[e] @ x))``, ``gate_up_proj`` (E/W, 2I, H) gate rows
    first, ``down_proj`` (E/W, H, I). Returns (R, H)."""
    outs = []
    for e, rows in enumerate(x.split(counts)):
        gate, up = (rows @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up) @ experts.down_proj[e].T)
    return torch.cat(outs)


def routing_imbalance(model, batch, devices: int) -> float:
    """How unevenly ``model``'s routers spread ``batch`` over ``devices`` devices holding
    ``E / devices`` consecutive experts each, as expert parallelism places them: per layer, the
    busiest device's (token, expert) pairs over the mean, averaged over the layers (each layer
    waits for its busiest device at its all-to-all). Computed by the single-device model."""
    loads = []

    def count(module, args, kwargs, out):
        top_k_index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        n = module.gate_up_proj.shape[0]
        per_device = torch.bincount(top_k_index.reshape(-1), minlength=n).view(devices, n // devices).sum(1)
        loads.append(float(per_device.max() / per_device.float().mean()))

    hooks = [m.register_forward_hook(count, with_kwargs=True) for m in experts_modules(model)]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return statistics.mean(loads)


def ep_forward(experts, group, x, top_k_index, top_k_weights):
    """The routed experts, expert parallel over ``group`` (W ranks, rank r holding experts
    [r E/W, (r+1) E/W) in ``experts``), as torchtitan dispatches: the (token, expert) pairs sorted
    by expert, the counts per expert exchanged, each pair's token row sent to its expert's rank
    (all-to-all with autograd), the rows computed there (:func:`local_experts`), sent back, put
    in pair order and summed over k with the routing weights. ``x`` (T, H), ``top_k_index`` and
    ``top_k_weights`` (T, k); returns (T, H)."""
    from torch.distributed.nn.functional import all_to_all_single

    world = dist.get_world_size(group)
    n_local = experts.gate_up_proj.shape[0]
    tokens, k = top_k_index.shape
    flat = top_k_index.reshape(-1)                                   # (T k,): pair t k + j -> its expert
    order = flat.argsort(stable=True)                                # pairs by expert, so by destination
    sent = torch.bincount(flat, minlength=world * n_local)           # (E,) pairs per expert
    got = torch.empty_like(sent)                                     # (W E/W,) pairs from rank src for local e
    dist.all_to_all_single(got, sent, group=group)
    send_splits = sent.view(world, n_local).sum(1).tolist()
    recv_splits = got.view(world, n_local).sum(1).tolist()
    rows = x[order // k]                                             # (T k, H)
    recv = all_to_all_single(x.new_empty(sum(recv_splits), x.shape[1]), rows, recv_splits, send_splits,
                             group=group)                            # (R, H): by source rank, then local expert
    expert_of = torch.arange(n_local, device=x.device).repeat(world).repeat_interleave(got)  # (R,)
    by_expert = expert_of.argsort(stable=True)
    out = local_experts(experts, recv[by_expert], got.view(world, n_local).sum(0).tolist())[by_expert.argsort()]
    back = all_to_all_single(torch.empty_like(rows), out, send_splits, recv_splits, group=group)  # (T k, H)
    pairs = back[order.argsort()].view(tokens, k, -1)               # (T, k, H)
    return (pairs * top_k_weights.unsqueeze(-1).to(pairs.dtype)).sum(1)


def ep_module(model, dev, group):
    """A copy of ``model`` with expert parallelism by hand over ``group`` (W ranks): every
    routed-experts module holds this rank's E/W experts (rank r: ``gate_up_proj`` and
    ``down_proj`` rows [r E/W, (r+1) E/W)) and runs :func:`ep_forward`; the rest under
    ``DistributedDataParallel``, which ignores the experts' parameters and averages the other
    gradients. An expert's gradient sums every rank's local-mean loss over the tokens routed to
    it, W times the global batch's: a hook divides it by W as it is computed, so that the step
    is the single-device model's on the global batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    module = copy.deepcopy(model).to(dev)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    names = {id(m): n for n, m in module.named_modules()}
    ignored = []
    for m in experts_modules(module):
        n_local = m.gate_up_proj.shape[0] // world
        for attr in ("gate_up_proj", "down_proj"):
            p = torch.nn.Parameter(getattr(m, attr)[rank * n_local:(rank + 1) * n_local].detach().clone())
            p.register_hook(lambda g: g / world)
            setattr(m, attr, p)
            ignored.append(f"{names[id(m)]}.{attr}")
        m.forward = functools.partial(ep_forward, m, group)
    DDP._set_params_and_buffers_to_ignore_for_model(module, ignored)
    return DDP(module, device_ids=[dev.index] if dev.type == "cuda" else None, gradient_as_bucket_view=True)


def gathered(t, group):
    """Every rank's experts: ``t`` (E/W, ...) gathered along dim 0 over ``group``, (E, ...)."""
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts)


def largest_relative_difference(mine: list, want: list, group) -> float:
    """Over pairs of tensors, ``mine`` this rank's experts (E/W, ...) and ``want`` all of them
    (E, ...): the largest max |gathered - want| / max |want|."""
    return max(float((gathered(a, group) - b).abs().max() / b.abs().max()) for a, b in zip(mine, want))


def expert_step(module, batch) -> tuple[list, list]:
    """One AdamW step of ``module`` on ``batch``: the experts' gradients, then their weights
    after the step (``gate_up_proj`` and ``down_proj`` of every experts module, in order)."""
    params = [getattr(m, a) for m in experts_modules(module) for a in ("gate_up_proj", "down_proj")]
    opt = torch.optim.AdamW(module.parameters(), lr=LR)
    module(**batch).loss.backward()
    grads = [p.grad.clone() for p in params]
    opt.step()
    return grads, [p.detach() for p in params]


def ep_step_check(model, batch, dev, group, rtol=1e-5) -> str:
    """A line saying whether one AdamW step of :func:`ep_module` (each rank its share of
    ``batch``) leaves the experts' weights, all-gathered, those of the single-device model after
    its step on the whole batch: the largest |difference| over the largest |value| of each
    tensor, at most ``rtol``; the gradients' likewise (AdamW's first step hardly depends on the
    gradients' scale: they are the stricter check)."""
    ref = expert_step(copy.deepcopy(model).to(dev), batch)
    ep = expert_step(ep_module(model, dev, group),
                     rows_of(batch, dist.get_rank(group), dist.get_world_size(group)))
    grad_err, weight_err = (largest_relative_difference(mine, want, group) for mine, want in zip(ep, ref))
    ok = max(grad_err, weight_err) <= rtol
    return (f"{EP_RECIPE}: after one AdamW step the all-gathered expert weights {'match' if ok else 'DO NOT match'} "
            f"the single-device model's (largest relative difference: weights {weight_err:.1e}, gradients "
            f"{grad_err:.1e}; tolerance {rtol:g})")


def build_moe_variants(args, model_name, model, s, batch, device_type, rank, world):
    """The mixture-of-experts rows of this world size, one at a time (as :func:`build_variants`):
    per mesh, ``autoparallel`` (the planner's choice) and ``autoparallel EP`` (expert parallelism
    forced by :func:`ep_constraints`), every rank passing the global batch; then over all ranks,
    each its share of the batch, DDP, FSDP2 and :func:`ep_module` (with ``--quick``, its
    :func:`ep_step_check` line in the notes). World 1: the eager model and autoparallel."""
    dev = batch["input_ids"].device
    if world == 1:
        yield Variant("eager", "(1,)", ["(1,)"], copy.deepcopy(model).to(dev), batch, kind="eager")
    device_meshes = world_meshes(device_type, world)
    balanced = getattr(args, "balanced", False)
    imbalance = 1.0 if balanced else routing_imbalance(copy.deepcopy(model).to(dev), batch, world)
    for m, mesh in device_meshes.items():
        v = autoparallel_variant(args, "autoparallel", model, batch, mesh, mesh_label(m), imbalance,
                                 parallelism="auto")
        if imbalance != 1.0:
            v.note = (f"planned with expert_imbalance={imbalance:.3f}: the batch's routing over {world} devices "
                      f"(the busiest device's pairs over the mean, per layer, averaged)")
        yield v
        if world > 1:
            yield autoparallel_variant(args, "autoparallel EP", model, batch, mesh, mesh_label(m), imbalance,
                                       constraints=ep_constraints(m))
    if world == 1:
        return
    flat = [mesh_label(m) for m in device_meshes]
    local = rows_of(batch, rank, world)
    yield Variant("DDP", f"({world},)", flat, ddp_module(model, dev), local, mean_loss=True)
    yield Variant("FSDP2", f"({world},)", flat, fsdp_module(model, dev, device_meshes[(world,)]), local,
                  mean_loss=True)
    group = device_meshes[(world,)].get_group()
    v = Variant(EP_RECIPE, f"({world},)", flat, ep_module(model, dev, group), local, mean_loss=True)
    if args.quick:
        v.note = ep_step_check(model, batch, dev, group)
    yield v


# --------------------------------------------------------------------------- pipeline rows

PIPE_RECIPE = "torch PP"
PIPE_ZB = "autoparallel ZB"
PIPE_RECIPE_ZB = PIPE_RECIPE + " ZB"
PIPE_MESHES = {4: [((2, 2), ("pp", "dp")), ((4,), ("pp",))]}


def pipeline_sizes(name: str, quick: bool) -> dict:
    """The pipeline rows' model: :func:`model_sizes` with 8 layers (``--quick`` too: autoparallel
    cuts stages in a list of at least 6 alike layers)."""
    return dict(model_sizes(name, quick), layers=8)


def even_boundaries(n_layers: int, stages: int) -> list[int]:
    """``stages + 1`` layer indices splitting ``n_layers`` as evenly as they go (the extra layers
    to the first stages), as torchtitan's default split does."""
    base, extra = divmod(n_layers, stages)
    out = [0]
    for s in range(stages):
        out.append(out[-1] + base + (1 if s < extra else 0))
    return out


class GPT2Stage(torch.nn.Module):
    """One pipeline stage of a Hugging Face ``GPT2LMHeadModel`` by module surgery, as torchtitan
    splits its models: a deep copy of the whole model, the transformer blocks of other stages
    deleted (those kept under their original indices, a ``ModuleDict``), the embeddings set to
    ``None`` but on the first stage, the final norm and head but on the last. The forward runs
    what remains, as ``GPT2Model.forward`` does (positions 0..seq-1, the causal mask of
    ``create_causal_mask``); the last stage returns the logits.

    The token embedding and the head share one weight in the model; the copies untie them: the
    first stage holds it as ``transformer.wte.weight``, the last as ``lm_head.weight`` (the same
    values, both copies of the model's), and the recipe sums their gradients after every
    backward (:func:`pipeline_recipe`), so that they stay equal under the optimizer, as the
    tied weight of the unsplit model would be."""

    def __init__(self, model, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        m = copy.deepcopy(model)
        t = m.transformer
        t.h = torch.nn.ModuleDict({str(i): t.h[i] for i in range(lo, hi)})
        if not first:
            t.wte = t.wpe = None
        if not last:
            t.ln_f = None
            m.lm_head = None
        self.model = m

    def forward(self, x):
        from transformers.masking_utils import create_causal_mask

        t = self.model.transformer
        seq = x.shape[1]
        pos = torch.arange(seq, device=x.device).unsqueeze(0)
        if t.wte is not None:
            x = t.drop(t.wte(x) + t.wpe(pos))
        mask = create_causal_mask(config=self.model.config, inputs_embeds=x, attention_mask=None, cache=None,
                                  position_ids=pos)
        for block in t.h.values():
            x = block(x, None, mask, position_ids=pos)
        if t.ln_f is not None:
            x = self.model.lm_head(t.ln_f(x))
        return x


def causal_lm_loss(logits, target):
    """The schedule's ``loss_fn`` on the last stage: what ``GPT2LMHeadModel(labels=)`` computes
    (next-token cross entropy, mean over the microbatch's predicted tokens, in float32)."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), target[:, 1:].flatten())


def pipeline_recipe(model, s, batch, mesh, dev, microbatches: int, schedule: str, label: str) -> Variant:
    """The hand-written pipelining recipe on ``mesh`` (axis ``pp``, optionally ``dp``): the layers
    split evenly (:func:`even_boundaries`) into one stage per rank, or two for a schedule of
    several stages per rank (torch's ``PipelineScheduleMulti``: stage ``i`` on pp rank ``i % pp``),
    each a :class:`GPT2Stage` in a ``PipelineStage``, driven by ``schedule`` (``Schedule1F1B``,
    ``ScheduleInterleavedZeroBubble``, ...) over ``microbatches``, the loss :func:`causal_lm_loss`
    of the logits and the labels passed as ``target`` on the last stage. Each ``dp`` rank passes
    its share of the global batch; its stages run under ``DistributedDataParallel`` over ``dp``
    (nothing on a one-device submesh), but under a zero-bubble schedule, whose weight gradients
    come from ``torch.autograd.grad`` and never reach DDP's hooks: there each stage's gradients
    are all-reduced over ``dp`` after the schedule, in one flat buffer per stage, and averaged.
    The tied embedding/head weight's gradients are summed over the first and last stage (one
    all-reduce per ``dp`` coordinate)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class
    from torch.nn.parallel import DistributedDataParallel as DDP

    from autoparallel.pipeline_plan import ZERO_BUBBLE

    names = mesh.mesh_dim_names
    pp = mesh.size(names.index("pp"))
    pp_rank = mesh.get_local_rank("pp")
    dp = mesh.size(names.index("dp")) if "dp" in names else 1
    dp_rank = mesh.get_local_rank("dp") if "dp" in names else 0
    pp_group = mesh.get_group("pp")
    cls = get_schedule_class(schedule)
    n = pp * (2 if issubclass(cls, PipelineScheduleMulti) else 1)
    bounds = even_boundaries(s["layers"], n)
    first, last = pp_rank == 0, pp_rank == pp - 1  # the ranks of stage 0 and stage n - 1
    mine = list(range(pp_rank, n, pp))
    stages = [GPT2Stage(model, bounds[i], bounds[i + 1], i == 0, i == n - 1).to(dev) for i in mine]
    ddp = dp > 1 and schedule not in ZERO_BUBBLE
    modules = [DDP(st, process_group=mesh.get_group("dp"), gradient_as_bucket_view=True,
                   device_ids=[dev.index] if dev.type == "cuda" else None) if ddp else st for st in stages]
    pstages = [PipelineStage(m, i, n, dev, group=pp_group) for m, i in zip(modules, mine)]
    sched = cls(pstages if n > pp else pstages[0], n_microbatches=microbatches, loss_fn=causal_lm_loss,
                scale_grads=True)
    # the tied weight: one group per dp coordinate, [first stage's rank, last stage's rank]
    grid = mesh.mesh.reshape(pp, dp)
    tie_group, _ = dist.new_subgroups_by_enumeration([[int(grid[0, c]), int(grid[-1, c])] for c in range(dp)])
    tied = stages[0].model.transformer.wte.weight if first else stages[-1].model.lm_head.weight if last else None
    local = rows_of(batch, dp_rank, dp)

    def reduce_over_dp():
        for st in stages:
            grads = [p.grad for p in st.parameters() if p.grad is not None]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=mesh.get_group("dp"))
            flat /= dp
            for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(reduced)

    def fwd_bwd():
        losses = []
        if first:
            sched.step(local["input_ids"], target=local["labels"] if last else None, losses=losses)
        elif last:
            sched.step(target=local["labels"], losses=losses)
        else:
            sched.step()
        if dp > 1 and not ddp:
            reduce_over_dp()
        if tied is not None:
            dist.all_reduce(tied.grad, group=tie_group)
        return losses

    def loss_value(losses):
        loss = torch.stack([x.detach() for x in losses]).mean().float() if last else torch.zeros((), device=dev)
        dist.broadcast(loss, group_src=pp - 1, group=pp_group)
        return float(loss.item())

    name = (PIPE_RECIPE_ZB if schedule in ZERO_BUBBLE else PIPE_RECIPE) + (" + DDP" if ddp else " + dp" if dp > 1 else "")
    v = Variant(name, label, [label], modules[0] if len(modules) == 1 else torch.nn.ModuleList(modules), local,
                mean_loss=True)
    v.fwd_bwd, v.loss_value, v.pp_rank = fwd_bwd, loss_value, pp_rank
    v.est_parts["pipeline"] = {"boundaries": bounds, "microbatches": microbatches, "schedule": schedule}
    return v


def pipeline_parts(pl) -> dict:
    """What the JSON keeps of a ``PipelinePlan``."""
    return {"boundaries": list(pl.boundaries), "microbatches": pl.microbatches, "schedule": pl.schedule,
            "stage_s": list(pl.stage_s), "p2p_s": pl.p2p_s, "bubble": pl.bubble, "step_s": pl.step_s,
            "stage_peak_bytes": list(pl.stage_peak_bytes), "mesh_spec": pl.mesh.to_json()}


def build_pipeline_variants(args, model_name, model, s, batch, device_type, rank, world):
    """The pipeline rows of this world size (4): per mesh, (pp=2, dp=2) then pp=4, autoparallel
    pinned to the recipe's schedule and microbatches, every rank passing the global batch, then
    the hand-written recipe (:func:`pipeline_recipe`)."""
    from torch.distributed.device_mesh import init_device_mesh

    if world not in PIPE_MESHES:
        raise SystemExit(f"--pipeline runs on world 4 (meshes (2, 2) pp,dp and (4,) pp), not {world}")
    dev = batch["input_ids"].device
    for shape, names in PIPE_MESHES[world]:
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        label = str(shape).replace(" ", "") + " " + ",".join(names)
        for name, schedule in (("autoparallel", args.schedule), (PIPE_ZB, "InterleavedZeroBubble")):
            v = autoparallel_variant(args, name, model, batch, mesh, label, schedule=schedule,
                                     microbatches=args.microbatches)
            if v.module is not None:
                pmodel = v.module
                v.fwd_bwd = lambda pmodel=pmodel, b=batch: pmodel.step(**b)
                v.pp_rank = mesh.get_local_rank("pp")
                pl = pmodel.plan.pipeline
                if pl is None:
                    v.na = "failed: the plan has no pipeline stages"
                    v.module = None
                else:
                    v.est_parts["pipeline"] = pipeline_parts(pl)
            yield v
        if model_name != "gpt2":
            yield Variant(PIPE_RECIPE, label, [label], na="the hand-written stage split is written for GPT-2 only")
            continue
        yield pipeline_recipe(model, s, batch, mesh, dev, args.microbatches, args.schedule, label)
        yield pipeline_recipe(model, s, batch, mesh, dev, args.microbatches, "InterleavedZeroBubble", label)


class StageClock:
    """Seconds this rank spends, while :attr:`on`, in the pieces of ``torch.distributed.pipelining``
    that both pipeline rows run: ``forward_one_chunk`` (a microbatch's forward of the stage),
    ``backward_one_chunk`` (its backward; the last one includes DDP's gradient all-reduce) and
    the schedule's ``_wait_batch_p2p`` (waiting for sends and receives: the transfer and the
    time the neighbour stage is still computing, the bubble included) and ``_batch_p2p``
    (posting them; gloo may send there)."""

    def __init__(self):
        from torch.distributed.pipelining import schedules, stage

        self.on = False
        self.t = {"fwd": 0.0, "bwd": 0.0, "wait": 0.0, "post": 0.0}
        base = stage._PipelineStageBase
        for cls_, name, key in ((base, "forward_one_chunk", "fwd"), (base, "backward_one_chunk", "bwd"),
                                (schedules, "_wait_batch_p2p", "wait"), (schedules, "_batch_p2p", "post")):
            setattr(cls_, name, self._timed(getattr(cls_, name), key))

    def _timed(self, fn, key):
        def timed(*a, **k):
            if not self.on:
                return fn(*a, **k)
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.t[key] += time.perf_counter() - t0
        return timed


_CLOCK = None


def stage_times(variants: list[Variant], args, dev, world) -> None:
    """Per pipelined variant, ``args.steps`` more steps with a :class:`StageClock` on: every
    rank's seconds per step in forward chunks, backward chunks and point-to-point waits, the
    rest of its forward and backward (loss, the tied weight's gradient sum, the schedule's
    bookkeeping) and the optimizer step, kept in ``est_parts["measured_stages"]`` (one row per
    rank: pp coordinate, fwd, bwd, wait, post, other, optimizer, step)."""
    global _CLOCK
    _CLOCK = _CLOCK or StageClock()
    do_sync = sync(dev)
    for v in variants:
        if v.module is None or v.fwd_bwd is None:
            continue
        dist.barrier()
        _CLOCK.t = dict.fromkeys(_CLOCK.t, 0.0)
        _CLOCK.on = True
        steps, fbs = [], []
        for _ in range(args.steps):
            t, fb = v.step(do_sync)
            steps.append(t)
            fbs.append(fb)
        _CLOCK.on = False
        n = args.steps
        fwd, bwd, wait, post = (_CLOCK.t[k] / n for k in ("fwd", "bwd", "wait", "post"))
        fb, step = sum(fbs) / n, sum(steps) / n
        mine = torch.zeros(world, 8, dtype=torch.float64, device=dev)
        mine[dist.get_rank()] = torch.tensor([v.pp_rank, fwd, bwd, wait, post, fb - fwd - bwd - wait - post,
                                              step - fb, step])
        dist.all_reduce(mine)
        v.est_parts["measured_stages"] = mine.tolist()


def sync(dev):
    if dev.type == "cuda":
        return torch.cuda.synchronize
    return lambda: None


# --------------------------------------------------------------------------- measuring

def measure_peak_cpu(v: Variant) -> int:
    """The peak bytes MemTracker records over one more step of ``v`` (warmed up, optimizer
    states present) on the device. On a CPU host and device are one memory: what ``v`` holds
    in host memory (``v.host_params``: their shards, gradients and optimizer states) is
    counted apart, its peak kept as ``v.host_peak_bytes``."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(v.module, DDP):
        # DDP's reducer keeps every gradient in buckets it allocates in C++, for the module's
        # lifetime, which MemTracker does not see (it would count a bucket only once a gradient
        # hook fires, after the peak at the start of the backward): a backward outside the
        # tracker leaves the gradients as views of the buckets, zeroed rather than freed, so that
        # the tracker counts them from the start
        v.forward_backward()
        v.optimizer.zero_grad(set_to_none=False)
    tracker = MemTracker()
    # ZeroRedundancyOptimizer holds its shard's states in the optimizer it wraps
    optimizer = getattr(v.optimizer, "optim", v.optimizer)
    tracker.track_external(v.module, optimizer, *v.batch.values())
    states = [t for p in v.host_params for t in optimizer.state.get(p, {}).values() if torch.is_tensor(t)]
    on_host(tracker, list(v.host_params) + states)
    hooks = [p.register_post_accumulate_grad_hook(lambda p: on_host(tracker, [p.grad])) for p in v.host_params]
    try:
        with tracker:
            v.step(lambda: None)
    finally:
        for h in hooks:
            h.remove()
    snap = tracker.get_tracker_snapshot("peak")
    if v.host_params:
        v.host_peak_bytes = int(snap.get(HOST, {}).get("Total", 0))
    return int(sum(d.get("Total", 0) for dev, d in snap.items() if dev != HOST))


HOST = "host"  # MemTracker's account of host-held tensors on a CPU (measure_peak_cpu)


def on_host(tracker, tensors) -> None:
    """Move ``tensors``' storages from the device's account of ``tracker`` (a ``MemTracker``)
    to :data:`HOST`'s, where its peak is taken apart; tracked first if they were not. Reads
    MemTracker's bookkeeping (``_WINFO``, ``_update_snap``; torch 2.13), which has no public
    way to tell two memories of one device apart."""
    from torch.distributed._tools.common_utils import get_untyped_storages
    from torch.distributed._tools.mem_tracker import _MemRefType, _UpdateType

    for t in tensors:
        storages = get_untyped_storages(t)
        if not any(st in tracker._WINFO for st in storages):
            tracker._update_and_maybe_create_winfos(t, _MemRefType.OTH)
        for st in storages:
            winfo, _ = tracker._WINFO.get(st, (None, None))
            if winfo is None or winfo.device == HOST:
                continue
            if winfo.mem_consumed:
                tracker._update_snap(_UpdateType.DEL, winfo)
            winfo.device = HOST
            if winfo.mem_consumed:
                tracker._update_snap(_UpdateType.ADD, winfo)


def run_worker(args, run_model_fn=None) -> list[dict] | None:
    """One torchrun job: every model of ``--models`` in turn on this world size, each measured
    by ``run_model_fn`` (default :func:`run_model`); the results on rank 0 (``None`` on the
    others)."""
    backend = "nccl" if torch.cuda.is_available() and args.device != "cpu" else "gloo"
    device_type = "cuda" if backend == "nccl" else "cpu"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    if device_type == "cuda" and torch.cuda.device_count() < local_world:
        raise SystemExit(f"{local_world} processes on this node but {torch.cuda.device_count()} GPUs: NCCL needs one "
                         "GPU per process; use fewer processes (--worlds) or --device cpu (gloo)")
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    rank, world = dist.get_rank(), dist.get_world_size()
    if device_type == "cpu":
        torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    dev = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    results = []
    for name in args.models.split(","):
        results.append((run_model_fn or run_model)(args, name, dev, rank, world))
        gc.collect()
        if device_type == "cuda":
            torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    return results if rank == 0 else None


def run_model(args, model_name, dev, rank, world) -> dict:
    pipeline = getattr(args, "pipeline", False)
    model, s = build_model(model_name, args.quick, pipeline_sizes(model_name, args.quick) if pipeline else None)
    batch = global_batch(s, dev)
    with torch.no_grad():
        ref_loss = float(copy.deepcopy(model).to(dev)(**batch).loss.item())
    build = build_pipeline_variants if pipeline else build_moe_variants if model_name in MOE_MODELS else build_variants
    variants = build_and_measure(build(args, model_name, model, s, batch, dev.type, rank, world), args, dev)
    time_rounds(variants, args, dev, world)
    if pipeline:
        stage_times(variants, args, dev, world)
    return dict(job_record(args, model_name, s, dev, world), ref_loss=ref_loss,
                variants=[variant_record(v) for v in variants])


def build_and_measure(builder, args, dev) -> list[Variant]:
    """Take the variants ``builder`` yields one at a time: give each its optimizer, warm it up
    and measure its peak memory before the next is built (so that a generator can read a
    variant's peak, gathered over ranks with :func:`max_over_ranks`, before it builds the
    next). Peak memory: on CUDA from before the variant is built (the ones built earlier stay
    constant) through its warm-up steps, the peak counter reset after building (a full copy of
    the model may pass through the device while a variant is built, which is not a training
    step's memory); on CPU :func:`measure_peak_cpu`, this rank's."""
    device_type, do_sync = dev.type, sync(dev)
    variants = []
    while True:
        gc.collect()
        if device_type == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
        v = next(builder, None)
        if v is None:
            return variants
        variants.append(v)
        if v.module is None:
            continue
        gc.collect()
        v.make_optimizer(args.optimizer == "foreach")
        if device_type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(args.warmup):
            v.step(do_sync)
        if device_type == "cuda":
            torch.cuda.synchronize()
            v.peak_bytes = torch.cuda.max_memory_allocated() - before
        elif v.fwd_bwd is not None:
            # under MemTracker's dispatch mode, torch.distributed.pipelining's point-to-point waits of the
            # middle stages (pp=4) never complete on gloo (seen with torch 2.13): no CPU peak for these rows
            v.peak_bytes = None
        else:
            try:
                v.peak_bytes = measure_peak_cpu(v)
            except Exception as e:  # noqa: BLE001  (reported in the notes)
                v.error = f"MemTracker: {type(e).__name__}: {e}"


def max_over_ranks(values, dev) -> list[float]:
    """The largest of each value over the ranks (one all-reduce)."""
    t = torch.tensor([float(x) for x in values], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def time_rounds(variants: list[Variant], args, dev, world) -> None:
    """Time the built variants in interleaved rounds (each round ``args.steps`` steps of every
    variant in turn, the order rotating from round to round), then keep on every variant the
    slowest rank's time of each round, the largest rank's peak and, where ranks hold shares of
    the batch, the mean step-0 loss."""
    do_sync = sync(dev)
    live = [v for v in variants if v.module is not None]
    for r in range(args.rounds):
        order = live[r % len(live):] + live[:r % len(live)] if live else []
        for v in order:
            dist.barrier()
            do_sync()
            steps, fbs = [], []
            for _ in range(args.steps):
                t, fb = v.step(do_sync)
                steps.append(t)
                fbs.append(fb)
            v.step_s.append(statistics.fmean(steps))
            v.fb_s.append(statistics.fmean(fbs))
    if not live:
        return
    t = torch.tensor([[*v.step_s, *v.fb_s] for v in live], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    peaks = max_over_ranks([v.peak_bytes or 0 for v in live] + [v.host_peak_bytes or 0 for v in live], dev)
    losses = torch.tensor([v.loss0 for v in live], dtype=torch.float64, device=dev)
    dist.all_reduce(losses, op=dist.ReduceOp.SUM)
    for i, v in enumerate(live):
        row = t[i].tolist()
        v.step_s, v.fb_s = row[:args.rounds], row[args.rounds:]
        v.peak_bytes = int(peaks[i]) if v.peak_bytes is not None else None
        v.host_peak_bytes = int(peaks[len(live) + i]) if v.host_peak_bytes is not None else None
        if v.mean_loss:
            v.loss0 = float(losses[i].item()) / world
        # else every rank computed the loss of the global batch (checked equal below on rank 0)


def job_record(args, model_name, s, dev, world) -> dict:
    """What a job's result says of where and how it measured."""
    return {
        "model": model_name, "world": world, "device": torch.cuda.get_device_name() if dev.type == "cuda"
        else f"cpu ({torch.get_num_threads()} threads per process)",
        "backend": dist.get_backend(), "sizes": s, "quick": args.quick, "rounds": args.rounds, "steps": args.steps,
        "warmup": args.warmup, "optimizer": args.optimizer, "memory": "torch.cuda.max_memory_allocated" if dev.type == "cuda" else "MemTracker",
        "cost_model": args.cost_model, "pipeline": bool(getattr(args, "pipeline", False))}


def variant_record(v: Variant) -> dict:
    """One variant's measurements, as the JSON output keeps them."""
    return {
        "name": v.name, "mesh": v.mesh, "configs": v.configs, "kind": v.kind, "na": v.na,
        "step_s": statistics.median(v.step_s) if v.step_s else None,
        "fwd_bwd_s": statistics.median(v.fb_s) if v.fb_s else None,
        "rounds_step_s": v.step_s, "estimate_s": v.estimate, "estimate_parts": v.est_parts,
        "plan_s": v.plan_s, "peak_bytes": v.peak_bytes, "host_peak_bytes": v.host_peak_bytes, "loss0": v.loss0,
        "error": v.error, "note": v.note}


# --------------------------------------------------------------------------- the table

def fmt_s(x):
    """Seconds as ms below 10 s; empty for None."""
    return "" if x is None else f"{x * 1e3:.1f} ms" if x < 10 else f"{x:.1f} s"


def table(results: list[dict]) -> str:
    """One table over every job: a block of rows per model and mesh, targets under it."""
    try:
        from tabulate import tabulate
    except ImportError:  # pragma: no cover (tabulate is a dependency of the project)
        tabulate = None
    hdr = ["model", "config", "variant", "mesh", "s/step (median)", "fwd+bwd", "optimizer", "estimate", "est/meas",
           "peak MiB", "loss0", "vs DDP", "vs best recipe"]
    rows, notes, checks = [], [], []
    for res in results:
        configs = []
        for v in res["variants"]:
            for c in v["configs"]:
                if c not in configs:
                    configs.append(c)
        for c in configs:
            vs = [v for v in res["variants"] if c in v["configs"]]
            ddp = next((v["step_s"] for v in vs if v["name"] == "DDP" and v["step_s"]), None)
            eager = next((v["step_s"] for v in vs if v["name"] == "eager" and v["step_s"]), None)
            rec = [v for v in vs if (v["name"] in RECIPES or v["name"].startswith(PIPE_RECIPE)) and v["step_s"]]
            best = min(rec, key=lambda v: v["step_s"]) if rec else None
            cfg = f"world {res['world']}, mesh {c}"
            for v in vs:
                if v["na"]:
                    rows.append([res["model"], cfg, v["name"], v["mesh"], "n/a", "", "", "", "", "", "", "", ""])
                    note = f"{res['model']} {v['name']}: n/a: {v['na']}"
                    if note not in notes:
                        notes.append(note)
                    continue
                t, fb, est = v["step_s"], v["fwd_bwd_s"], v["estimate_s"]
                ok_loss = abs(v["loss0"] - res["ref_loss"]) <= 1e-4 * abs(res["ref_loss"]) + 1e-5
                rows.append([
                    res["model"], cfg, v["name"], v["mesh"], fmt_s(t), fmt_s(fb), fmt_s(t - fb), fmt_s(est),
                    f"{est / t:.2f}" if est and t else "",
                    f"{v['peak_bytes'] / 2**20:.1f}" if v["peak_bytes"] else "?",
                    f"{v['loss0']:.4f}" + ("" if ok_loss else " (!)"),
                    f"{t / ddp:.2f}x" if ddp else "",
                    f"{t / best['step_s']:.2f}x" if best else (f"{t / eager:.2f}x eager" if eager else ""),
                ])
                if not ok_loss:
                    notes.append(f"{res['model']} {v['name']} {v['mesh']}: step-0 loss {v['loss0']:.6f} differs from "
                                 f"the eager model's {res['ref_loss']:.6f}")
                if v["error"]:
                    notes.append(f"{res['model']} {v['name']} {v['mesh']}: {v['error']}")
                note = v.get("note") and f"{res['model']} world {res['world']} {v['note']}"
                if note and note not in notes:
                    notes.append(note)
                if est and t:
                    err = est / t - 1
                    checks.append(f"{res['model']} {cfg}: {v['name']} estimate {fmt_s(est)} vs measured step "
                                  f"{fmt_s(t)} ({100 * err:+.0f}%; target within 25%: "
                                  f"{'OK' if abs(err) <= 0.25 else 'MISSED'})")
            by = {v["name"]: v for v in vs if v["step_s"]}
            if "autoparallel data" in by and ddp:
                r = by["autoparallel data"]["step_s"] / ddp
                checks.append(f"{res['model']} {cfg}: autoparallel data / DDP = {r:.2f}x "
                              f"(target <= 1.05x: {'OK' if r <= 1.05 else 'MISSED'})")
            if "autoparallel" in by and best:
                r = by["autoparallel"]["step_s"] / best["step_s"]
                checks.append(f"{res['model']} {cfg}: autoparallel / best recipe ({best['name']}) = {r:.2f}x "
                              f"(target <= 1.0x: {'OK' if r <= 1.0 else 'MISSED'})")
            pipe = next((v for n, v in by.items() if n.startswith(PIPE_RECIPE) and not n.startswith(PIPE_RECIPE_ZB)),
                        None)
            pipe_zb = next((v for n, v in by.items() if n.startswith(PIPE_RECIPE_ZB)), None)
            if PIPE_ZB in by and pipe_zb:  # like for like: the same schedule by hand
                r = by[PIPE_ZB]["step_s"] / pipe_zb["step_s"]
                checks.append(f"{res['model']} {cfg}: {PIPE_ZB} / {pipe_zb['name']} = {r:.2f}x "
                              f"(target <= 1.0x: {'OK' if r <= 1.0 else 'MISSED'})")
            if "autoparallel" in by and pipe:
                a, h = by["autoparallel"]["loss0"], pipe["loss0"]
                same = abs(a - h) <= 1e-4 * abs(h) + 1e-5
                checks.append(f"{res['model']} {cfg}: step-0 loss autoparallel {a:.6f}, {pipe['name']} {h:.6f} "
                              f"({'the same' if same else 'DIFFERENT'})")
            for v in vs:
                pl = (v.get("estimate_parts") or {}).get("pipeline")
                if pl and not v["na"]:
                    line = f"{res['model']} {cfg} {v['name']}: layers split {pl['boundaries']}, " \
                           f"{pl['microbatches']} microbatches, {pl['schedule']}"
                    if "stage_s" in pl:
                        line += (f"; planned: per stage fwd+bwd of a microbatch "
                                 f"{', '.join(fmt_s(x) for x in pl['stage_s'])}, p2p {fmt_s(pl['p2p_s'])}, "
                                 f"bubble {pl['bubble']:.2f}, step {fmt_s(pl['step_s'])}")
                    notes.append(line)
                ms = (v.get("estimate_parts") or {}).get("measured_stages")
                if ms and not v["na"]:
                    notes.append(f"{res['model']} {cfg} {v['name']}: measured per rank and step (stage: forward "
                                 "chunks + backward chunks + p2p waits + p2p posts + rest of fwd+bwd | optimizer = "
                                 "step): " + "; ".join(
                                     f"rank {r} (stage {int(row[0])}): "
                                     + " + ".join(f"{1e3 * x:.1f}" for x in row[1:6])
                                     + f" | {1e3 * row[6]:.1f} = {1e3 * row[7]:.1f} ms" for r, row in enumerate(ms)))
            if "autoparallel" in by and eager:
                r = by["autoparallel"]["step_s"] / eager
                checks.append(f"{res['model']} {cfg}: autoparallel / eager = {r:.2f}x "
                              f"(target <= 1.05x: {'OK' if r <= 1.05 else 'MISSED'})")
    if tabulate:
        out = tabulate(rows, hdr, tablefmt="simple", disable_numparse=True)
    else:  # pragma: no cover
        out = "\n".join(" | ".join(map(str, r)) for r in [hdr] + rows)
    r0 = results[0] if results else {}
    links = []
    for res in results:
        for v in res["variants"]:
            parts = v.get("estimate_parts") or {}
            ms = (parts.get("pipeline") or {}).get("mesh_spec") or parts.get("mesh_spec")  # the whole mesh
            if ms and ms["shape"] != [1]:
                line = (f"mesh {tuple(ms['shape'])}: " + ", ".join(
                    f"{n} {a * 1e6:.0f} us + {1e-9 / b:.2f} GB/s" for n, a, b in zip(ms["axis_names"], ms["alpha"],
                                                                                  ms["beta"])))
                if line not in links:
                    links.append(line)
    head = "\n".join([
        f"device: {', '.join(sorted({str(r.get('device')) for r in results}))}; backend "
        f"{', '.join(sorted({str(r.get('backend')) for r in results}))}",
        f"s/step: median over {r0.get('rounds')} interleaved rounds of the slowest rank's mean over {r0.get('steps')} "
        f"steps, after {r0.get('warmup')} warm-up steps; a step is forward, backward, AdamW step "
        f"({r0.get('optimizer')}, every row), zero_grad; "
        f"fwd+bwd is its first part, optimizer the rest (medians' difference)",
        "estimate: plan.estimate.step_time_s (forward, backward and optimizer step), est/meas = estimate / "
        "measured s/step; "
        f"cost model: {r0.get('cost_model')}" + (f"; links as planned: {'; '.join(links)}" if links else ""),
        f"peak MiB: per device, largest rank, {r0.get('memory')}; loss0: the step-0 loss of the global batch "
        "(must equal the eager model's)",
        f"vs DDP / vs best recipe: s/step over DDP's / over the fastest of {', '.join(RECIPES)} (pipeline "
        f"rows: {PIPE_RECIPE}, torch.distributed.pipelining by hand) in the same configuration"])
    if any(r.get("pipeline") for r in results):
        head += ("\npipeline rows: autoparallelize(..., device_mesh=pp mesh, schedule=, microbatches=) next to "
                 f"{PIPE_RECIPE} (torch.distributed.pipelining by hand: the layers split evenly by module surgery, a "
                 "PipelineStage per rank, DDP over dp); a step is the schedule's forward and backward of every "
                 "microbatch, then AdamW; the cost model 'default' is autoparallelize's own (profile_mesh's tables, the "
                 "stage solve priced by its submesh's); peak memory is not measured (MemTracker "
                 "hangs the schedule's point-to-point waits)")
    parts = [head, out]
    if checks:
        parts.append("targets:\n" + "\n".join("  " + c for c in checks))
    if notes:
        parts.append("notes:\n" + "\n".join("  " + n for n in notes))
    return "\n\n".join(parts)


# --------------------------------------------------------------------------- driver

def arg_parser(description: str, models: str = "gpt2,llama", worlds: str = "1,2,4") -> argparse.ArgumentParser:
    """The options every benchmark built on this script's machinery takes (a caller may add its own)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--models", default=models, help="comma-separated: gpt2, llama and/or mixtral"
                    + (f" (default {models})" if models else ""))
    ap.add_argument("--worlds", default=worlds, help="driver: comma-separated world sizes (1, 2, 4)"
                    + (f" (default {worlds})" if worlds else ""))
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few steps (smoke run)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved timing rounds (default 7, quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="steps per variant per round (default 3, quick 1)")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up steps per variant (default 3, quick 2)")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads per process (default cores / world)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu"], help="cpu forces gloo on CPU")
    ap.add_argument("--cost-model", default="default", choices=["default", "cpu", "a100", "h100"],
                    help="default: autoparallelize's own (the mesh as profile_mesh measures it); else a preset")
    ap.add_argument("--no-cache", action="store_true", help="plan with cache_dir=False")
    ap.add_argument("--json", default=None, help="write the results (a list of jobs) to this file")
    ap.add_argument("--timeout", type=float, default=3600, help="driver: seconds per torchrun job")
    ap.add_argument("--optimizer", default="foreach", choices=OPTIMIZER_IMPLEMENTATIONS,
                    help="AdamW's implementation on every row, planned for alike: foreach (torch's default on CUDA; "
                         "the default here) or for-loop (torch's default on CPU)")
    return ap


def finish_args(args):
    """Fill in the defaults that depend on ``--quick``."""
    if args.rounds is None:
        args.rounds = 2 if args.quick else 7
    if args.steps is None:
        args.steps = 1 if args.quick else 3
    if args.warmup is None:
        args.warmup = 2 if args.quick else 3
    args.warmup = max(args.warmup, 2)  # the CPU peak is taken on a step after optimizer states exist
    return args


def parse_args(argv=None):
    ap = arg_parser(__doc__.splitlines()[0], models=None, worlds=None)
    ap.add_argument("--pipeline", action="store_true",
                    help="the pipeline rows instead: world 4, meshes (2, 2) pp,dp and (4,) pp, autoparallel next to "
                         "torch.distributed.pipelining by hand (default models gpt2, worlds 4)")
    ap.add_argument("--microbatches", type=int, default=4, help="--pipeline: microbatches of both sides (default 4)")
    ap.add_argument("--schedule", default="1F1B", choices=["1F1B", "GPipe"],
                    help="--pipeline: the schedule of both sides (default 1F1B)")
    ap.add_argument("--balanced", action="store_true",
                    help="mixtral: plan with routing priced balanced (default: the batch's routing imbalance, "
                         "measured by the single-device model, as the cost model's expert_imbalance)")
    args = ap.parse_args(argv)
    if args.models is None:
        args.models = "gpt2" if args.pipeline else "gpt2,llama"
    if args.worlds is None:
        args.worlds = "4" if args.pipeline else "1,2,4"
    return finish_args(args)


def worker_argv(args) -> list[str]:
    """The options the driver passes on to each torchrun job."""
    out = ["--models", args.models, "--rounds", str(args.rounds), "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--device", args.device, "--cost-model", args.cost_model, "--optimizer", args.optimizer]
    if getattr(args, "pipeline", False):
        out += ["--pipeline", "--microbatches", str(args.microbatches), "--schedule", args.schedule]
    if args.quick:
        out.append("--quick")
    if args.threads:
        out += ["--threads", str(args.threads)]
    if args.no_cache:
        out.append("--no-cache")
    if getattr(args, "balanced", False):
        out.append("--balanced")
    return out


def drive(args, script=__file__, passthrough=worker_argv, render=None) -> int:
    """One torchrun job per world size of ``script`` (every model inside it; its worker options
    ``passthrough(args)``), then one table, ``render(results)`` (default :func:`table`)."""
    results, failed = [], []
    for world in (int(w) for w in args.worlds.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                   os.path.abspath(script), "--json", out, *passthrough(args)]
            print(f"[{time.strftime('%H:%M:%S')}] world {world}: torchrun {' '.join(cmd[3:])}", flush=True)
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      timeout=args.timeout)
                output, code = proc.stdout, proc.returncode
            except subprocess.TimeoutExpired as e:
                output, code = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) \
                    else (e.stdout or ""), f"timed out after {args.timeout:.0f} s"
            if code != 0 or not os.path.exists(out):
                print(output[-4000:], flush=True)
                failed.append(f"world {world} (exit {code})")
                continue
            with open(out) as f:
                results.extend(json.load(f))
            print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    order = args.models.split(",")
    results.sort(key=lambda r: (order.index(r["model"]) if r["model"] in order else len(order), r["world"]))
    print()
    print((render or table)(results), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if failed:
        print("\nFAILED jobs: " + ", ".join(failed), flush=True)
        return 1
    return 0


def main(argv=None) -> int:
    return run_script(parse_args(argv))


def run_script(args, run_model_fn=None, render=None, passthrough=worker_argv, script=__file__) -> int:
    """In a torchrun worker, this world size's job (:func:`run_worker`); else the driver
    (:func:`drive`). A benchmark built on this machinery passes its own ``run_model_fn``,
    ``render`` (a table from a list of job results), worker options and script."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a torchrun worker: this world size
        res = run_worker(args, run_model_fn)
        if res is not None:
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1)
            else:
                print((render or table)(res), flush=True)
        # Past the process group's teardown, skip interpreter finalization: gloo's worker threads
        # can abort it ("terminate called without an active exception", pytorch#179291), which
        # torchrun would report as a failed job after every result was written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return drive(args, script, passthrough, render)


if __name__ == "__main__":
    sys.exit(main())
