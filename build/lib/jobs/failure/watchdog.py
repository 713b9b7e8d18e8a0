"""A watchdog thread per rank: writes its heartbeat and notices when no step completes in time.

Before the first step the limit is `failure.init_timeout_s` (rendezvous, build, load and the first
step are slow); after it, `failure.hang_timeout_s`. When the limit passes, `on_hang` runs once in the
watchdog thread, which keeps running while the main thread is blocked inside a collective.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from jobs.failure.heartbeat import Beat, beat_path, write_beat

__all__ = ["Watchdog"]


class Watchdog:
    def __init__(self, *, run_dir: str, attempt: str, rank: int, node: str, heartbeat_s: float,
                 init_timeout_s: float, hang_timeout_s: float, on_hang: Callable[[float], None]) -> None:
        self.path = beat_path(run_dir, attempt, rank)
        self.heartbeat_s, self.hang_timeout_s, self.on_hang = heartbeat_s, hang_timeout_s, on_hang
        self.limit_s = init_timeout_s
        self.beat = Beat(rank=rank, pid=os.getpid(), host=os.uname().nodename, node=node, time=time.time(),
                         step=-1, phase="rendezvous", progress_time=time.time())
        self._last = time.monotonic()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshjob-watchdog", daemon=True)
        self.fired_after_s: float | None = None

    def start(self) -> "Watchdog":
        write_beat(self.path, self.beat)
        self._thread.start()
        return self

    def progress(self, step: int) -> None:
        """A step completed: the clock restarts and, from now on, the limit is the hang timeout."""
        self.beat.step, self.limit_s = step, self.hang_timeout_s
        self._moved()

    def phase(self, name: str) -> None:
        """The rank moved on to `name` (build, load, train, checkpoint_save, ...): counts as progress."""
        self.beat.phase = name
        self._moved()

    def _moved(self) -> None:
        self._last = time.monotonic()
        self.beat.progress_time = time.time()

    def stop(self) -> None:
        self._done.set()

    def _run(self) -> None:
        while not self._done.wait(self.heartbeat_s):
            self.beat.time = time.time()
            try:
                write_beat(self.path, self.beat)
            except OSError:
                pass  # a full or flaky filesystem must not kill the rank; peers see a stale beat
            idle = time.monotonic() - self._last
            if idle > self.limit_s and self.fired_after_s is None:
                self.fired_after_s = idle
                self.on_hang(idle)
