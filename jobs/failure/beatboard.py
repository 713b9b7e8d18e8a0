"""Heartbeats through the rendezvous TCPStore, off the shared filesystem, judged on the watcher's own clock.

Each rank's heartbeat thread sets its beat (`jobs.failure.heartbeat.Beat` as JSON) under
`meshjob/beats/<attempt>/<rank>` of the store the ranks met through (rank 0's, or torchrun's agent store), on a
connection of its own; a watcher gets its peers' beats in one `multi_get`. A slow or hung parallel filesystem
(the state in which checkpoints are slow) never delays a beat, and the filesystem sees no metadata operation per
beat. As NVRx's rank monitor and torchft's lighthouse do, the watcher never compares a peer's timestamp with its
own clock: `Sightings` records, on this rank's monotonic clock, when it last saw each peer's beat counter change,
and a peer's own durations (`idle_s`: how long its main thread has made no progress) travel in its beat.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch.distributed as dist

from jobs.failure.heartbeat import Beat

__all__ = ["BeatBoard", "Sighting", "Sightings"]


class BeatBoard:
    """This attempt's beats in the rendezvous store at `host:port`; every call may raise (the store's host gone)."""

    def __init__(self, host: str, port: int, *, attempt: str, timeout_s: float) -> None:
        self._store = dist.TCPStore(
            host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self._prefix = f"meshjob/beats/{attempt}/"

    def post(self, beat: Beat) -> None:
        self._store.set(f"{self._prefix}{beat.rank}", json.dumps(asdict(beat)))

    def read(self, ranks: list[int]) -> dict[int, Beat]:
        """The newest beat of each of `ranks` that posted one (`multi_get` waits for absent keys, so only the
        ranks that posted are asked)."""
        keys = [f"{self._prefix}{r}" for r in ranks]
        if keys and not self._store.check(keys):
            keys = [k for k in keys if self._store.check([k])]
        if not keys:
            return {}
        return {int(k.rsplit("/", 1)[1]): Beat(**json.loads(v)) for k, v in zip(keys, self._store.multi_get(keys))}


@dataclass(slots=True)
class Sighting:
    beat: Beat  # the newest beat seen
    changed: float  # this rank's monotonic time when the peer's beat counter last changed


class Sightings:
    """When this rank last saw each peer's beat counter change, on this rank's own monotonic clock."""

    def __init__(self) -> None:
        self.seen: dict[int, Sighting] = {}

    def update(self, beats: dict[int, Beat], *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for r, b in beats.items():
            s = self.seen.get(r)
            if s is None or s.beat.beat != b.beat:
                self.seen[r] = Sighting(b, now)
            else:
                s.beat = b

    def silent_s(self, rank: int, *, now: float | None = None) -> float:
        """Seconds (this rank's clock) since `rank`'s beat counter last changed; 0 when never seen."""
        s = self.seen.get(rank)
        return 0.0 if s is None else (time.monotonic() if now is None else now) - s.changed

    def clear(self) -> None:
        self.seen.clear()
