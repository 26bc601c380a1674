"""The check that every rank passes the same global batch.

A :class:`~autoparallel.codegen.ParallelModule` takes the global batch on every rank and
slices it itself; a rank handed its own shard (as DDP users do) would silently train on a
mix of batches (unless the plan is for local inputs, ``inputs="local"``, where each rank
passes its own batch by design and nothing is compared). On the first call and every
``every``-th call after it, each rank fingerprints its inputs and the fingerprints are
compared with one all-reduce (max of the fingerprint and of its negation) over the world:
2·k float64 values for k inputs.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ..errors import InputMismatchError


def fingerprint(leaves) -> torch.Tensor:
    """Two float64 numbers per input, shape ``[2 · len(leaves)]``: for a tensor, the sum of its
    values and their sum weighted by position (cycling weights 1..97, so that a permuted or
    shifted batch differs); for a non-tensor argument, a CRC-32 of its ``repr``. Identical
    inputs give bit-identical fingerprints on devices of one type (same kernels, same order).
    Costs one float64 copy of each input."""
    out = []
    for x in leaves:
        if isinstance(x, torch.Tensor):
            v = torch.nan_to_num(x.detach().reshape(-1).to(torch.float64), nan=0.5, posinf=1e300, neginf=-1e300)
            w = torch.arange(v.numel(), device=v.device, dtype=torch.int64).remainder_(97).add_(1)
            out.append(torch.stack([v.sum(), (v * w).sum()]))
        else:
            crc = float(zlib.crc32(repr(x).encode()))
            out.append(torch.tensor([crc, crc], dtype=torch.float64))
    return torch.cat([o.to("cpu") for o in out]) if out else torch.zeros(0, dtype=torch.float64)


class BatchCheck:
    """Raises :class:`~autoparallel.errors.InputMismatchError` on every rank when the ranks
    pass different inputs, checked on call 0, ``every``, ``2 · every``, …; ``every=0`` never
    checks. Under simulated ranks (the fake process group and ``LocalTensorMode``) an input
    that is a ``LocalTensor`` must hold the same values on every rank; plain tensors are one
    value for all ranks there.

    Raises:
        ValueError: ``every`` is negative or not an int.
    """

    def __init__(self, device_mesh, every: int = 100):
        self.every = checked_every(every)
        self.device = device_mesh.device_type
        self.calls = 0

    def __call__(self, leaves) -> None:
        call, self.calls = self.calls, self.calls + 1
        if not self.every or call % self.every or not dist.is_initialized():
            return
        if dist.get_world_size() == 1:
            return
        if dist.get_backend() == "fake":
            for i, x in enumerate(leaves):
                values = list(getattr(x, "_local_tensors", {}).values())
                if any(not torch.equal(values[0], v) for v in values[1:]):
                    raise InputMismatchError(_message(call, i))
            return
        fp = fingerprint(leaves)
        both = torch.cat([fp, -fp]).to(self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        hi, neg_lo = both.cpu().chunk(2)
        if not torch.equal(hi, -neg_lo):
            raise InputMismatchError(_message(call, int((hi != -neg_lo).nonzero()[0]) // 2))


def checked_every(every) -> int:
    """``every`` (``check_batch_every``) when it is an int >= 0.

    Raises:
        ValueError: any other value.
    """
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ValueError(f"check_batch_every must be an int >= 0 (0: never), not {every!r}")
    return every


def _message(call: int, index: int) -> str:
    return (f"the ranks passed different inputs to call {call} (flattened input {index} differs): the module "
            "takes the global batch, the same on every rank, and splits it itself. Give every rank the "
            "whole batch (e.g. the same seed and sampler, no DistributedSampler). Checked on the first call "
            "and every check_batch_every calls (an argument of autoparallelize).")
