"""A watchdog per rank: notices when no step completes in time, when a peer's heartbeat stops or its main thread
is stuck while its heartbeat goes on, and a stop signal during start-up; its heartbeat is sent by a thread of its own.

Limits: before the first step `failure.init_timeout_s` (rendezvous, build, load and the first step are
slow); after it `failure.hang_timeout_s`; in a phase given its own limit (a checkpoint write or the
wait for one: `failure.checkpoint_timeout_s`) that limit. When the limit passes, `on_hang` runs once in
the watchdog thread, which keeps running while the main thread is blocked inside a collective. Not while
another rank is alive in a phase with a longer limit of its own and still within it (a save on a slow
filesystem holds its peers up in their next collective): its limit is theirs.

Beats travel through the rendezvous store (`jobs.failure.beatboard`), never the shared filesystem, once the ranks
met; each carries the main loop's progress: step, phase, a counter the main thread advances and, measured on the
rank's own clock, how long it has not moved and that phase's limit. The file copy of the beat is for tools
(`jobs.failure.heartbeat`); the watchdog never reads it.

Peers: once a step completed, while this rank makes no progress (it waits, most likely inside a
collective), its heartbeat thread reads the beats of a few peers each beat (ranks r+1, r+2, r+4,
... mod world size, so every rank is watched by about log2(world size) others). On this rank's clock:
a peer whose beat counter has not changed for `failure.missed_beats` heartbeats, while this rank has
waited as long and its own beats get through, is dead or stopped without a TCP reset (a powered-off node, a
SIGSTOP, NCCL); a peer whose beats go on while its main thread, outside torch.distributed, has not moved for
longer than its phase's limit is stuck (a device call that never returns). Either runs `on_hang` with
`incident` naming them. Not before the first step (imports, build and the first step can starve a beat thread
for seconds; the init timeout and TCP resets cover start-up), and not for a peer on this host whose process still
runs (it is busy holding the GIL, and the hang timeout names it if it never comes back). When the store itself
cannot be reached for as long, its host (rank 0's process) is named.
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from collections.abc import Callable

from jobs.failure.beatboard import BeatBoard, Sightings
from jobs.failure.heartbeat import ENDED, Beat, beat_path, process_state, stuck, write_beat
from jobs.failure.incident import Incident, classify
from jobs.log import get_logger

__all__ = ["Watchdog", "watched_peers", "EARLY_PHASES", "ENDED"]

# Phases in which a stop signal ends the attempt at once (nothing trained yet, nothing to save).
EARLY_PHASES = frozenset({"rendezvous", "build", "load"})
_TORCH_DISTRIBUTED = f"{os.sep}torch{os.sep}distributed{os.sep}"


def hold_hops_max(world_size: int) -> int:
    """How far a hold travels: about log2(world size) watchers separate any rank from the one holding it up (the
    watch graph's diameter), plus one. A hold passed on more often than that can only be an echo of itself."""
    return max(2, math.ceil(math.log2(max(world_size, 2))) + 1)


def watched_peers(rank: int, world_size: int) -> list[int]:
    """The peers whose heartbeats `rank` reads while it waits: r+1, r+2, r+4, ... (mod world size)."""
    out, k = [], 1
    while k < world_size:
        out.append((rank + k) % world_size)
        k *= 2
    return list(dict.fromkeys(out))


def in_collective(thread_id: int) -> bool:
    """Whether the thread `thread_id` is inside torch.distributed now (a collective, or a wait on one)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if _TORCH_DISTRIBUTED in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


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
        self.run_dir, self.attempt, self.world_size = run_dir, attempt, world_size
        self.path = beat_path(run_dir, attempt, rank)
        self.heartbeat_s, self.hang_timeout_s, self.on_hang = heartbeat_s, hang_timeout_s, on_hang
        self.stale_s = missed_beats * heartbeat_s
        self.peers = watched_peers(rank, world_size)
        self.stop_received, self.on_stop = stop_received, on_stop
        self._base_s = init_timeout_s  # the limit outside phases that have their own
        self.limit_s = init_timeout_s
        self._borrowed_s = 0.0  # a watched peer's longer limit this rank waits under (`_held_up`), else 0
        self._borrowed_hops = 0  # how many ranks that limit passed through (`Beat.hold_hops`)
        self._max_hops = hold_hops_max(world_size)
        self._first_step: int | None = None  # the first step this rank completed in this attempt
        now = time.time()
        self.beat = Beat(rank, os.getpid(), os.uname().nodename, node, now, -1, "rendezvous", now, limit_s=self.limit_s)
        self._main = threading.get_ident()  # the thread whose progress is judged (the one that built the watchdog)
        self._last = time.monotonic()
        self.board: BeatBoard | None = None  # set by `attach` once the ranks met
        self._posted = float("-inf")  # the last beat the board took (none yet)
        self._seen = Sightings()  # the watched peers, while this rank waits
        self.stale_peers: list[int] = []  # watched peers whose beats stopped, or [0]: the store's host, unreachable
        self.stuck_peers: list[int] = []  # watched peers that beat while their main thread is stuck
        self.incident: Incident | None = None  # what the watchdog saw when it fired (from the board), for on_hang
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="meshjob-watchdog", daemon=True)
        self._beater = threading.Thread(target=self._beat_loop, name="meshjob-heartbeat", daemon=True)
        self._filer = threading.Thread(target=self._file_loop, name="meshjob-heartbeat-file", daemon=True)
        self.fired_after_s: float | None = None
        self.fired_because: str | None = None

    def start(self) -> Watchdog:
        """Starts the threads; returns at once (the first beat is written by the heartbeat threads)."""
        self._filer.start()
        self._beater.start()
        self._thread.start()
        return self

    def attach(self, host: str, port: int, *, timeout_s: float | None = None) -> None:
        """From now on beats go through the rendezvous store at `host:port` (the ranks met there). A store that
        cannot be reached leaves the watchdog on its own limits (logged)."""
        try:
            self.board = BeatBoard(host, port, attempt=self.attempt, timeout_s=timeout_s or self.stale_s)
        except Exception as e:  # noqa: BLE001 - the watchdog's own limits still hold without peers' beats
            get_logger().warning("watchdog: the rendezvous store %s:%d cannot take heartbeats (%s)", host, port, e)

    def progress(self, step: int) -> None:
        """A step completed: the clock restarts and, from now on, the limit is the hang timeout."""
        if self._first_step is None:
            self._first_step = step
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
        self._last, self._borrowed_s = time.monotonic(), 0.0
        self.beat.tick += 1
        self.beat.progress_time = time.time()

    def stop(self, *, ended: bool = False) -> None:
        """Stops the threads. `ended`: the rank ended its attempt cleanly; its heartbeat threads send one last beat
        saying so (waited for up to two heartbeats), which its watchers never count as stale."""
        if ended:
            self.beat.phase = ENDED
        self._done.set()
        for t in (self._beater, self._filer) if ended else ():
            if t.is_alive():
                t.join(timeout=2 * self.heartbeat_s)

    def _stamp(self) -> None:
        """The beat's fields that the heartbeat thread fills in: what the main thread is doing, and for how long."""
        self.beat.beat += 1
        self.beat.time = time.time()
        self.beat.idle_s = round(time.monotonic() - self._last, 3)
        self.beat.limit_s = self.limit_s
        held = self._borrowed_s > self.limit_s
        self.beat.hold_s, self.beat.hold_hops = (self._borrowed_s, self._borrowed_hops) if held else (0.0, 0)
        self.beat.in_collective = in_collective(self._main)

    def _post(self) -> None:
        self._stamp()
        if self.board is None:
            return
        try:
            self.board.post(self.beat)
            self._posted = time.monotonic()
        except Exception:  # noqa: BLE001 - the store's host gone or slow: peers see a silent beat, this rank knows
            pass

    def _file_loop(self) -> None:
        """The file copy of this rank's beat, every heartbeat (a hung filesystem blocks only this thread)."""
        while True:
            self._write_file()
            if self._done.wait(self.heartbeat_s):
                if self.beat.phase == ENDED:
                    self._write_file()
                return

    def _write_file(self) -> None:
        try:
            write_beat(self.path, self.beat)
        except OSError:
            pass  # a full or flaky filesystem must not kill the rank; nothing of the watchdog reads it

    def _beat_loop(self) -> None:
        """Sends this rank's beat every heartbeat; while this rank waits, reads its watched peers' beats."""
        while True:
            self._post()
            if self.peers and self.board is not None and self.beat.step >= 1 and self._waiting():
                self._judge_peers()
            else:
                self._seen.clear()  # progress: peers are alive; start counting afresh at the next wait
                self.stale_peers, self.stuck_peers, self._borrowed_s, self._borrowed_hops = [], [], 0.0, 0
            if self._done.wait(self.heartbeat_s):
                if self.beat.phase == ENDED:
                    self._post()
                return

    def _waiting(self) -> bool:
        return time.monotonic() - self._last > self.heartbeat_s

    def _judge_peers(self) -> None:
        """Stale and stuck watched peers, on this rank's clock; the store's host when the store cannot be read."""
        try:
            beats = self.board.read(self.peers)
        except Exception:  # noqa: BLE001 - the store is gone: its host (rank 0's process) stopped answering
            gone = time.monotonic() - self._posted > self.stale_s
            self.stale_peers = [0] if gone and self.beat.rank != 0 else []
            return
        self._seen.update(beats)
        # A peer alive in a phase with a longer limit, within it (a save on a slow filesystem), holds this rank up in
        # its next collective: this rank waits under that limit and says so in its own beat (`hold_s`), so that the
        # ranks watching it hold too (over about log2(world size) heartbeats; no rank reads every beat). A hold that
        # comes back to its own rank would otherwise keep itself alive after the phase that lent it ended (rank A
        # lends its first step's init timeout to B, B to A, ... and no hang is ever named): it counts its hops.
        self._borrowed_s, self._borrowed_hops = max(
            (h for r, b in beats.items() if self._seen.silent_s(r) <= self.stale_s for h in self._holds(b)),
            default=(0.0, 0),
            key=lambda h: (h[0], -h[1]),  # the longest; of equal ones, the one fewest ranks away
        )
        stale, hung = [], []
        for r in self.peers:
            s = self._seen.seen.get(r)
            if s is None or s.beat.phase == ENDED:
                continue  # not posted yet (the init timeout covers it), or it ended its attempt cleanly
            if self._seen.silent_s(r) > self.stale_s:
                if process_state(s.beat) != "running":  # a peer on this host that runs is busy, not gone
                    stale.append(r)
            elif stuck(s.beat):
                hung.append(r)
        self.stale_peers, self.stuck_peers = stale, hung

    def _holds(self, b: Beat) -> list[tuple[float, int]]:
        """The limits a live peer's beat lends this rank, with their hops: its own phase's while within it, and a
        hold it passes on that has not gone round the watch graph yet."""
        if b.phase == ENDED or self._outdated(b):
            return []
        own = [(b.limit_s, 1)] if b.idle_s < b.limit_s else []
        return own + ([(b.hold_s, b.hold_hops + 1)] if b.hold_s > 0 and b.hold_hops < self._max_hops else [])

    def _outdated(self, b: Beat) -> bool:
        """Whether a peer's beat describes a step it must have left: this rank completed step S, whose collectives
        needed the peer in step S, so the peer completed S - 1 (its first, when S is this rank's second or later).
        A rank stopped just after its first step, before its next beat, still shows that step's init timeout."""
        done = self.beat.step
        if b.step == -1:  # it had completed no step when it beat
            return self._first_step is not None and done > self._first_step
        return b.step < done - 1

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
        if idle > self.limit_s and not self._held_up(idle):
            self._fire(idle, f"no progress in {self.beat.phase} for {idle:.1f} s > {self.limit_s:g} s")
            self._hang(idle)
            return
        own_fresh = time.monotonic() - self._posted <= self.stale_s
        stale = self.stale_peers if idle > self.stale_s and (own_fresh or self.stale_peers == [0]) else []
        if stale:
            self._fire(idle, f"heartbeat of rank(s) {stale} unchanged for > {self.stale_s:g} s")
            self._hang(idle)
        elif self.stuck_peers:
            self._fire(idle, f"rank(s) {self.stuck_peers} beat while their main thread is stuck past their limit")
            self._hang(idle)

    def _held_up(self, idle: float) -> bool:
        """Whether a watched peer holds this rank up under a longer limit of its own (`_judge_peers`)."""
        return idle <= self._borrowed_s

    def _hang(self, idle: float) -> None:
        self.incident = self._board_incident()
        self.on_hang(idle)

    def _board_incident(self) -> Incident | None:
        """The incident as the board shows it: every rank's beat, aged on this rank's clock over up to 3.5 heartbeats
        (a rank that just died still looks fresh); None without a readable board (the file copies tell then)."""
        if self.board is None:
            return None
        deadline, seen = time.monotonic() + 3.5 * self.heartbeat_s, Sightings()
        seen.seen.update(self._seen.seen)  # what the heartbeat thread saw of the watched peers so far
        while True:
            try:
                beats = self.board.read(list(range(self.world_size)))
            except Exception:  # noqa: BLE001 - the store went away meanwhile
                return None
            seen.update(beats)
            ages = {r: seen.silent_s(r) for r in beats}
            if time.monotonic() > deadline or any(a > 3 * self.heartbeat_s for a in ages.values()):
                break
            time.sleep(self.heartbeat_s / 2)
        beats[self.beat.rank] = self.beat
        ages[self.beat.rank] = 0.0
        return classify(
            beats=beats,
            ages=ages,
            world_size=self.world_size,
            me=self.beat.rank,
            attempt=self.attempt,
            heartbeat_s=self.heartbeat_s,
            during=self.beat.phase,
        )

    def _fire(self, idle: float, why: str) -> None:
        self.fired_after_s, self.fired_because = idle, why
        get_logger().error("watchdog: %s", why)
