"""Fork N local ranks on gloo from a test (torch imported once in the parent; see notes section 14)."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import pickle
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch  # imported here, in the parent, so each forked rank skips the ~1 s import (`import torch` costs ~1.8 CPU-seconds)
import torch.distributed as dist
import torch.distributed.pipelining  # noqa: F401 - and torch._dynamo: lazy in parallel/, needed by every rank

from jobs.launch.local import frozen_for_fork
from parallel.store import forked_store

__all__ = ["run_ranks", "RanksResult", "free_port"]


@dataclass
class RanksResult:
    results: dict[int, Any] = field(default_factory=dict)  # rank -> fn's return value (ranks that returned)
    exitcodes: dict[int, int] = field(default_factory=dict)  # rank -> process exit code (-9 = SIGKILL)

    @property
    def killed(self) -> bool:
        return any(c == -signal.SIGKILL for c in self.exitcodes.values())


def free_port() -> int:
    """A port free now: only for functions that meet through env:// themselves (`run_ranks(init_pg=False)`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    init_pg: bool = True,
    allow_kill: bool = False,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> RanksResult:
    """Runs fn(rank, world_size, *args, **kwargs) in `world_size` forked processes with a gloo group.

    When a rank dies by SIGKILL and `allow_kill` is set, the others are SIGKILLed too (a whole-job
    kill) and the result says so; any other failure raises with every rank's traceback.
    """
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    # init_pg: rank 0 binds the store on a port the kernel picks and hands it on here (parallel.store); a port picked
    # free now and bound later by a rank can be taken in between (by a concurrent test's gloo sockets). Without
    # it, a port for a function that meets through env:// itself (the GPU tests' NCCL groups).
    port = ctx.Value("i", 0 if init_pg else free_port())
    procs = []
    parent = os.getpid()
    # What pytest holds (every module and test object so far) is frozen out of the ranks' garbage collector, as the
    # local launcher does: their collections would scan it all again in every rank.
    with frozen_for_fork():
        for rank in range(world_size):
            args_ = (q, fn, rank, world_size, port, init_pg, env or {}, args, kwargs, parent)
            p = ctx.Process(target=_child, args=args_)
            p.start()
            procs.append(p)
    out = RanksResult()
    errors: dict[int, str] = {}

    def drain() -> None:
        while True:
            try:
                rank, ok, value = q.get(timeout=0.01)
            except queue.Empty:
                return
            # Plain pickle bytes: torch's queue reductions would share tensor memory with a child that exits.
            (out.results if ok else errors).__setitem__(rank, pickle.loads(value))

    def kill_all() -> None:
        for p in procs:
            if p.exitcode is None:
                os.kill(p.pid, signal.SIGKILL)

    deadline = time.monotonic() + timeout
    timed_out = False
    while True:
        drain()
        codes = [p.exitcode for p in procs]
        if all(c is not None for c in codes):
            break
        if (errors and not allow_kill) or (allow_kill and -signal.SIGKILL in codes):
            time.sleep(0.1)
            kill_all()
            break
        if time.monotonic() > deadline:
            timed_out = True
            kill_all()
            break
    for rank, p in enumerate(procs):
        while p.exitcode is None:
            drain()
            p.join(timeout=0.05)
        out.exitcodes[rank] = p.exitcode
    drain()
    if timed_out:
        raise TimeoutError(f"ranks did not finish in {timeout} s; exit codes {out.exitcodes}; errors {errors}")
    if errors and not (allow_kill and out.killed):
        raise RuntimeError("rank failures:\n" + "\n".join(f"--- rank {r}\n{t}" for r, t in sorted(errors.items())))
    if not out.killed and len(out.results) < world_size:
        raise RuntimeError(f"ranks exited without a result: exit codes {out.exitcodes}")
    return out


_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """A rank must not outlive the pytest process (a killed pytest would leave ranks in a collective)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


_INIT_TIMEOUT = timedelta(seconds=60)


def _child(q, fn, rank, world_size, port, init_pg, env, args, kwargs, parent) -> None:  # pragma: no cover - forked
    _die_with_parent(parent)
    os.environ["OMP_NUM_THREADS"] = "1"  # `env` may override it
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), **env
    )
    torch.set_num_threads(1)  # 2 cores shared by all ranks: one intra-op thread each
    code = 0
    try:
        store = forked_store(rank, world_size, port, timeout_s=_INIT_TIMEOUT.total_seconds()) if init_pg else None
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port.value), **env)  # the port actually bound
        if init_pg:
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=_INIT_TIMEOUT)
        q.put((rank, True, pickle.dumps(fn(rank, world_size, *args, **kwargs))))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, pickle.dumps(traceback.format_exc())))
        code = 1
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        q.close()
        q.join_thread()
        os._exit(code)
