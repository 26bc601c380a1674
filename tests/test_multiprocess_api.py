"""Tier 3: the module's behaviour through real c10d, 2 gloo ranks, one spawn for every check:
an error raised while planning on rank 0 is raised on every rank, ranks that pass different
batches are stopped on every rank, non-tensor call arguments, eval after training, loading a
single-device state dict and getting full tensors back."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from gloo_ranks import spawn

pytest.importorskip("transformers")

WORLD = 2


class _DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 64)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(64, 10)

    def forward(self, x, y):
        return F.cross_entropy(self.out(self.drop(F.relu(self.fc(x)))), y)


def _data(seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g)


def _meta(tensors):
    return tuple(torch.empty(t.shape, dtype=t.dtype, device="meta") for t in tensors)


def _planning_error_on_every_rank(autoparallel, mesh, rank):
    torch.manual_seed(0)
    with pytest.raises(autoparallel.InfeasiblePlanError, match="budget") as info:
        autoparallel.autoparallelize(_DropoutMLP(), _meta(_data(0)), device_mesh=mesh, memory_budget=1,
                                     cache_dir=False)
    assert "Connection" not in str(info.value), f"rank {rank}: {info.value}"


def _different_batches_stopped(autoparallel, mesh, rank):
    torch.manual_seed(0)
    pmodel = autoparallel.autoparallelize(_DropoutMLP(), _meta(_data(0)), device_mesh=mesh, cache_dir=False)
    with pytest.raises(autoparallel.InputMismatchError, match="different inputs"):
        pmodel(*_data(rank))  # each rank its own batch, as with DistributedSampler
    pmodel(*_data(5))  # the same batch everywhere is fine


def _eval_state_dict_and_full_tensors(autoparallel, mesh, rank):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    torch.manual_seed(0)
    ref = _DropoutMLP()
    pmodel = autoparallel.autoparallelize(_DropoutMLP(), _meta(_data(0)), device_mesh=mesh,
                                          cost_model=autoparallel.CostModel("cpu"), cache_dir=False)
    pmodel.load_state_dict(ref.state_dict())  # another initialization's weights, as plain tensors
    pmodel.eval()
    ref.eval()
    x, y = _data(1)
    torch.testing.assert_close(pmodel(x, y), ref(x, y), rtol=1e-5, atol=1e-6)
    full = get_model_state_dict(pmodel, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        assert set(full) == set(ref.state_dict())
        for k, v in ref.state_dict().items():
            assert not isinstance(full[k], torch.distributed.tensor.DTensor)
            torch.testing.assert_close(full[k], v)


def _non_tensor_arguments(autoparallel, mesh, rank):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    ref = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    meta = {"input_ids": torch.empty(4, 8, dtype=torch.long, device="meta"),
            "labels": torch.empty(4, 8, dtype=torch.long, device="meta"), "use_cache": False, "return_dict": True}
    pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), meta, device_mesh=mesh, cache_dir=False, replan=False)
    got = pmodel(input_ids=ids, labels=ids, use_cache=False, return_dict=True).loss
    want = ref(input_ids=ids, labels=ids, use_cache=False, return_dict=True).loss
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with pytest.raises(autoparallel.InputMismatchError, match="argument use_cache has value True"):
        pmodel(input_ids=ids, labels=ids, use_cache=True, return_dict=True)


def _sharded_optimizer_states(autoparallel, mesh, rank):
    """ZeRO stages 1 and 2 through real c10d (gloo's broadcasts gather the updated shards; stage 2
    reduce-scatters the gradients): the loss, the gradient norm torch's ``clip_grad_norm_`` takes
    over the shards, and every parameter equal the single-device model's after two clipped SGD
    steps (AdamW's update of a near-zero gradient turns on its rounding)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    class SlowStep(autoparallel.CostModel):  # a step of a microsecond per element: sharding it pays
        def optimizer_step_time(self, numel, *args, **kwargs):
            return super().optimizer_step_time(numel, *args, **kwargs) + numel * 1e-6

    class SlowScatter(SlowStep):  # a reduce-scatter at a nanosecond a byte: the gradient all-reduced
        def collective_time(self, kind, axis, nbytes):
            t = super().collective_time(kind, axis, nbytes)
            return t + nbytes * 1e-9 if kind == "reduce_scatter" else t

    torch.manual_seed(0)
    ref0 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False))
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    meta = {k: torch.empty(4, 8, dtype=torch.long, device="meta") for k in ("input_ids", "labels")}
    for cost_model, stage2 in ((SlowScatter("cpu"), False), (SlowStep("cpu"), True)):
        ref = copy.deepcopy(ref0)
        kw = dict(cost_model=cost_model, cache_dir=False)
        free = autoparallel.plan(ref, meta, mesh_shape=(WORLD,), **kw)
        pmodel = autoparallel.autoparallelize(copy.deepcopy(ref), meta, device_mesh=mesh,
                                              memory_budget=int(0.9 * free.estimate.peak_memory_bytes), **kw)
        assert pmodel.plan.state_placements and bool(pmodel.plan.sharded_gradients) == stage2
        opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (pmodel, ref))
        for _ in range(2):
            losses, norms = [], []
            for m, o in ((pmodel, opt), (ref, ref_opt)):
                o.zero_grad()
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)  # over the shards' gradients
                norms.append(float(norm.full_tensor() if isinstance(norm, torch.distributed.tensor.DTensor) else norm))
                o.step()
                losses.append(float(loss))
            torch.testing.assert_close(*losses, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(*norms, rtol=1e-4, atol=1e-5)
        got = dict(pmodel.named_parameters())
        for name, p in ref.named_parameters():
            torch.testing.assert_close(got[name].full_tensor(), p.detach(), rtol=1e-4, atol=1e-5)


def _worker(rank: int) -> None:
    import autoparallel
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD,))
    for check in (_planning_error_on_every_rank, _different_batches_stopped, _eval_state_dict_and_full_tensors,
                  _non_tensor_arguments, _sharded_optimizer_states):
        check(autoparallel, mesh, rank)
        dist.barrier()


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_module_behaviour_2_gloo_ranks():
    spawn(_worker, WORLD, timeout_s=60)
