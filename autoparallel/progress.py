"""Progress of a planning that takes a while: a tqdm bar on a terminal, INFO log lines elsewhere.

:func:`planning` wraps the function that plans; the stages it reaches call :func:`stage`.
Nothing shows for a planning shorter than :data:`PROGRESS_DELAY_S` seconds.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import sys
import threading
import time

log = logging.getLogger("autoparallel")

PROGRESS_DELAY_S = 2.0
"""Seconds a planning runs before its progress shows (a bar on a terminal, log lines elsewhere)."""
_CURRENT: contextvars.ContextVar = contextvars.ContextVar("autoparallel_progress", default=None)


class Progress:
    """The stages of one planning: on a terminal (stderr is a TTY) a tqdm bar that appears
    once the planning has run :data:`PROGRESS_DELAY_S` seconds, naming the stage and the
    time spent, ticking twice a second while a stage blocks (the ILP solver); elsewhere an
    INFO log line per stage reached after that delay."""

    def __init__(self, desc: str, stages: int):
        self.desc, self.t0, self.bar = desc, time.perf_counter(), None
        self._stop = threading.Event()
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=stages, desc=desc, delay=PROGRESS_DELAY_S, leave=False, miniters=0,
                            mininterval=0.5, bar_format="{desc}: {bar:20} {n_fmt}/{total_fmt} stages, {elapsed}{postfix}")
            threading.Thread(target=self._tick, daemon=True).start()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self.bar.update(0)  # redraws (after the delay) with the time spent

    def stage(self, name: str) -> None:
        if self.bar is not None:
            self.bar.update(1 if self.bar.postfix else 0)
            self.bar.set_postfix_str(name, refresh=False)
        elapsed = time.perf_counter() - self.t0
        if elapsed >= PROGRESS_DELAY_S:
            log.info("%s: %s (%.1f s so far)", self.desc, name, elapsed)

    def close(self) -> None:
        self._stop.set()
        if self.bar is not None:
            self.bar.total = self.bar.n  # a planning without baselines ends a stage early
            self.bar.close()


def planning(fn):
    """Run ``fn`` under a :class:`Progress` that its :func:`stage` calls advance (nested calls share the outer one)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if _CURRENT.get() is not None:
            return fn(*args, **kwargs)
        progress = Progress("planning", 4)  # strategies, memory model, costs and ILP solve, baselines
        token = _CURRENT.set(progress)
        try:
            return fn(*args, **kwargs)
        finally:
            _CURRENT.reset(token)
            progress.close()

    return run


def stage(name: str) -> None:
    """Mark the start of a planning stage on the current :class:`Progress`, if any."""
    progress = _CURRENT.get()
    if progress is not None:
        progress.stage(name)
