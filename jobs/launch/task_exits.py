"""Each srun task's own word on how its rank ended: the task srun starts forks the rank and watches it, writes the
rank's exit code or the signal that killed it to an exit record, then ends the same way (srun, sacct and
`--kill-on-bad-exit` see what they saw without the watcher).

Why a watcher and not the rank writing its own code: the deaths that matter most (the OOM killer's SIGKILL, a bus
error, a floating point exception, `kill -9`) leave the rank no time to write, while its parent sees the wait status
(as torchrun's agent and the local launcher do). The watcher has imported nothing but the standard library when it
forks. A task whose watcher died too (the step SIGKILLed by Slurm, a lost node) has no record: the supervisor
(`jobs.launch.supervise`) falls back to srun's text for it, and without that the task is lost.

This module runs before anything heavy is imported (`python -m jobs.launch.slurm --rank-config ... --task-exits
DIR`): the standard library only.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

__all__ = ["watched", "read_records", "record_path", "STOP_SIGNALS"]

# Blocked across the fork, so that one arriving before the rank's handlers are in place is delivered to them
# (`StopSignals.install` unblocks), not lost and not fatal; ignored by the watcher: Slurm signals every process of
# the step, the rank gets its own.
STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1


def record_path(folder: str | os.PathLike[str], task: int) -> Path:
    return Path(folder) / f"task{task}.json"


def watched(folder: str | os.PathLike[str]) -> None:
    """Forks the rank. Returns in the child, which goes on to run the rank (the stop signals still blocked); in this
    process, the srun task, waits for the child, writes its exit record to `folder` and ends as the child ended:
    never returns here."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:
        _die_with(parent)
        return
    for s in (*STOP_SIGNALS, signal.SIGINT):  # srun's forwarded Ctrl-C reaches the child too
        signal.signal(s, signal.SIG_IGN)
    _, status = os.waitpid(pid, 0)
    try:
        _write(folder, _record(pid, status))
    except OSError as e:  # a full or read-only disk: the supervisor reads srun's text for this task instead
        print(f"meshjob: exit record not written to {folder} ({e})", file=sys.stderr, flush=True)
    _end_as(status)


def read_records(folder: str | os.PathLike[str], *, known: dict[int, dict] | None = None) -> dict[int, dict]:
    """Every complete exit record in `folder`, by task; {} when there is none (or no folder). `known`: records read
    before (a task writes one record): only the others are read (a supervisor polls thousands of tasks)."""
    out: dict[int, dict] = dict(known or {})
    try:
        names = os.listdir(folder)
    except OSError:
        return out
    read = {record_path(folder, t).name for t in out}
    for name in names:
        if not (name.startswith("task") and name.endswith(".json")) or name in read:
            continue
        try:
            rec = json.loads((Path(folder) / name).read_text())
            out[int(rec["task"])] = rec
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _record(pid: int, status: int) -> dict:
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    return {
        "task": int(os.environ.get("SLURM_PROCID", "-1")),
        "node": os.environ.get("SLURMD_NODENAME") or os.uname().nodename,
        "host": os.uname().nodename,
        "pid": pid,
        "exit_code": 128 + sig if sig else os.WEXITSTATUS(status),  # as a shell and srun's exit code say it
        "signal": signal.Signals(sig).name if sig else None,
        "time": time.time(),
    }


def _write(folder: str | os.PathLike[str], rec: dict) -> None:
    """Atomically: written under a temporary name, then renamed (a reader never sees half a record)."""
    path = record_path(folder, rec["task"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, path)


def _die_with(parent: int) -> None:
    """The rank gets SIGKILL when its watcher dies (`kill -9` of the srun task's pid must still end the rank)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the step's own end kills an orphan
        return
    if os.getppid() != parent:  # the watcher died before prctl took effect
        os._exit(128 + signal.SIGKILL)


def _end_as(status: int) -> None:
    """Exits with the child's code, or dies of the signal that killed it (no core file of its own)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # the two that cannot be caught, nor set
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)  # a signal that does not end a process by default (none ends the child that way)
    os._exit(os.WEXITSTATUS(status))
