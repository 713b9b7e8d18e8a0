"""The benchmarks' bare launcher: fork one process per rank, and kill the rest when one fails."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import traceback
from collections.abc import Callable


def run_forked_ranks(world_size: int, rank_main: Callable[[int], int | None]) -> list[int]:
    """Runs `rank_main(rank)` in a forked process per rank (its return value, None = 0, is the exit
    code; an exception is printed and exits 1); returns the exit codes of the ranks that failed. A
    failed rank gets its peers killed: they would wait in a collective until the timeout."""
    sys.stdout.flush()
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = rank_main(rank) or 0
            except BaseException:  # noqa: BLE001 - print and exit; the parent reports the code
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = []
    while pids:
        pid, status = os.waitpid(-1, 0)
        if pid not in pids:
            continue
        pids.remove(pid)
        code = os.waitstatus_to_exitcode(status)
        if code and not failed:
            for other in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(other, signal.SIGKILL)
        if code:
            failed.append(code)
    return failed
