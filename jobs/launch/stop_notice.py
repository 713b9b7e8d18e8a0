"""A stop notice (USR2) that reaches a torchrun-style job while torchrun restarts its ranks: written down by the agent,
read by the restarted ranks.

Slurm signals every process of the agents' step. The ranks take USR2 themselves, but between the death of one
attempt's ranks and the handlers of the next (torchrun stopping, restarting and the new ranks' start-up) only the
agent is there. The agent keeps USR2 blocked (its ranks inherit that, so one that reaches a starting rank waits for
its handler instead of being lost or fatal); a thread of the agent takes each USR2 sent to the agent itself
(`signal.sigwait`, not a handler: it writes a file) and records it in `RUN_DIR/rendezvous/<job>.<restart>.stop_notice`.
Rank 0 of every attempt of that allocation reads it at start and takes the notice as arrived: the ranks agree on it
and requeue, as after a USR2 they received (`jobs.launch.slurm.rank_main`).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from jobs.launch.env import attempt_name

__all__ = ["notice_path", "record_notices", "read_notice", "NOTICE_SIGNAL"]

NOTICE_SIGNAL = signal.SIGUSR2  # Slurm's stop notice under torchrun (SIGTERM is also how the agent stops its ranks)


def notice_path(run_dir: str | os.PathLike[str], job_id: str | None, restart_count: int) -> Path:
    """One file per allocation (job and requeue count): a notice holds for every attempt inside it."""
    return Path(run_dir) / "rendezvous" / f"{attempt_name(job_id, restart_count)}.stop_notice"


def record_notices(path: str | os.PathLike[str]) -> threading.Thread:
    """Blocks USR2 in the calling thread (the agent's main thread, before it starts any other: they inherit the mask,
    and so do the ranks it starts) and starts a daemon thread that records each USR2 sent to this process."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {NOTICE_SIGNAL})
    thread = threading.Thread(target=_record_each, args=(Path(path),), name="stop-notices", daemon=True)
    thread.start()
    return thread


def read_notice(path: str | os.PathLike[str]) -> dict | None:
    """The recorded notice, or None (none, or unreadable)."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def _record_each(path: Path) -> None:
    count = 0
    while True:
        sig = signal.sigwait({NOTICE_SIGNAL})
        count += 1
        notice = {"signal": signal.Signals(sig).name, "count": count, "host": os.uname().nodename, "time": time.time()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(notice))
            os.replace(tmp, path)
        except OSError as e:  # nothing to do but say so: the ranks alive now got the signal themselves
            print(f"meshjob agent: stop notice {notice['signal']} not recorded in {path} ({e})", file=sys.stderr)
            continue
        print(f"meshjob agent: {notice['signal']} recorded in {path} for the ranks of this allocation", flush=True)
