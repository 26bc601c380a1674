"""Tier 3: real processes. 4 gloo ranks on a 2 x 2 mesh run a small GPT-2 through
``autoparallelize`` and check parity with the single-device model through real c10d:
the loss and every parameter gradient after one forward+backward, and again after each
of 3 SGD steps; then on meshes that list their ranks in another order than ascending
(collectives join pieces in process-group order, ascending by rank): [3, 2, 1, 0] data
parallel (the batch sliced by coordinate), also on a short last batch of 3 that the mesh
does not divide (``replan=True``), and [[3, 2], [1, 0]] with every parameter split
(shards placed by ``distribute_tensor``); then a 4-layer GPT-2 under a memory budget that
needs activation checkpointing (one step). All checks share one spawn (start-up costs
~2 s per spawn).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gloo_ranks import spawn
from models import placements_of, whole

pytest.importorskip("transformers")

WORLD = 4
MESH_SHAPE = (2, 2)
BATCH, SEQ, VOCAB = 4, 16, 128
SHORT_BATCH = 3  # the last batch of an epoch, which no mesh axis divides
SGD_STEPS = 3
LR = 0.1
RTOL, ATOL = 1e-4, 1e-5


def _tiny_gpt2(layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
                        use_cache=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.train()
    return model


def _batch(step: int, size: int = BATCH) -> dict:
    g = torch.Generator().manual_seed(1000 + step)  # same draw on every rank
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _check(rank: int, when: str, loss, ref_loss, pmodel, ref_params: dict) -> None:
    where = f"rank {rank}, {when}"
    got = loss.detach()
    assert torch.allclose(got, ref_loss.detach(), rtol=RTOL, atol=ATOL), \
        f"{where}: loss {got.item():.8f} != single-device {ref_loss.item():.8f}"
    names = dict(pmodel.named_parameters())
    assert set(names) == set(ref_params), \
        f"{where}: parameter names differ: {sorted(set(names) ^ set(ref_params))}"
    for name, p in names.items():
        assert p.grad is not None, f"{where}: {name} has no gradient"
        full = whole(p.grad)
        ref = ref_params[name].grad
        assert full.shape == ref.shape, f"{where}: grad of {name} has shape {tuple(full.shape)}, " \
                                        f"single-device {tuple(ref.shape)}"
        if not torch.allclose(full, ref, rtol=RTOL, atol=ATOL):
            err = (full - ref).abs().max().item()
            raise AssertionError(f"{where}: grad of {name} differs from single-device "
                                 f"(max abs err {err:.3g}, placements {placements_of(p.grad)})")


def _worker(rank: int) -> None:
    import autoparallel

    class _ShardParams(autoparallel.CostModel):
        def grad_reduction_time(self, axis, nbytes):
            return 1e-3

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    mesh = init_device_mesh("cpu", MESH_SHAPE, mesh_dim_names=("dp", "tp"))
    model = _tiny_gpt2()
    ref = copy.deepcopy(model)
    ref_params = dict(ref.named_parameters())

    batch = _batch(0)
    meta_inputs = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batch.items()}
    # the cpu preset with gradient reduction priced high: every parameter split (tensor
    # parallelism, all-to-all, reduce-scatter), rank 0's plan broadcast to the others
    cost = _ShardParams("cpu")
    pmodel = autoparallel.autoparallelize(model, meta_inputs, device_mesh=mesh, cost_model=cost)
    assert pmodel.plan.collectives and all(
        any(p.__class__.__name__ == "Shard" for p in spec) for spec in pmodel.plan.param_placements.values())

    opt = torch.optim.SGD(pmodel.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(SGD_STEPS + 1):
        if step > 0:
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
            batch = _batch(step)
        out, ref_out = pmodel(**batch), ref(**batch)
        loss, ref_loss = out.loss, ref_out.loss
        loss.backward()
        ref_loss.backward()
        _check(rank, f"step {step}" + (" (after SGD)" if step else ""), loss, ref_loss, pmodel, ref_params)
        if step == 0:  # the logits stay split (outputs="sharded"): a DTensor, gathered on demand
            assert isinstance(out.logits, DTensor), type(out.logits)
            torch.testing.assert_close(out.logits.full_tensor().detach(), ref_out.logits.detach(), rtol=1e-4,
                                       atol=1e-5)

    # meshes listing ranks in another order: local slices in process-group order, as
    # collectives join pieces and distribute_tensor scatters parameter shards
    for layout, cost_model, sizes in (([3, 2, 1, 0], autoparallel.CostModel("cpu"), (BATCH, SHORT_BATCH)),
                                      ([[3, 2], [1, 0]], cost, (BATCH,))):
        model = _tiny_gpt2()
        ref = copy.deepcopy(model)
        ref_params = dict(ref.named_parameters())
        pmodel = autoparallel.autoparallelize(model, meta_inputs, device_mesh=DeviceMesh("cpu", layout),
                                              cost_model=cost_model, replan=True)
        for step, size in enumerate(sizes):  # the short last batch of an epoch: planned anew
            for p in list(pmodel.parameters()) + list(ref.parameters()):
                p.grad = None
            batch = _batch(step, size)
            loss = pmodel(**batch).loss
            loss.backward()
            ref_loss = ref(**batch).loss
            ref_loss.backward()
            _check(rank, f"mesh {layout}, batch of {size}", loss, ref_loss, pmodel, ref_params)
        assert len(pmodel.plans) == len(sizes)
        if pmodel.holds_dtensors:  # a checkpoint of shards at the mesh listing's offsets would be shuffled
            with pytest.raises(autoparallel.AutoParallelError, match="out of order"):
                pmodel.state_dict()

    # a memory budget sharding alone cannot meet: recomputation through checkpoint regions
    # that contain collectives, replayed in backward on every rank
    model = _tiny_gpt2(layers=4)
    ref = copy.deepcopy(model)
    ref_params = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (8, 32), generator=g)
    batch = {"input_ids": ids, "labels": ids.clone()}
    meta_inputs = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in batch.items()}
    cpu = autoparallel.CostModel("cpu")
    free = autoparallel.plan(model, meta_inputs, mesh_shape=MESH_SHAPE, cost_model=cpu, cache_dir=False)
    budget = int(0.42 * free.estimate.peak_memory_bytes)  # sharding alone reaches 0.49, recomputation 0.40
    pmodel = autoparallel.autoparallelize(model, meta_inputs, device_mesh=mesh, cost_model=cpu,
                                          memory_budget=budget, cache_dir=False, offload=False, zero=False)
    assert pmodel.plan.checkpoint and pmodel.plan.checkpoint.regions, "the budget should need recomputation"
    loss = pmodel(**batch).loss
    loss.backward()
    ref_loss = ref(**batch).loss
    ref_loss.backward()
    _check(rank, "with activation checkpointing", loss, ref_loss, pmodel, ref_params)
    dist.barrier()


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_gpt2_parity_4_gloo_ranks_2x2_mesh():
    spawn(_worker, WORLD)
