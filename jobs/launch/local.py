"""The local launcher: `nodes * tasks_per_node` rank processes on this machine, forked from one parent.

torch is imported once in the parent and each rank is a fork (about 1 s per rank cheaper than a
fresh interpreter on 2 cores; see shared notes item 14). The ranks get the same environment
contract as under Slurm (rank, local rank, world size, master address and a free port). If a rank
dies, the others are stopped and the failure is reported with the rank and how it ended.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import sys
import time

from jobs import exitcodes
from jobs.config import JobConfig
from jobs.launch.env import DistEnv
from jobs.log import get_logger

__all__ = ["launch", "free_port"]

_PR_SET_PDEATHSIG = 1
_STOP_GRACE_S = 10.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """A rank must not outlive its launcher (a SIGKILLed launcher would leave orphans training)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


def _rank_main(cfg: JobConfig, env: DistEnv, parent: int) -> int:
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        return exitcodes.RANK_DIED
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher owns Ctrl-C and stops ranks with SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    from jobs.launch.rank import run_rank

    return run_rank(cfg, env)


def _describe(status: int) -> tuple[str, int]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was killed by {signal.Signals(sig).name}", -sig
    return f"exited with code {os.WEXITSTATUS(status)}", os.WEXITSTATUS(status)


def launch(cfg: JobConfig, *, restart_count: int = 0) -> int:
    """Runs all ranks to completion; returns 0, the failing rank's exit code, or RANK_DIED."""
    import jobs.launch.rank  # noqa: F401 - import torch and the trainer once, before forking

    log = get_logger()
    world, per_node = cfg.world_size, cfg.launcher.tasks_per_node
    port = cfg.launcher.master_port or free_port()
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    for rank in range(world):
        env = DistEnv(
            rank=rank, local_rank=rank % per_node, world_size=world, local_world_size=per_node,
            node_rank=rank // per_node, nodes=cfg.launcher.nodes, master_addr="127.0.0.1", master_port=port,
            restart_count=restart_count, hostname=os.uname().nodename,
        )
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _rank_main(cfg, env, parent)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = rank

    stopping = False

    def _forward(signum, _frame):  # Ctrl-C / SIGTERM to the launcher: stop every rank
        nonlocal stopping
        stopping = True
        for p in pids:
            _kill(p, signal.SIGTERM)

    old = {s: signal.signal(s, _forward) for s in (signal.SIGINT, signal.SIGTERM)}
    result = exitcodes.OK
    try:
        while pids:
            pid, status = os.waitpid(-1, 0)
            rank = pids.pop(pid, None)
            if rank is None:
                continue
            how, code = _describe(status)
            if code == 0:
                continue
            if result == exitcodes.OK:
                result = exitcodes.RANK_DIED if code < 0 else code
                if not stopping:
                    log.error("rank %d (pid %d) %s; stopping the other %d ranks", rank, pid, how, len(pids))
                _stop(pids)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return result


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _stop(pids: dict[int, int]) -> None:
    """SIGTERM every remaining rank, SIGKILL those still alive after a grace period; reaps them all."""
    for p in pids:
        _kill(p, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    while pids and time.monotonic() < deadline:
        pid, _ = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.05)
        else:
            pids.pop(pid, None)
    for p in list(pids):
        _kill(p, signal.SIGKILL)
        os.waitpid(p, 0)
        pids.pop(p, None)
