"""Incidents: what failed, which ranks and nodes are suspect, and the evidence, from the heartbeats.

A surviving rank classifies from what it can see: every rank's heartbeat (age on this rank's own clock, step,
phase, pid and host, whether its main thread is stuck outside torch.distributed), the liveness of peers on its own
host, and the error it caught, if any. One JSON per
incident goes to `RUN_DIR/incidents/`, beside the stack dumps of the ranks that could still act.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

from jobs.failure.heartbeat import Beat, process_state, read_beats, stuck
from jobs.log import get_logger
from jobs.records import stamped

__all__ = [
    "Incident",
    "classify",
    "classify_settled",
    "dump_stacks",
    "stacks_text",
    "write_incident",
    "error_class",
    "REQUEUE_CLASSES",
    "RESTART_CLASSES",
]

# Classes whose cure is a fresh start of the job (requeue); the others stop it (a bug or bad input
# would fail the same way again). An unhealthy GPU (jobs.telemetry.health) is requeued without its node,
# never restarted inside the allocation (the same GPU again); so is silent data corruption (`sdc`, jobs/failure/sdc.py).
REQUEUE_CLASSES = frozenset(
    {
        "dead_rank",
        "hung_rank",
        "collective_timeout",
        "collective_mismatch",
        "rendezvous_failure",
        "everything_slow",
        "rank_crashed",
        "preempted",
        "checkpoint_error",
        "unhealthy_gpu",
        "sdc",
        "step_launch_failure",  # srun could not create or launch the ranks' step (jobs.launch.supervise)
    }
)

# Classes a restart of the ranks inside the same allocation cures when the suspects' nodes still answer.
RESTART_CLASSES = frozenset({"dead_rank", "hung_rank", "collective_timeout", "rank_crashed"})

_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "ECONNRESET")
# A timeout is a collective's only when torch.distributed says so: its own error types, or a timeout in
# the text of a communication library (gloo: "[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out
# waiting 5000ms for recv", NCCL's watchdog: "Watchdog caught collective operation timeout"). A data
# loader's or a file system's "timed out" is an ordinary error of this rank.
_DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")
_COMM_LIBS = ("gloo", "nccl", "NCCL", "c10d", "ProcessGroup")
_TIMEOUT = ("Timed out", "timed out", "Timeout", "timeout")


@dataclass
class Incident:
    cls: str  # dead_rank | hung_rank | collective_timeout | collective_mismatch | rendezvous_failure | ...
    attempt: str
    reported_by: int  # the rank that classified it (-1: the local launcher)
    summary: str
    suspects: list[dict] = field(default_factory=list)  # {rank, node, host, pid, state, step, phase, beat_age_s}
    evidence: dict = field(default_factory=dict)
    time: float = field(default_factory=time.time)


def error_class(e: BaseException | None) -> str | None:
    """The class an exception's text implies about the job ('collective_timeout', 'peer_gone',
    'out_of_memory', 'checkpoint_error'), or None for an ordinary error."""
    if e is None:
        return None
    text = f"{type(e).__name__}: {e}"
    if "OutOfMemoryError" in text or "out of memory" in text:
        return "out_of_memory"
    if type(e).__name__ == "CheckpointSaveError":
        return "checkpoint_error"
    if any(s in text for s in _PEER_GONE):
        return "peer_gone"
    if type(e).__name__ in _DIST_ERRORS or (any(s in text for s in _TIMEOUT) and any(s in text for s in _COMM_LIBS)):
        return "collective_timeout"
    return None


def _suspect(b: Beat, state: str, age_s: float) -> dict:
    return {
        "rank": b.rank,
        "node": b.node,
        "host": b.host,
        "pid": b.pid,
        "state": state,
        "step": b.step,
        "phase": b.phase,
        "beat_age_s": round(age_s, 2),
        "idle_s": b.idle_s,
        "in_collective": b.in_collective,
    }


def classify(
    *,
    beats: dict[int, Beat],
    world_size: int,
    me: int,
    attempt: str,
    heartbeat_s: float,
    error: BaseException | None = None,
    during: str = "train",
    ages: dict[int, float] | None = None,
) -> Incident:
    """Names the failure from the heartbeats of every rank and the error this rank caught (if any). `ages`: seconds
    since each rank's beat last changed, on this rank's clock (`classify_settled`, the watchdog's board); without
    them a beat's age is this clock minus the beat's own time (a skewed clock reads as age)."""
    now, stale_s = time.time(), 3 * heartbeat_s
    age = dict(ages) if ages is not None else {r: now - b.time for r, b in beats.items()}
    hint = error_class(error)
    missing = [r for r in range(world_size) if r not in beats]
    ev = _evidence(beats, age=age, error=error, during=during)
    if missing and during == "rendezvous":
        return Incident(
            "rendezvous_failure",
            attempt,
            me,
            f"ranks {missing} never joined the rendezvous",
            [{"rank": r, "state": "never_joined"} for r in missing],
            ev,
        )
    if inc := _dead_or_stale(beats, me=me, attempt=attempt, hint=hint, ev=ev, age=age, stale_s=stale_s):
        return inc
    if inc := _stuck_outside_collectives(beats, me=me, attempt=attempt, ev=ev, age=age):
        return inc
    return _all_alive(beats, me=me, attempt=attempt, hint=hint, error=error, ev=ev, age=age)


def _evidence(beats: dict[int, Beat], *, age: dict[int, float], error: BaseException | None, during: str) -> dict:
    return {
        "error": f"{type(error).__name__}: {error}"[:2000] if error else None,
        "during": during,
        "beats": {
            r: {"step": b.step, "phase": b.phase, "age_s": round(age[r], 2), "idle_s": b.idle_s}
            for r, b in beats.items()
        },
    }


def _dead_or_stale(
    beats: dict[int, Beat],
    *,
    me: int,
    attempt: str,
    hint: str | None,
    ev: dict,
    age: dict[int, float],
    stale_s: float,
) -> Incident | None:
    """`dead_rank` for peers whose process is gone (or, after a peer-gone error, unseen with a stale beat),
    `hung_rank` for the other peers whose beat is stale; None when every peer's beat is fresh."""
    states = {r: process_state(b) for r, b in beats.items() if r != me}
    dead = [r for r, s in states.items() if s == "dead"]
    stale = [r for r in beats if r != me and age[r] > stale_s and r not in dead]
    if hint == "peer_gone":
        dead += [r for r in stale if states[r] == "unknown"]
        stale = [r for r in stale if r not in dead]
    if dead:
        return Incident(
            "dead_rank",
            attempt,
            me,
            _names("dead", dead, beats),
            [_suspect(beats[r], "dead", age[r]) for r in sorted(dead)],
            ev,
        )
    if stale:
        return Incident(
            "hung_rank",
            attempt,
            me,
            _names("hung (heartbeat stale, process alive or unseen)", stale, beats),
            [_suspect(beats[r], states.get(r, "unknown"), age[r]) for r in sorted(stale)],
            ev,
        )
    return None


def _stuck_outside_collectives(
    beats: dict[int, Beat], *, me: int, attempt: str, ev: dict, age: dict[int, float]
) -> Incident | None:
    # Alive, its beats going on, its main thread stuck outside a collective past its phase's limit while other ranks
    # are not: a device call or a loop that never returns (its peers wait for it). All of them so: everything slow.
    hung = [r for r, b in beats.items() if stuck(b)]
    if not hung or len(hung) >= len(beats):
        return None
    return Incident(
        "hung_rank",
        attempt,
        me,
        _names(
            "hung (its main thread made no progress outside a collective past its limit; its heartbeat went on)",
            hung,
            beats,
        ),
        [_suspect(beats[r], "stuck", age[r]) for r in sorted(hung)],
        ev,
    )


def _all_alive(
    beats: dict[int, Beat],
    *,
    me: int,
    attempt: str,
    hint: str | None,
    error: BaseException | None,
    ev: dict,
    age: dict[int, float],
) -> Incident:
    if len({(b.step, b.phase) for b in beats.values()}) > 1:
        return _collective_mismatch(beats, me=me, attempt=attempt, ev=ev, age=age)
    if hint == "collective_timeout" or hint == "peer_gone":
        return Incident(
            "collective_timeout",
            attempt,
            me,
            f"a collective failed ({hint}) with every rank alive and at the same step",
            [],
            ev,
        )
    if error is not None:
        return _own_error(beats, me=me, attempt=attempt, hint=hint, error=error, ev=ev, age=age)
    if ev["during"].startswith("checkpoint"):  # the watchdog's checkpoint_timeout_s passed
        return Incident(
            "checkpoint_error",
            attempt,
            me,
            f"every rank is alive, but the checkpoint write "
            f"({ev['during']}) did not finish within failure.checkpoint_timeout_s",
            [],
            ev,
        )
    return Incident(
        "everything_slow",
        attempt,
        me,
        "every rank is alive, heartbeating and at the same step, but none completed it within failure.hang_timeout_s",
        [],
        ev,
    )


def _collective_mismatch(beats: dict[int, Beat], *, me: int, attempt: str, ev: dict, age: dict[int, float]) -> Incident:
    """Ranks waiting in different places cannot be in the same collective; the smallest group is suspect."""
    groups: dict[tuple, list[int]] = {}
    for r, b in beats.items():
        groups.setdefault((b.step, b.phase), []).append(r)
    minority = min(groups.values(), key=len)
    return Incident(
        "collective_mismatch",
        attempt,
        me,
        "ranks stopped in different places: "
        + "; ".join(f"ranks {sorted(rs)} at step {s} ({p})" for (s, p), rs in sorted(groups.items())),
        [_suspect(beats[r], "running", age[r]) for r in sorted(minority)],
        ev,
    )


def _own_error(
    beats: dict[int, Beat],
    *,
    me: int,
    attempt: str,
    hint: str | None,
    error: BaseException,
    ev: dict,
    age: dict[int, float],
) -> Incident:
    """This rank's own failure with every rank alive: out of memory or a checkpoint error by name, else a crash."""
    if hint in ("out_of_memory", "checkpoint_error"):
        cls, state, summary = hint, hint, f"rank {me}: {type(error).__name__}: {error}"
    else:
        cls, state, summary = "rank_crashed", "crashed", f"rank {me} raised {type(error).__name__}: {error}"
    return Incident(
        cls,
        attempt,
        me,
        summary[:300],
        [_suspect(beats[me], state, age[me])] if me in beats else [],
        ev,
    )


def _names(what: str, ranks: list[int], beats: dict[int, Beat]) -> str:
    return "; ".join(f"rank {r} (node {beats[r].node}, pid {beats[r].pid}) {what}" for r in sorted(ranks))


def classify_settled(
    *,
    run_dir: str,
    world_size: int,
    me: int,
    attempt: str,
    heartbeat_s: float,
    error: BaseException | None = None,
    during: str = "train",
) -> Incident:
    """`classify`, waiting up to three heartbeats for a dead or hung peer's beat to go stale (right after a peer dies
    its last beat is still fresh, and on another host its pid cannot be checked). A beat's age is how long, on this
    rank's clock, it has not changed since the first read: a peer's skewed clock or a late file never reads as age
    beyond that."""
    deadline = time.monotonic() + 4 * heartbeat_s
    changed: dict[int, tuple[tuple, float]] = {}  # rank -> (its beat's identity, when this rank saw it change)
    while True:
        beats, now = read_beats(run_dir, attempt), time.monotonic()
        for r, b in beats.items():
            if changed.get(r, ((),))[0] != (b.beat, b.time):
                changed[r] = ((b.beat, b.time), now)
        inc = classify(
            beats=beats,
            ages={r: now - changed[r][1] for r in beats},
            world_size=world_size,
            me=me,
            attempt=attempt,
            heartbeat_s=heartbeat_s,
            error=error,
            during=during,
        )
        if inc.cls in ("dead_rank", "hung_rank", "rendezvous_failure") or time.monotonic() > deadline:
            return inc
        time.sleep(heartbeat_s / 2)


def incident_dir(run_dir: str | os.PathLike[str], attempt: str) -> Path:
    return Path(run_dir) / "incidents" / attempt


def dump_stacks(run_dir: str | os.PathLike[str], attempt: str, rank: int) -> Path | None:
    """Every thread's Python stack of this process, into `incidents/<attempt>/stacks-rank<r>.txt`; None
    when the file cannot be written (a full or read-only disk must not stop the failure path)."""
    path = incident_dir(run_dir, attempt) / f"stacks-rank{rank}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(stacks_text())
    except OSError as e:
        get_logger().error("stacks not written to %s: %s", path, e)
        return None
    return path


def stacks_text() -> str:
    """Every Python thread's stack (its name, most recent call first), from `sys._current_frames()`, which reads the
    thread states under the interpreter's lock. `faulthandler.dump_traceback(all_threads=True)` walks them without
    it and crashes the process when a thread exits meanwhile (cpython#116008): a healthy rank that dumped its stacks
    on a peer's failure died of SIGSEGV in it here, and the local launcher then reported a dead rank (exit 4)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    me, out = threading.get_ident(), []
    for ident, frame in sys._current_frames().items():
        mark = " (the failure path)" if ident == me else ""
        out.append(f"Thread 0x{ident:x} {names.get(ident, '?')}{mark} (most recent call first):\n")
        out.extend(reversed(traceback.format_stack(frame)))
        out.append("\n")
    return "".join(out)


def write_incident(run_dir: str | os.PathLike[str], inc: Incident) -> Path | None:
    """`incidents/<attempt>/incident.json` (temp + rename), with the stack dumps found beside it; None
    when it cannot be written (the decision and the requeue still follow; the ledger has the failure)."""
    folder = incident_dir(run_dir, inc.attempt)
    path = folder / "incident.json"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        record = stamped({**asdict(inc), "stacks": sorted(p.name for p in folder.glob("stacks-rank*.txt"))})
        tmp = folder / ".incident.json.tmp"
        tmp.write_text(json.dumps(record, indent=1, default=str))
        os.replace(tmp, path)
    except OSError as e:
        get_logger().error("incident not written to %s: %s", path, e)
        return None
    return path
