"""A rank's heartbeat, and its copy on the run dir that tools and later attempts read.

The watchdog's peers get the beats through the rendezvous store (`jobs.failure.beatboard`), judged on the
watcher's own clock. The file copy (`RUN_DIR/heartbeats/<attempt>/rank<r>.json`, temp file + rename, written by a
thread of its own that nothing waits on) is for what must outlive the ranks: `jobs.status` and the run report, the
run-dir owner check (another job still live), the supervisor's and a failed rank's incident (who ran where, at
which step).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Beat", "ENDED", "beat_path", "write_beat", "read_beat", "read_beats", "process_state", "stuck"]

# The phase of a rank's last beat when it ended its attempt cleanly: gone, not dead. A peer still in its own final
# checkpoint wait once counted three such ranks as dead and restarted a completed attempt (CI, the partner case).
ENDED = "ended"


@dataclass(slots=True)
class Beat:
    rank: int
    pid: int
    host: str  # the machine's own name (os.uname), for process liveness checks
    node: str  # the Slurm node name (SLURMD_NODENAME) or the host
    time: float  # wall time of this beat
    step: int  # the last completed step (-1 before the first)
    phase: str  # what the rank is doing: rendezvous, build, load, train, checkpoint_save, ...
    progress_time: float  # wall time of the last completed step or phase change
    beat: int = 0  # counts this rank's beats (its heartbeat thread advances it)
    tick: int = 0  # counts this rank's progress: steps and phases (its main thread advances it)
    idle_s: float = 0.0  # seconds since `tick` last moved, on this rank's own monotonic clock
    limit_s: float = 0.0  # the limit of that wait in this phase (failure.hang_timeout_s, checkpoint_timeout_s, ...)
    hold_s: float = 0.0  # a longer limit this rank waits under because a peer holds it up (0: none), passed on
    hold_hops: int = 0  # how many ranks that hold passed through since the peer whose own phase it is (1: that peer)
    in_collective: bool = False  # the main thread was inside torch.distributed (a collective or a wait on one)


def stuck(b: Beat) -> bool:
    """A rank whose main thread, outside torch.distributed, has made no progress for longer than its phase's limit
    (while its heartbeat thread goes on): stuck in a device call or a loop of its own, not waiting for a peer."""
    return b.phase != ENDED and not b.in_collective and b.limit_s > 0 and b.idle_s > max(b.limit_s, b.hold_s)


def beat_path(run_dir: str | os.PathLike[str], attempt: str, rank: int) -> Path:
    return Path(run_dir) / "heartbeats" / attempt / f"rank{rank}.json"


def write_beat(path: Path, beat: Beat) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(asdict(beat)))
    os.replace(tmp, path)


def read_beat(run_dir: str | os.PathLike[str], attempt: str, rank: int) -> Beat | None:
    """The newest beat of `rank`, or None when it wrote none (or it cannot be read now)."""
    try:
        return Beat(**json.loads(beat_path(run_dir, attempt, rank).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def read_beats(run_dir: str | os.PathLike[str], attempt: str) -> dict[int, Beat]:
    """The newest beat of every rank of `attempt` that wrote one."""
    out: dict[int, Beat] = {}
    folder = Path(run_dir) / "heartbeats" / attempt
    for f in folder.glob("rank*.json") if folder.exists() else ():
        try:
            b = Beat(**json.loads(f.read_text()))
        except (OSError, ValueError, TypeError):
            continue
        out[b.rank] = b
    return out


def process_state(beat: Beat) -> str:
    """'running', 'stopped' (SIGSTOP/traced), 'dead', or 'unknown' (another host: cannot look)."""
    if beat.host != os.uname().nodename:
        return "unknown"
    try:
        stat = Path(f"/proc/{beat.pid}/stat").read_text()
    except OSError:
        return "dead"
    state = stat.rsplit(")", 1)[1].split()[0]
    return {"T": "stopped", "t": "stopped", "Z": "dead", "X": "dead"}.get(state, "running")
