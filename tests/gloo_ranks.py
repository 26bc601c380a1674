"""Real gloo processes for the tests (DESIGN §4, tier 3): :func:`spawn` starts ``world``
processes, joins them into one gloo process group and runs a test function on each.

Every rank shares one teardown, written for a machine where the ranks outnumber the cores:

* a rank's exception is printed to its stderr before anything else happens, so the test's
  output shows it whatever teardown does next;
* after a rank's function returns, a barrier keeps it from tearing down while another rank is
  still inside a collective, then the process group is destroyed;
* the process then leaves through ``os._exit(0)``, skipping the interpreter's finalization: gloo's
  worker threads may still drop their last references to finished work (and the tensors it
  holds) after ``wait()`` returned, and a tensor freed by such a thread while the interpreter is
  being torn down aborts the process ("terminate called without an active exception", a rank
  lost to SIGABRT after its test had passed; pytorch/pytorch#179291 describes the race).

A rank can also die by a signal mid-run: once in CI a rank of the 4-rank families spawn aborted
with "malloc(): unaligned tcache chunk detected" (heap corruption in native code), and six
reruns of the same spawn passed. :func:`spawn` then spawns every rank again, once; faulthandler
prints every thread's Python stack on the way down, so the next occurrence says where it was.
A rank that raises, or exits non-zero, is never retried.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import socket
import sys
import traceback
from typing import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the rendezvous' store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn: Callable, world: int, *args, timeout_s: float = 120) -> None:
    """Run ``fn(rank, *args)`` on ``world`` processes joined in a gloo process group (the
    default group, ``timeout_s`` seconds per collective), one intra-op thread each.

    ``fn`` must be a module-level function (the processes are spawned, not forked).

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised; the message holds its traceback.
        torch.multiprocessing.ProcessExitedException: a rank exited non-zero, or died by a
            signal twice: a rank lost to a signal is retried once, every rank anew (module docstring).
    """
    try:
        mp.spawn(_rank_main, args=(fn, world, free_port(), args, timeout_s), nprocs=world, join=True)
    except mp.ProcessExitedException as e:
        if e.exit_code >= 0:  # a non-zero exit: the rank's own doing
            raise
        # a signal: torch's native code aborted (the stacks are in the captured stderr); once
        print(f"\nrank {e.error_index} died by {e.signal_name}; spawning the {world} ranks again "
              f"(once)", file=sys.stderr)
        mp.spawn(_rank_main, args=(fn, world, free_port(), args, timeout_s), nprocs=world, join=True)


def _rank_main(rank: int, fn: Callable, world: int, port: int, args: tuple, timeout_s: float) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    faulthandler.enable(all_threads=True)  # a rank lost to a signal prints every thread's Python stack
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, *args)
    except BaseException:
        print(f"rank {rank} of {world} failed:", file=sys.stderr)
        traceback.print_exc()
        sys.stderr.flush()
        raise
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
