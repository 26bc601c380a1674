"""The memory model at LLM scale and against measurement under data-parallel, FSDP and
tensor-parallel plans; the default memory budget (docs/design.md, "Memory")."""

import math

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import autoparallel
from autoparallel.graph import output_leaves
from autoparallel.options import PlanOptions
from autoparallel.solver.pipeline import plan_traced
from autoparallel.placement import Replicate, Shard, local_shape
from autoparallel.plan import returned_spec
from autoparallel.solver.costs import PRESETS
from autoparallel.solver.memory import RESERVE_FRACTION, MemoryModel, device_capacity, host_memory, resolve_budget
from autoparallel.strategies import StrategyGenerator
from autoparallel.tracer import ColoTracer
from models import ShardParams, batch_for, hf_model, to_meta

GIB = 2 ** 30


def _llama_vocab_128k(layers=2):
    """Llama-3-8B's width, heads and vocabulary on the meta device, ``layers`` deep."""
    import transformers as T

    T.logging.set_verbosity_error()
    with torch.device("meta"):
        return T.LlamaForCausalLM(T.LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers, num_attention_heads=32,
            num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, use_cache=False))


def test_cross_entropy_saves_the_log_probabilities_once_and_split():
    """The loss's saved log-softmax is one tensor the size of the logits (not two, not whole
    when the logits are split): 62.6 GiB of logits of batch 64 x 2048 on one device, 1/64 of
    that split over 64 devices; the gradient buffer of that log-softmax only where autograd
    makes one."""
    model = _llama_vocab_128k(layers=1)
    ids = torch.empty(64, 2048, dtype=torch.long, device="meta")
    traced = ColoTracer().trace(model, {"input_ids": ids, "labels": ids})
    gen = StrategyGenerator((64,))
    strategies = gen.generate(traced.gm)
    mm = MemoryModel(traced.gm, gen.aliases, (64,), traced_on=traced.device)
    ce = next(n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.cross_entropy_loss.default)
    internal = [it for it in mm.items if it.owner is ce and it.kind == "activations" and it.value is None]
    logits = 64 * 2048 * 128256 * 4
    split = next(s for s in strategies[ce] if isinstance(s.inputs[0][0], Shard))
    whole = next(s for s in strategies[ce] if s.inputs[0] == (Replicate(),))
    big = [it for it in internal if it.size(whole) > 2**20]  # and the weight total, a scalar
    assert len(big) == 1
    assert big[0].size(whole) == logits
    assert big[0].size(split) == logits // 64
    # no buffer for its gradient inside the backward: with the classes whole the fused kernel
    # runs, with them split the vocab-parallel loss; both write the logits' gradient directly
    gradient = [it for it in mm.items if it.owner is ce and it.kind == "temporaries" and it.start == it.end
                and it.producer is None]  # not the logits' own gradient in the loss's layout
    vocab = next(s for s in strategies[ce] if any(isinstance(p, Shard) and p.dim == 1 for p in s.inputs[0]))
    assert gradient and all(it.size(s) < 2**20 for it in gradient for s in (whole, split, vocab))  # the loss's: 4 B


@pytest.mark.slow  # about 10 s: plans the 8B's width on 8 x 8
def test_logits_returned_sharded_and_counted_at_llama_scale():
    """Default outputs="sharded" on Llama-3-8B shapes (8 x 8): the logits come back split and
    the memory model counts the returned values at their returned size through the backward."""
    model = _llama_vocab_128k(layers=2)
    ids = torch.empty(64, 2048, dtype=torch.long, device="meta")
    traced = ColoTracer().trace(model, {"input_ids": ids, "labels": ids})
    plan = plan_traced(traced, autoparallel.MeshSpec((8, 8)),
                       PlanOptions(cost_model=autoparallel.CostModel("h100"), cache_dir=False, memory_budget="unlimited"))
    gen = StrategyGenerator((8, 8))
    gen.generate(traced.gm)
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    returned = 0
    for j, x in enumerate(output_leaves(out)):
        u, i = gen.aliases.get(x, (x, 0))
        spec = returned_spec(plan.nodes[u.name].output_specs[i], "sharded", False)
        shape = tuple(u.meta["val"].shape) if i == 0 and not isinstance(u.meta["val"], (tuple, list)) else \
            tuple(u.meta["val"][i].shape)
        if len(shape) == 3:  # the logits: split, not gathered to every device
            assert math.prod(local_shape(shape, spec, (8, 8))) < math.prod(shape)
        returned += math.prod(local_shape(shape, spec, (8, 8))) * 4
    mem = plan.estimate.memory
    assert mem.phase == "backward" and mem.breakdown.outputs == returned
    assert mem.peak_bytes < 80 * GIB  # was 176.6 GiB before the saved log-softmax was counted once and split


def _measured(pmodel, batch, ranks) -> int:
    opt = torch.optim.AdamW(pmodel.parameters())
    pmodel(**batch).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(pmodel, opt, *batch.values())
    with tracker:
        pmodel(**batch).loss.backward()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] // len(ranks)


PLANS = {"dp": {"parallelism": "data"}, "fsdp": {"parallelism": "fsdp"},
         "sharded": {"cost_model": ShardParams("cpu")}}


@pytest.mark.parametrize("name, mesh_shape, kind", [
    ("gpt2", (2, 2), "fsdp"), ("gpt2", (4,), "dp"),
    pytest.param("llama", (4,), "fsdp", marks=pytest.mark.slow),  # 5-20 s each: the full tier
    pytest.param("gpt2", (2, 2), "sharded", marks=pytest.mark.slow),
    pytest.param("llama", (2, 2), "sharded", marks=pytest.mark.slow),
    pytest.param("llama", (4,), "dp", marks=pytest.mark.slow),
])
def test_modelled_peak_within_10_percent_of_measured(name, mesh_shape, kind, sim_mesh):
    """GPT-2 and Llama with the loss inside, on simulated ranks, under a data-parallel, an FSDP
    and a parameter-splitting plan: the modelled peak within 10 % of MemTracker's."""
    from torch.distributed._local_tensor import LocalTensorMode

    torch.manual_seed(0)
    model = hf_model(name, layers=2)
    batch = batch_for(name, 0, batch=16, seq=32)
    mesh = sim_mesh(mesh_shape)
    ranks = frozenset(range(mesh.size()))
    options = {"cost_model": autoparallel.CostModel("cpu"), **PLANS[kind]}
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, to_meta(batch), device_mesh=mesh, cache_dir=False, **options)
        measured = _measured(pmodel, batch, ranks)
    est = pmodel.plan.estimate.memory
    if kind == "fsdp":
        assert est.breakdown.gathered > 0
    assert abs(est.peak_bytes - measured) <= 0.1 * measured, (est, measured)


def test_default_budget_is_the_device_memory_less_the_reserve():
    model, inputs = hf_model("gpt2"), to_meta(batch_for("gpt2", 0))
    a100 = autoparallel.plan(model, inputs, mesh_shape=(2,), cache_dir=False)
    assert a100.estimate.memory_budget_bytes == int(PRESETS["a100"].memory * (1 - RESERVE_FRACTION))
    assert not a100.checkpoint
    off = autoparallel.plan(model, inputs, mesh_shape=(2,), cache_dir=False, memory_budget="unlimited")
    assert off.estimate.memory_budget_bytes is None
    cpu = autoparallel.plan(model, inputs, mesh_shape=(2,), cache_dir=False, cost_model=autoparallel.CostModel("cpu"))
    assert cpu.estimate.memory_budget_bytes == int(host_memory() * (1 - RESERVE_FRACTION))
    assert resolve_budget("2GiB", lambda: 0) == 2 * GIB and resolve_budget(" Unlimited ", lambda: 0) is None
    with pytest.raises(ValueError, match="cannot read memory budget"):
        resolve_budget("lots", lambda: 0)


def test_device_capacity_reads_free_gpu_memory_and_shares_the_host(monkeypatch):
    """On a GPU the capacity is the free memory ``torch.cuda.mem_get_info`` reports (what the
    CUDA context and other processes leave), not the total; on a CPU the host's memory is
    shared evenly by the ranks on it. The GPU branch runs here with the CUDA calls replaced."""
    assert device_capacity("cpu", 4) == host_memory() // 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 80 * GIB))
    assert device_capacity("cuda") == 70 * GIB
    assert device_capacity("cuda", ranks_on_host=8) == 70 * GIB  # each rank has its own GPU
    assert resolve_budget(None, lambda: device_capacity("cuda")) == int(70 * GIB * (1 - RESERVE_FRACTION))
