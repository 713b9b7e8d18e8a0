"""Attempts, read back from `events.jsonl`: when each began and ended, how, the steps it gained, the suspects.

An attempt is one start of the job's ranks (`attempt` = `<job id>.<restart>` under Slurm,
`local.<n>` for the local launcher). Its start is written by rank 0 or the local launcher; its end
by whoever decided what happens next; an end that nobody could write (the whole job was killed) is
filled in by the next attempt's start as `lost`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["Attempt", "attempts", "unfinished", "attempts_without_progress", "render_summary"]


@dataclass
class Attempt:
    attempt: str
    start: float
    job_id: str | None = None
    nodes: list[str] = field(default_factory=list)
    end: float | None = None
    cause: str | None = None  # completed | a signal name | an incident class | lost; None while running
    action: str | None = None  # done | requeue | stop | none
    start_step: int | None = None  # the step training resumed from
    last_step: int | None = None  # the newest step this attempt trained (metrics of the last event)
    saved_step: int | None = None  # the newest checkpoint this attempt committed
    resumed_tier: str | None = (
        None  # the checkpoint tier it resumed from: memory | partner | filesystem; None = none loaded
    )
    suspects: list[str] = field(default_factory=list)

    @property
    def steps_gained(self) -> int:
        """Committed progress: the newest checkpoint this attempt committed minus where it resumed."""
        if self.saved_step is None:
            return 0
        return self.saved_step - (self.start_step or 0)


def attempts(events: list[dict]) -> list[Attempt]:
    """One `Attempt` per `attempt_start` in the ledger, in order, filled from the attempt's events."""
    out: dict[str, Attempt] = {}
    for e in events:
        key = e.get("attempt")
        if e.get("kind") == "attempt_start" and key not in out:
            out[key] = Attempt(key, e["time"], job_id=e.get("job_id"), nodes=list(e.get("nodes") or []))
        a = out.get(key)
        if a is not None:
            _apply(a, e)
    return list(out.values())


def _apply(a: Attempt, e: dict) -> None:
    kind = e.get("kind")
    if kind == "train_start":
        a.start_step = e.get("step")
    elif kind == "checkpoint_saved":  # trained at least this far, whatever its end could record
        a.saved_step = max(a.saved_step or 0, e.get("step", 0))
        a.last_step = max(a.last_step or 0, a.saved_step)
    elif kind == "checkpoint_loaded" and a.start_step is None:
        a.start_step = e.get("step")
        a.resumed_tier = e.get("tier", "filesystem")  # ledgers from before the RAM tier: the filesystem
    elif kind in ("step", "first_step", "stop_requested", "train_end"):
        a.last_step = _step_or(e, a.last_step)
    elif kind == "failure":
        a.suspects += [
            f"rank {s.get('rank')} ({s.get('node', '?')}, {s.get('state', '?')})" for s in e.get("suspects", [])
        ]
    elif kind == "attempt_end" and a.end is None:
        a.end, a.cause, a.action = e["time"], e.get("cause"), e.get("action")
        a.last_step = _step_or(e, a.last_step)
        if a.saved_step is not None:  # an end that knew less (a peer's stale step) than the attempt committed
            a.last_step = max(a.last_step or 0, a.saved_step)


def _step_or(e: dict, last: int | None) -> int | None:
    """An event's step, or the one known so far: a death before the first step records `step: null`."""
    return last if e.get("step") is None else e["step"]


def unfinished(events: list[dict], *, current: str) -> list[Attempt]:
    """Earlier attempts with a start but no end: their ranks died before anyone could write it."""
    return [a for a in attempts(events) if a.end is None and a.attempt != current]


def attempts_without_progress(events: list[dict]) -> int:
    """How many attempts in a row, counting back from the newest, committed no new checkpoint."""
    n = 0
    for a in reversed(attempts(events)):
        if a.saved_step is not None and a.steps_gained > 0:
            break
        n += 1
    return n


def render_summary(events: list[dict], *, title: str = "attempts") -> str:
    """The one-screen table of every attempt: when, how long, how it ended, steps gained, suspects."""
    rows = attempts(events)
    lines = [
        f"{title}: {len(rows)}",
        f"  {'#':>2}  {'attempt':<14} {'started':<19} {'ran':>8}  {'from':<4} {'steps':>11}  {'+ckpt':>5}  "
        f"{'ended':<20} {'then':<8} suspects",
    ]
    for i, a in enumerate(rows):
        ran = (a.end or time.time()) - a.start
        steps = (
            f"{a.start_step if a.start_step is not None else '-'}->{a.last_step if a.last_step is not None else '-'}"
        )
        lines.append(
            f"  {i:>2}  {a.attempt:<14} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(a.start))} "
            f"{_dur(ran):>8}  {_TIER_SHORT.get(a.resumed_tier or '', '-'):<4} {steps:>11}  {a.steps_gained:>5}  {a.cause or 'running':<20} "
            f"{a.action or '-':<8} {', '.join(dict.fromkeys(a.suspects)) or '-'}"
        )
    return "\n".join(lines)


# the summary's `from` column (`memory_partner`: the partner tier's name in ledgers written before it had one name)
_TIER_SHORT = {"memory": "ram", "partner": "peer", "memory_partner": "peer", "filesystem": "fs"}


def _dur(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
