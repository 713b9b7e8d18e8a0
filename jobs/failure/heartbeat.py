"""Heartbeats that peers and later attempts can read: one small JSON file per rank under the run dir.

Files, not the rendezvous TCPStore: the store lives in rank 0's process and dies with it, while a
file on the run dir's shared filesystem outlives any rank, is read by `jobs.status` and by the next
attempt, and needs no port. Each write is a temp file + rename, so a reader never sees half a beat.
Layout: `RUN_DIR/heartbeats/<attempt>/rank<r>.json`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Beat", "beat_path", "write_beat", "read_beat", "read_beats", "process_state"]


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
