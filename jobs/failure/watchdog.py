"""A watchdog per rank: notices when no step completes in time, when a peer's heartbeat stops, and a stop
signal during start-up; its heartbeat is written by a thread of its own.

Limits: before the first step `failure.init_timeout_s` (rendezvous, build, load and the first step are
slow); after it `failure.hang_timeout_s`; in a phase given its own limit (a checkpoint write or the
wait for one: `failure.checkpoint_timeout_s`) that limit. When the limit passes, `on_hang` runs once in
the watchdog thread, which keeps running while the main thread is blocked inside a collective.

Peers: once a step completed, while this rank makes no progress (it waits, most likely inside a
collective), its heartbeat thread reads the heartbeats of a few peers each beat (ranks r+1, r+2, r+4,
... mod world size, so every rank is watched by about log2(world size) others). A peer whose beat has
not changed for `failure.missed_beats` heartbeats, while this rank has waited as long and its own beats
are being written, is dead or stopped without a TCP reset (a powered-off node, a SIGSTOP, NCCL):
`on_hang` runs then, after about (missed_beats + 1) heartbeats rather than the hang timeout. Not before
the first step (imports, build and the first step can starve a beat thread for seconds; the init
timeout and TCP resets cover start-up), and not for a peer on this host whose process still runs (it
is busy holding the GIL, and the hang timeout names it if it never comes back).

Files never stall the watchdog: the heartbeat thread writes this rank's beat and reads its peers'
(a hung shared filesystem blocks only that thread), and the watchdog thread itself touches no file.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from jobs.failure.heartbeat import Beat, beat_path, process_state, read_beat, write_beat
from jobs.log import get_logger

__all__ = ["Watchdog", "watched_peers", "EARLY_PHASES", "ENDED"]

# Phases in which a stop signal ends the attempt at once (nothing trained yet, nothing to save).
EARLY_PHASES = frozenset({"rendezvous", "build", "load"})
# The phase of a rank's last beat when it ended its attempt cleanly: gone, not dead. A peer still in its own final
# checkpoint wait once counted three such ranks as dead and restarted a completed attempt (CI, the partner case).
ENDED = "ended"


def watched_peers(rank: int, world_size: int) -> list[int]:
    """The peers whose heartbeats `rank` reads while it waits: r+1, r+2, r+4, ... (mod world size)."""
    out, k = [], 1
    while k < world_size:
        out.append((rank + k) % world_size)
        k *= 2
    return list(dict.fromkeys(out))


class Watchdog:
    def __init__(
        self,
        *,
        run_dir: str,
        attempt: str,
        rank: int,
        node: str,
        heartbeat_s: float,
        init_timeout_s: float,
        hang_timeout_s: float,
        on_hang: Callable[[float], None],
        world_size: int = 1,
        missed_beats: int = 5,
        stop_received: Callable[[], bool] | None = None,
        on_stop: Callable[[], None] | None = None,
    ) -> None:
        self.run_dir, self.attempt = run_dir, attempt
        self.path = beat_path(run_dir, attempt, rank)
        self.heartbeat_s, self.hang_timeout_s, self.on_hang = heartbeat_s, hang_timeout_s, on_hang
        self.stale_s = missed_beats * heartbeat_s
        self.peers = watched_peers(rank, world_size)
        self.stop_received, self.on_stop = stop_received, on_stop
        self._base_s = init_timeout_s  # the limit outside phases that have their own
        self.limit_s = init_timeout_s
        self.beat = Beat(
            rank=rank,
            pid=os.getpid(),
            host=os.uname().nodename,
            node=node,
            time=time.time(),
            step=-1,
            phase="rendezvous",
            progress_time=time.time(),
        )
        self._last = time.monotonic()
        self._written = float("-inf")  # the last successful write of this rank's beat (none yet)
        self._seen: dict[int, tuple[float, float]] = {}  # peer -> (its beat's time, when this rank saw it change)
        self.stale_peers: list[int] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshjob-watchdog", daemon=True)
        self._beater = threading.Thread(target=self._beat_loop, name="meshjob-heartbeat", daemon=True)
        self.fired_after_s: float | None = None
        self.fired_because: str | None = None

    def start(self) -> Watchdog:
        """Starts both threads; returns at once (the first beat is written by the heartbeat thread)."""
        self._beater.start()
        self._thread.start()
        return self

    def progress(self, step: int) -> None:
        """A step completed: the clock restarts and, from now on, the limit is the hang timeout."""
        self.beat.step, self._base_s = step, self.hang_timeout_s
        self.limit_s = self._base_s
        self._moved()

    def phase(self, name: str, *, limit_s: float | None = None) -> None:
        """The rank moved on to `name` (build, load, train, checkpoint_save, ...): counts as progress.
        `limit_s`: this phase's own limit (until the next phase or step); else the hang or init timeout."""
        self.beat.phase = name
        self.limit_s = self._base_s if limit_s is None else limit_s
        self._moved()

    def _moved(self) -> None:
        self._last = time.monotonic()
        self.beat.progress_time = time.time()

    def stop(self, *, ended: bool = False) -> None:
        """Stops both threads. `ended`: the rank ended its attempt cleanly; its heartbeat thread writes one last beat
        saying so (waited for up to two heartbeats), which its watchers never count as stale."""
        if ended:
            self.beat.phase = ENDED
        self._done.set()
        if ended and self._beater.is_alive():
            self._beater.join(timeout=2 * self.heartbeat_s)

    def _write(self) -> None:
        self.beat.time = time.time()
        try:
            write_beat(self.path, self.beat)
            self._written = time.monotonic()
        except OSError:
            pass  # a full or flaky filesystem must not kill the rank; peers see a stale beat

    def _beat_loop(self) -> None:
        """Writes this rank's beat every heartbeat; while this rank waits, reads its watched peers' beats."""
        while True:
            self._write()
            if self.peers and self.beat.step >= 1 and time.monotonic() - self._last > self.heartbeat_s:  # waiting
                self.stale_peers = self._read_peers()
            else:
                self._seen.clear()  # progress: peers are alive; start counting afresh at the next wait
                self.stale_peers = []
            if self._done.wait(self.heartbeat_s):
                if self.beat.phase == ENDED:
                    self._write()
                return

    def _read_peers(self) -> list[int]:
        """The watched peers whose beat has not changed for `stale_s` (by this rank's clock)."""
        now, stale = time.monotonic(), []
        for r in self.peers:
            b = read_beat(self.run_dir, self.attempt, r)
            if b is not None and b.phase == ENDED:
                continue  # it ended its attempt cleanly
            t = None if b is None else b.time
            seen = self._seen.get(r)
            if seen is None or seen[0] != t:
                self._seen[r] = (t, now)
            elif now - seen[1] > self.stale_s and (b is None or process_state(b) != "running"):
                stale.append(r)  # a peer on this host that still runs is busy (its beat thread starved), not gone
        return stale

    def _run(self) -> None:
        log = get_logger()
        while not self._done.wait(min(self.heartbeat_s, 1.0)):
            if self.fired_after_s is not None:
                continue
            try:
                self._check()
            except Exception:  # noqa: BLE001 - the watchdog thread must outlive any error of a callback
                log.exception("watchdog: %s failed", self.fired_because)

    def _check(self) -> None:
        idle = time.monotonic() - self._last
        if (
            self.on_stop is not None
            and self.stop_received is not None
            and self.beat.phase in EARLY_PHASES
            and self.stop_received()
        ):
            self._fire(idle, f"stop signal during {self.beat.phase}: ending the attempt before training")
            self.on_stop()
            return
        if idle > self.limit_s:
            self._fire(idle, f"no progress in {self.beat.phase} for {idle:.1f} s > {self.limit_s:g} s")
            self.on_hang(idle)
            return
        own_fresh = time.monotonic() - self._written <= self.stale_s
        stale = self.stale_peers if idle > self.stale_s and own_fresh else []
        if stale:
            self._fire(idle, f"heartbeat of rank(s) {stale} unchanged for > {self.stale_s:g} s")
            self.on_hang(idle)

    def _fire(self, idle: float, why: str) -> None:
        self.fired_after_s, self.fired_because = idle, why
        get_logger().error("watchdog: %s", why)
