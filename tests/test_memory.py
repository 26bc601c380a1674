"""The peak-memory model against measurement, and the memory budget in the sharding ILP."""

import contextlib
import copy
import re

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

import autoparallel
from autoparallel.errors import InfeasiblePlanError
from autoparallel.solver.memory import OPTIMIZER_STATES, MemoryModel, parse_bytes
from autoparallel.strategies import StrategyGenerator
from autoparallel.tracer import ColoTracer
from autoparallel.tracer.annotate import node_info
from models import CNN, MLP, TwoLinear, batch_for, hf_model, to_meta, whole


def _measured_peak(model, batch) -> int:
    """Peak bytes of a steady-state AdamW training step (states exist, grads set to None)."""
    opt = torch.optim.AdamW(model.parameters())

    def step():
        out = model(**batch)
        (out if isinstance(out, torch.Tensor) else out.loss).backward()

    step()
    opt.step()
    opt.zero_grad(set_to_none=True)
    tracker = MemTracker()
    tracker.track_external(model, opt, *batch.values())
    with tracker:
        step()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]


def _estimated_peak(model, batch, mesh_shape=(1,), optimizer="adamw"):
    traced = ColoTracer().trace(model, to_meta(batch))
    gen = StrategyGenerator(mesh_shape)
    strategies = gen.generate(traced.gm)
    mm = MemoryModel(traced.gm, gen.aliases, mesh_shape, optimizer=optimizer, traced_on=traced.device)
    return mm.estimate({n: s[-1] for n, s in strategies.items()})  # replicated: one device's step


def _as_captured(model):
    """``model`` computing as its captured graph does where capture changes what is kept for
    the backward: GPT-2's written-out GELU (``gelu_new``) as the one op capture makes of it
    (``tracer/gelu.py``), which keeps its input only."""
    for block in getattr(getattr(model, "transformer", None), "h", []):
        block.mlp.act = torch.nn.GELU(approximate="tanh")
    return model


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert", "mlp", "cnn"])
def test_estimate_within_20_percent_of_measured(name):
    torch.manual_seed(0)
    model = {"mlp": MLP, "cnn": CNN}[name]() if name in ("mlp", "cnn") else hf_model(name)
    batch = batch_for(name, 0, batch=16, seq=32)
    est = _estimated_peak(model, batch)
    real = _measured_peak(_as_captured(model), batch)
    assert abs(est.peak_bytes - real) <= 0.2 * real, (est, real)
    assert sum(est.breakdown.values()) == est.peak_bytes


def test_optimizer_states_counted():
    model = hf_model("gpt2")
    batch = batch_for("gpt2", 0)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    adam = _estimated_peak(model, batch, optimizer="adamw").breakdown["optimizer"]
    sgd = _estimated_peak(model, batch, optimizer="sgd").breakdown["optimizer"]
    assert (adam, sgd) == (OPTIMIZER_STATES["adamw"] * params, 0)
    with pytest.raises(ValueError, match="unknown optimizer"):
        _estimated_peak(model, batch, optimizer="lion")


@pytest.mark.parametrize("foreach", [False, True])
def test_foreach_step_temporaries_counted(foreach):
    """Where the parameters dominate, the optimizer step is the peak: under foreach AdamW it
    holds a denominator list the size of every parameter at once (one more state), which the
    model counts; the per-tensor loop's one parameter at a time is not."""
    torch.manual_seed(0)
    model = MLP(hidden=512, layers=4)
    batch = {"x": torch.randn(4, 512), "y": torch.randn(4, 512)}
    opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
    for tracked in (False, True):  # the first step makes the states
        tracker = MemTracker()
        tracker.track_external(model, opt, *batch.values())
        with tracker if tracked else contextlib.nullcontext():
            model(**batch).backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
    measured = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    traced = ColoTracer().trace(model, to_meta(batch))
    gen = StrategyGenerator((1,))
    strategies = gen.generate(traced.gm)
    mm = MemoryModel(traced.gm, gen.aliases, (1,), optimizer_impl="foreach" if foreach else "for-loop",
                     traced_on=traced.device)
    est = mm.estimate({n: s[-1] for n, s in strategies.items()}).peak_bytes
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    if foreach:
        assert abs(est - measured) <= 0.03 * measured, (est, measured)
        assert est >= 5 * params  # parameters, gradients, two states, the denominators
    else:  # the loop's denominator, two tensors of one parameter at a time, is left out
        assert 0 <= measured - est <= 2 * largest + 0.03 * measured, (est, measured)


def test_parse_bytes():
    assert parse_bytes("12GiB") == 12 * 2**30
    assert parse_bytes("1.5 MB") == 1_500_000
    assert parse_bytes(4096) == 4096
    for bad in ("12 parsecs", "GiB", -1):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def _gpt2_planning():
    with torch.device("meta"):
        model = hf_model("gpt2", layers=2)
    return model, to_meta(batch_for("gpt2", 0, batch=16, seq=32))


def test_budget_bounds_the_modelled_peak():
    model, inputs = _gpt2_planning()
    free = autoparallel.plan(model, inputs, mesh_shape=(4,), cache_dir=False)
    peak = free.estimate.memory.peak_bytes
    budget = int(0.85 * peak)
    tight = autoparallel.plan(model, inputs, mesh_shape=(4,), cache_dir=False, memory_budget=budget)
    assert tight.estimate.peak_memory_bytes <= budget < peak  # with recomputation where it is faster
    assert tight.estimate.step_time_s >= free.estimate.step_time_s
    assert tight.solver_stats.memory_rows >= 1


@pytest.mark.slow  # 4-15 s: in the full tier (make test), not the everyday one
def test_infeasible_budget_states_the_smallest_reachable():
    model, inputs = _gpt2_planning()
    with pytest.raises(InfeasiblePlanError, match=r"smallest peak .* \((\d+) bytes\)") as err:
        autoparallel.plan(model, inputs, mesh_shape=(4,), cache_dir=False, memory_budget="1MiB", time_limit=20)
    reachable = int(re.search(r"\((\d+) bytes\)", str(err.value)).group(1))
    assert "largest tensors" in str(err.value)  # what dominates the smallest peak
    ok = autoparallel.plan(model, inputs, mesh_shape=(4,), cache_dir=False, memory_budget=reachable)
    assert ok.estimate.peak_memory_bytes <= reachable


def _checkpointed(mesh_shape, sim_mesh, frac=0.7):
    """GPT-2 with a budget sharding alone cannot meet, autoparallelized on simulated ranks."""
    from torch.distributed._local_tensor import LocalTensorMode

    torch.manual_seed(0)
    ref = hf_model("gpt2", layers=4).train()
    model = copy.deepcopy(ref)
    batch = batch_for("gpt2", 0, batch=8, seq=32)
    cost = autoparallel.CostModel("cpu")
    free = autoparallel.plan(ref, to_meta(batch), mesh_shape=mesh_shape, cost_model=cost, cache_dir=False)
    budget = int(frac * free.estimate.peak_memory_bytes)
    mesh = sim_mesh(mesh_shape)
    ranks = frozenset(range(mesh.size()))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, to_meta(batch), device_mesh=mesh, cost_model=cost,
                                              memory_budget=budget, cache_dir=False, offload=False)
    return ref, pmodel, batch, budget, ranks


@pytest.mark.slow
def test_checkpointing_parity_and_measured_peak(sim_mesh):
    from torch.distributed._local_tensor import LocalTensorMode

    ref, pmodel, batch, budget, ranks = _checkpointed((2,), sim_mesh)
    ck = pmodel.plan.checkpoint
    assert ck and ck.regions and ck.recompute_s > 0, "the budget should need recomputation"
    assert "torch.utils.checkpoint.checkpoint" in pmodel.graph_module.code
    assert "activation checkpointing" in pmodel.plan.table()
    ref(**batch).loss.backward()
    ref_params = dict(ref.named_parameters())
    with LocalTensorMode(ranks):
        loss = pmodel(**batch).loss
        loss.backward()
        for r, v in enumerate(loss._local_tensors.values()):
            torch.testing.assert_close(v, ref(**batch).loss.detach(), rtol=1e-4, atol=1e-5)
        for name, p in pmodel.named_parameters():
            for v in whole(p.grad)._local_tensors.values():
                torch.testing.assert_close(v, ref_params[name].grad, rtol=1e-4, atol=1e-5, msg=name)
        for p in pmodel.parameters():
            p.grad = None
        measured = _measured_peak(pmodel, batch) / len(ranks)
    # the planner keeps its modelled peak within the budget; the model does not under-count the
    # measured peak by more than a few percent (a budget given in bytes leaves no room for that),
    # and over-counts it by no more than Rotor's chain is known to over-count a region spanning
    # several stages (one tensor kept by several boundaries counted at each: docs/design.md,
    # "Why the ckpt rows are over"): this plan (stages 2..4 recomputed) measures 11 % under its
    # model; the one-stage region it took before slices were counted as copies, 1.8 % over
    modelled = pmodel.plan.estimate.peak_memory_bytes
    assert modelled <= budget, (modelled, budget)
    assert -0.15 * modelled <= measured - modelled <= 0.05 * modelled, (measured, modelled)


@pytest.mark.parametrize("checkpointing, tolerance", [("off", 0.03), ("full", 0.08)])
def test_a_mask_read_by_every_layer_counted_once(sim_mesh, checkpointing, tolerance):
    """A ViT whose sequence (257) is long beside its width (32): the boolean attention mask made
    before the layers, and the float copy of it each layer's SDPA saves, outweigh an activation.
    The copy has no gradient in the SDPA's backward (it was counted with one: +6 % without
    checkpointing), and the mask, read by every layer, is held once (it was counted at each
    checkpointed stage's input: +30 % with every stage checkpointed)."""
    import transformers as T
    from torch.distributed._local_tensor import LocalTensorMode

    cfg = T.ViTConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=64,
                      image_size=64, patch_size=4, num_labels=10, hidden_dropout_prob=0,
                      attention_probs_dropout_prob=0)
    torch.manual_seed(0)
    model = T.ViTForImageClassification(cfg).train()
    g = torch.Generator().manual_seed(1)
    batch = {"pixel_values": torch.randn(4, 3, 64, 64, generator=g), "labels": torch.randint(0, 10, (4,), generator=g)}
    mesh = sim_mesh((2,))
    with LocalTensorMode(frozenset(range(2))):
        pmodel = autoparallel.autoparallelize(model, to_meta(batch), device_mesh=mesh, parallelism="data",
                                              cost_model=autoparallel.CostModel("cpu"), cache_dir=False,
                                              checkpointing=checkpointing)
        measured = _measured_peak(pmodel, batch) / 2
    modelled = pmodel.plan.estimate.peak_memory_bytes
    assert abs(modelled / measured - 1) <= tolerance, (modelled, measured)


@pytest.mark.slow
def test_selective_checkpointing_parity(sim_mesh):
    """``checkpointing="selective"``: every stage keeps its matmul and attention outputs and
    recomputes the rest; loss and every gradient equal the single-device model's."""
    from torch.distributed._local_tensor import LocalTensorMode

    torch.manual_seed(0)
    ref = hf_model("gpt2", layers=2).train()
    model = copy.deepcopy(ref)
    batch = batch_for("gpt2", 0, batch=4, seq=32)
    mesh = sim_mesh((2,))
    ranks = frozenset(range(2))
    with LocalTensorMode(ranks):
        pmodel = autoparallel.autoparallelize(model, to_meta(batch), device_mesh=mesh, cost_model=autoparallel.CostModel(
            "cpu"), checkpointing="selective", cache_dir=False)
    ck = pmodel.plan.checkpoint
    assert ck.regions and all(r.selective for r in ck.regions)
    assert {row.policy for row in ck.table} == {"selective"} and "selective" in pmodel.plan.table()
    assert "selective_checkpoint(" in pmodel.graph_module.code
    ref(**batch).loss.backward()
    ref_params = dict(ref.named_parameters())
    with LocalTensorMode(ranks):
        loss = pmodel(**batch).loss
        loss.backward()
        for v in loss._local_tensors.values():
            torch.testing.assert_close(v, ref(**batch).loss.detach(), rtol=1e-4, atol=1e-5)
        for name, p in pmodel.named_parameters():
            for v in whole(p.grad)._local_tensors.values():
                torch.testing.assert_close(v, ref_params[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_recomputing_on_the_fastest_plan_beats_sharding_to_fit():
    """Just under the fastest plan's peak, recomputing a little on it is faster than the
    sharding stage 1 finds to fit without recomputation, so ``"auto"`` takes it."""
    with torch.device("meta"):
        model = hf_model("gpt2", layers=4)
    inputs = to_meta(batch_for("gpt2", 0, batch=8, seq=32))
    kw = dict(mesh_shape=(2,), cache_dir=False, cost_model=autoparallel.CostModel("cpu"))
    free = autoparallel.plan(model, inputs, **kw)
    budget = int(0.9 * free.estimate.peak_memory_bytes)
    sharded = autoparallel.plan(model, inputs, memory_budget=budget, checkpointing="off", offload=False, **kw)
    auto = autoparallel.plan(model, inputs, memory_budget=budget, offload=False, **kw)
    assert sharded.checkpoint is None and auto.checkpoint and auto.checkpoint.regions
    assert auto.estimate.peak_memory_bytes <= budget
    assert free.estimate.step_time_s < auto.estimate.step_time_s < sharded.estimate.step_time_s


def test_checkpointed_plan_roundtrips_json():
    from autoparallel.plan import Plan

    with torch.device("meta"):
        model = hf_model("gpt2", layers=4)
    inputs = to_meta(batch_for("gpt2", 0, batch=8, seq=32))
    free = autoparallel.plan(model, inputs, mesh_shape=(2,), cache_dir=False, cost_model=autoparallel.CostModel("cpu"))
    p = autoparallel.plan(model, inputs, mesh_shape=(2,), cache_dir=False, cost_model=autoparallel.CostModel("cpu"),
                          memory_budget=int(0.7 * free.estimate.peak_memory_bytes), offload=False)
    assert p.checkpoint and Plan.from_json(p.to_json()) == p
    assert p.estimate.step_time_s > free.estimate.step_time_s


def _gpt2_activations(world: int, device: str) -> int:
    """Most modelled activation bytes per device over the step of a data-parallel GPT-2 with
    attention dropout (a math kernel on CPU), one 256-token sequence per device."""
    pytest.importorskip("transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=4, vocab_size=128, n_positions=256,
                                           use_cache=False))
    ids = torch.empty(world, 256, dtype=torch.long, device="meta")
    plan = autoparallel.plan(model, {"input_ids": ids, "labels": ids}, mesh_shape=(world,), parallelism="data",
                             cache_dir=False, device=device)
    return max(plan.inspection.memory_timeline["by_kind"]["activations"])


def test_attention_activations_split_with_the_batch():
    """Attention's saved probabilities [B, H, S, S] (and the math kernel's [B·H, S, S]) are
    split as the query: one sequence per device on 4 devices models what one device with one
    sequence does, not the global batch's. Planned for a GPU on this CPU build, attention saves
    what the fused kernels save (the logsumexp, not the probabilities): less."""
    one, four = _gpt2_activations(1, "cpu"), _gpt2_activations(4, "cpu")
    assert abs(four - one) <= 0.01 * one, (one, four)
    gpu_one, gpu_four = _gpt2_activations(1, "cuda"), _gpt2_activations(4, "cuda")
    assert abs(gpu_four - gpu_one) <= 0.01 * gpu_one, (gpu_one, gpu_four)
    probs = 4 * 4 * 256 * 256  # one [1, 4, 256, 256] fp32 tensor
    assert gpu_one <= one - probs, (one, gpu_one)


def test_local_piece_backward_holds_one_whole_gradient():
    """The slice move's piece (``local_piece``) has ``index_select``'s gradient, made in one
    buffer of the whole tensor's size even under a dispatch mode (MemTracker), where autograd's
    own ``index_select`` backward makes a second one (an out-of-place ``index_add``)."""
    from autoparallel.runtime_kernels import local_piece

    x = torch.randn(4, 6, 256, requires_grad=True)
    coord = torch.tensor([1])
    g = torch.randn(4, 3, 256)
    local_piece(x, 1, 2, coord).backward(g)
    ref = x.detach().clone().requires_grad_()
    ref.unflatten(1, (2, 3)).index_select(1, coord).squeeze(1).backward(g)
    assert torch.equal(x.grad, ref.grad)

    def backward_peak(cut):
        y = cut(x.detach().clone().requires_grad_())
        tracker = MemTracker()
        with tracker:
            y.backward(g)
        return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]

    whole = x.numel() * 4
    assert backward_peak(lambda t: local_piece(t, 1, 2, coord)) < 2 * whole
    assert backward_peak(lambda t: t.unflatten(1, (2, 3)).index_select(1, coord).squeeze(1)) >= 2 * whole


class _AllReduceOnly(autoparallel.CostModel):
    """Every collective but all-reduce at a thousand times its price: a partial sum reaches a
    split layout through an all-reduce and a slice, not a reduce-scatter."""

    def collective_time(self, kind, axis, nbytes):
        return super().collective_time(kind, axis, nbytes) * (1 if kind == "all_reduce" else 1000)


def test_gradient_counted_at_every_layout_on_its_way_back():
    """A consumer that takes a value in another layout than its producer's holds, at its
    backward, the value's gradient in each layout the redistribution's backward passes through
    (measured on Llama's tensor-parallel logits on 2 processes: -13.4 % before, -0.8 % after,
    ``benchmarks/memory.py --processes``): a row-parallel matmul's partial sum read split by
    rows holds a split gradient after a reduce-scatter, and a whole one after an all-reduce and
    a slice; none when the consumer reads the layout held."""
    from autoparallel.solver.layout import Redistributor
    from torch.distributed.tensor import Partial, Shard

    class RowParallel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(64, 32))

        def forward(self, x):
            return torch.relu(x @ self.w).sum()

    traced = ColoTracer().trace(RowParallel(), (torch.empty(128, 64, device="meta"),))
    gen = StrategyGenerator((2,))
    strategies = gen.generate(traced.gm)
    mm = next(n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.matmul.default)
    relu = next(n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    partial = next(s for s in strategies[mm] if s.outputs[0] == (Partial(),))
    rows = next(s for s in strategies[relu] if s.inputs[0] == (Shard(0),))
    whole = 128 * 32 * 4

    def passing(cost_model):
        model = MemoryModel(traced.gm, gen.aliases, (2,), traced_on=traced.device,
                            layout=Redistributor(cost_model.bind(autoparallel.MeshSpec((2,)))))
        item = next(it for it in model.items if it.owner is relu and it.producer == (mm, 0))
        return item.bytes({mm: partial, relu: rows}), item.bytes({mm: rows, relu: rows})

    assert passing(autoparallel.CostModel()) == (whole // 2, 0)
    assert passing(_AllReduceOnly()) == (whole, 0)


def test_value_saved_again_in_another_layout_is_a_copy():
    """A value two ops save, the second reading it in another layout (a matmul taking the whole
    of an activation split by rows), holds a redistributed copy beside the first one's: an item
    of the whole value under that read, none when the second reads the layout held (the
    attention output all-gathered for a row-parallel projection was missing from checkpointed
    steps, ``docs/design.md``)."""
    from torch.distributed.tensor import Replicate, Shard

    traced = ColoTracer().trace(TwoLinear(), (torch.empty(128, 64, device="meta"),))
    gen = StrategyGenerator((2,))
    strategies = gen.generate(traced.gm)
    relu = next(n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    mm = next(n for n in traced.gm.graph.nodes if n.target is torch.ops.aten.matmul.default and relu in n.args)
    model = MemoryModel(traced.gm, gen.aliases, (2,), traced_on=traced.device)
    (copy_item,) = [it for it in model.items if it.owner is mm and it.source == (relu, 0)]
    rows = next(s for s in strategies[relu] if s.outputs[0] == (Shard(0),))
    whole = next(s for s in strategies[mm] if s.inputs[0] == (Replicate(),))
    split = next(s for s in strategies[mm] if s.inputs[0] == (Shard(0),))
    assert copy_item.bytes({relu: rows, mm: whole}) == 128 * 64 * 4
    assert copy_item.bytes({relu: rows, mm: split}) == 0


def test_a_layers_stages_joined_where_the_residual_crosses():
    """GPT-2's layer is two chain stages, not four: its norms join the attention and the MLP
    after them, since the residual stream crosses into both (as two stages' inputs it was
    counted twice); a value read by every layer joins nothing."""
    from autoparallel.solver.remat import chain_stages

    traced = ColoTracer().trace(hf_model("gpt2", layers=3), to_meta(batch_for("gpt2", 0, batch=2, seq=16)))
    stages = chain_stages([n for n in traced.gm.graph.nodes if n.op != "output"])
    assert max(stages.values()) + 1 == 1 + 2 * 3 + 1
    by_module = {}
    for n, s in stages.items():
        by_module.setdefault(node_info(n).module_path, set()).add(s)
    assert by_module["transformer.h.1.ln_1"] == by_module["transformer.h.1.attn.c_attn"]
    assert by_module["transformer.h.1.ln_2"] == by_module["transformer.h.1.mlp.c_fc"]
    assert by_module["transformer.h.1.attn.c_attn"] != by_module["transformer.h.1.mlp.c_fc"]


def test_a_slice_of_a_replicated_parameter_is_a_copy():
    """The runtime cuts a device's piece of a replicated tensor with ``index_select``
    (``local_piece``): a new tensor, which a consumer that saves its input keeps for the
    backward (GPT-2's query, key and value slices of ``c_attn`` read split over the heads),
    as a collective's result is; reading the layout held is no copy."""
    from autoparallel.placement import R, Partial, Shard
    from autoparallel.solver.memory import is_copy

    assert is_copy((R,), (Shard(1),)) and is_copy((R, R), (R, Shard(0)))
    assert is_copy((Shard(0),), (R,)) and is_copy((Partial(),), (R,))
    assert not is_copy((R, Shard(0)), (R, Shard(0)))
