"""The benchmarks' bare launchers: fork one process per rank, and kill the rest when one fails; or gather what
each rank returns."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


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


def gather_forked_ranks(
    world_size: int, rank_result: Callable[[int, float], Any], *, timeout_s: float, teardown: bool = True
) -> list[Any]:
    """`rank_result(rank, started)` (`started`: the child's time.time() as it began) in a forked process per
    rank, after the env:// variables of a local world and, with peers, gloo's default group (`timeout_s`);
    returns the results in rank order, and raises a rank's failure here (a RuntimeError with its traceback).
    `teardown=False`: a rank ends without destroying its group, as after kill -9 (nothing of it cleaned up)."""
    ctx = mp.get_context("fork")
    q, port = ctx.Queue(), published_port()
    procs = [
        ctx.Process(target=_gather_child, args=(q, rank, world_size, port, rank_result, timeout_s, teardown))
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    out = [pickle.loads(got[r]) for r in range(world_size)]
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


def published_port():
    """Where rank 0 publishes the port it bound (`join_group`): shared memory, made before the ranks fork."""
    return mp.get_context("fork").Value("i", 0)


def join_group(rank: int, world: int, port, *, timeout_s: float) -> None:
    """gloo's default group over a store that rank 0 opens on a port the kernel picks and publishes in `port`
    (`published_port`); the others wait for it. A port picked free by the parent and bound later by rank 0 can
    be taken in between by another process. MASTER_ADDR and MASTER_PORT name the store, as env:// would."""
    import torch.distributed as dist

    from parallel.store import forked_store

    store = forked_store(rank, world, port, timeout_s=timeout_s)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port.value))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def _gather_child(q, rank: int, world: int, port, rank_result, timeout_s: float, teardown: bool) -> None:
    import torch.distributed as dist

    started = time.time()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    try:
        if world > 1:
            join_group(rank, world, port, timeout_s=timeout_s)
        q.put((rank, pickle.dumps(rank_result(rank, started))))
    except BaseException:  # noqa: BLE001 - sent to the parent, which raises it
        q.put((rank, pickle.dumps(RuntimeError(traceback.format_exc()))))
    finally:
        if teardown and dist.is_initialized():
            dist.destroy_process_group()
        q.close()
        q.join_thread()
        os._exit(0)
