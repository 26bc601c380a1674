"""The test harness's own contract (``tests/gloo_ranks.py``): a rank lost to a signal is spawned
again once, a rank that raises is not."""

from __future__ import annotations

import os
import signal

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from gloo_ranks import spawn


def _abort_once(rank: int, marker: str) -> None:
    dist.barrier()
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGABRT)
    dist.barrier()


def _abort_always(rank: int) -> None:
    if rank == 1:
        os.kill(os.getpid(), signal.SIGABRT)
    dist.barrier()


def _raise(rank: int, marker: str) -> None:
    with open(marker, "a") as f:
        f.write(f"{rank}\n")
    raise ValueError(f"rank {rank} raised")


@pytest.mark.multiprocess
def test_a_rank_lost_to_a_signal_is_spawned_again_once(tmp_path):
    spawn(_abort_once, 2, str(tmp_path / "aborted"), timeout_s=30)
    assert (tmp_path / "aborted").exists()
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        spawn(_abort_always, 2, timeout_s=30)


@pytest.mark.multiprocess
def test_a_rank_that_raises_is_not_spawned_again(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(mp.ProcessRaisedException, match="raised"):
        spawn(_raise, 2, str(marker), timeout_s=30)
    assert len(marker.read_text().split()) <= 2  # one spawn: each rank wrote at most once
