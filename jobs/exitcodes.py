"""Process exit codes of every meshjob command: what happened, in one number (documented in docs/overrides.md), and
`exit_command`, how a command's process ends with one."""

from __future__ import annotations

import gc
import sys
from typing import NoReturn

OK = 0  # finished: all steps trained (or the command did what it was asked)
FAILED = 1  # an unexpected error in a rank (traceback in its log), or a plan check failed
CONFIG_ERROR = 2  # the config is invalid; nothing was started, submitted or written
ENV_ERROR = 3  # the login node cannot submit: no `sbatch` on PATH, sbatch refused the job, or (launcher.wait) Slurm no longer knows it; or an optional dependency is missing (jobs.extras names the extra)
RANK_DIED = 4  # the local launcher saw a rank killed by a signal and stopped the others
REQUEUE = 75  # stopped on purpose to be requeued (a stop signal, or an incident a restart cures): run again with the same run.dir
STOPPED = (
    76  # stopped for good: the requeue budget or the no-progress breaker ran out; do NOT requeue (see jobs.status)
)
DIVERGED = 77  # stopped for good: the loss diverged past failure.max_rollbacks (or no checkpoint before the spike); do NOT requeue


# The ranks' codes that say more than "failed", the most final first.
_MOST_FINAL = (DIVERGED, STOPPED, CONFIG_ERROR, REQUEUE)


def most_final(codes: list[int]) -> int:
    """One exit code for several processes' codes: a "do not requeue" code first, then REQUEUE, else the first
    failure's (a death by signal N, given as -N, as 128 + N, as a shell reports it); FAILED for none."""
    for code in _MOST_FINAL:
        if code in codes:
            return code
    first = next((c for c in codes if c), FAILED)
    return 128 - first if first < 0 else first


def exit_command(code: int) -> NoReturn:
    """Ends a command's process (`python -m jobs.<command>`, each step of a rendered sbatch script) with `code`. What
    the process built so far (torch alone is ~300k objects) is first frozen out of the garbage collector: the
    interpreter's finalization scans it all for cycles otherwise, 1-2 s of every `python -m jobs.train` on 2 cores
    (measured: 0.12-0.3 s frozen). atexit handlers still run, standard streams are flushed and objects are released by
    reference count; only reference cycles among them are left to the operating system, unfinalized (the events
    ledger writes each record with its own write(2); log handlers are flushed and closed by logging's atexit
    handler)."""
    gc.freeze()
    sys.exit(code)
