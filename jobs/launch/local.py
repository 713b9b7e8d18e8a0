"""The local launcher: `nodes * tasks_per_node` rank processes on this machine, forked from one parent.

torch is imported once in the parent and each rank is a fork (about 1 s per rank cheaper than a
fresh interpreter on 2 cores: `import torch` costs ~1.8 CPU-seconds). The ranks get the same environment
contract as under Slurm (rank, local rank, world size, master address; rank 0 binds the rendezvous port itself
and publishes it in the run dir, so no port is picked here and taken by another process before rank 0 binds it). If a rank
dies, the others are stopped and the failure is reported with the rank and how it ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import shutil
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from jobs import exitcodes
from jobs.config import JobConfig
from jobs.events import EventLog, read_events
from jobs.failure.incident import Incident
from jobs.failure.ledger import attempts
from jobs.failure.policy import read_decision
from jobs.failure.respond import (
    AttemptContext,
    decide_for_lost_decider,
    decide_for_silent_attempt,
    on_failure,
    open_attempt,
)
from jobs.failure.signals import StopSignals, parse_signals
from jobs.launch.collector import collector_off
from jobs.launch.env import RESTART_IN_ALLOCATION_VAR, DistEnv
from jobs.launch.rendezvous import port_file
from jobs.launch.rundir import memory_root
from jobs.log import get_logger

__all__ = ["launch", "free_port"]

_PR_SET_PDEATHSIG = 1
_STOP_GRACE_S = 10.0


def free_port() -> int:
    """A port free now (for benches that pin one); the launcher itself never picks one: see `_launch_once`."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """A rank must not outlive its launcher (a SIGKILLed launcher would leave orphans training)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass


_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


def _rank_main(cfg: JobConfig, env: DistEnv, parent: int) -> int:
    stop = StopSignals().install(parse_signals(cfg.failure.requeue_signals))  # before anything else
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)  # blocked by the launcher across fork
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before prctl took effect
        return exitcodes.RANK_DIED
    from jobs.launch.rank import run_rank

    return run_rank(cfg, env, stop=stop)


def _describe(status: int) -> tuple[str, int]:
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"was killed by {signal.Signals(sig).name}", -sig
    return f"exited with code {os.WEXITSTATUS(status)}", os.WEXITSTATUS(status)


def _attempt_number(events: EventLog) -> int:
    """This launch's number among the run's local launches (`local.<n>` in the ledger; its restarts
    are `local.<n>.<k>`)."""
    return sum(
        1 for a in attempts(read_events(events.path)) if a.attempt.startswith("local.") and a.attempt.count(".") == 1
    )


def launch(cfg: JobConfig, *, early: StopSignals | None = None) -> int:
    """Runs all ranks to completion, starting them again after a "restart" decision (a dead or hung
    rank, within failure.restarts_in_allocation); returns 0, the last attempt's exit code, or RANK_DIED.
    `early`: stop signals the entry point recorded before the ranks existed; they are passed on."""
    # torch's imports make ~300k objects that live to the end: collecting them as they came cost ~0.5 CPU s
    with collector_off():
        import torch.distributed.pipelining  # noqa: F401 - and torch._dynamo, which every rank imports (meta, FSDP)

        import jobs.launch.rank  # noqa: F401 - import torch and the trainer once, before forking
        import jobs.trainer  # noqa: F401 - run_rank imports it late (a Slurm rank starts its guards first): 0.2 s

    events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1)
    restart, n = _attempt_number(events), 0
    while True:
        os.environ[RESTART_IN_ALLOCATION_VAR] = str(n)  # the forked ranks may decide "restart"
        code, ctx = _launch_once(cfg, events, restart=restart, restart_in_allocation=n, early=early)
        attempt = ctx.attempt
        d = read_decision(cfg.run.dir, attempt, wait_s=0)
        if d is None and code != exitcodes.OK:  # as the Slurm supervisor does (jobs.launch.supervise)
            d = _decide_in_their_place(ctx, code)
            code = code if d is None else int(d["exit_code"])
        if d is not None and d["action"] == "restart" and ctx.pending_stop and ctx.pending_stop():
            get_logger().warning("attempt %s: a stop signal arrived; not restarting the ranks", attempt)
            d, code = None, exitcodes.REQUEUE  # "run again": the ranks' step was already told to stop
        if d is None or d["action"] != "restart":
            _drop_memory_tier(cfg)
            return code
        get_logger().warning(
            "attempt %s: restarting the ranks (restart %d of failure.restarts_in_allocation(%d))",
            attempt,
            n + 1,
            cfg.failure.restarts_in_allocation,
        )
        n, early = n + 1, None


def _decide_in_their_place(ctx: AttemptContext, code: int) -> dict | None:
    """An attempt that ended badly without a decision: its decider died between claim and publish, or no rank
    could even claim it (a full or read-only run dir): decided here, with the ranks' policy."""
    return decide_for_lost_decider(ctx, step_code=code) or decide_for_silent_attempt(
        ctx, step_code=code, why=f"a rank exited with code {code}"
    )


def _drop_memory_tier(cfg: JobConfig) -> None:
    """No restart follows: the run's RAM checkpoint tier on this machine is deleted (its ranks delete their own
    copies when they finish or stop; this covers ranks that died). Best effort."""
    if cfg.checkpoint.memory_on:
        shutil.rmtree(memory_root(cfg), ignore_errors=True)


def _launch_once(
    cfg: JobConfig, events: EventLog, *, restart: int, restart_in_allocation: int, early: StopSignals | None
) -> tuple[int, AttemptContext]:
    envs = [
        DistEnv(
            rank=r,
            local_rank=r % cfg.launcher.tasks_per_node,
            world_size=cfg.world_size,
            local_world_size=cfg.launcher.tasks_per_node,
            node_rank=r // cfg.launcher.tasks_per_node,
            nodes=cfg.launcher.nodes,
            master_addr="127.0.0.1",
            master_port=cfg.launcher.master_port,  # 0: rank 0 binds a port and publishes it (jobs.launch.rendezvous)
            restart_count=restart,
            restart_in_allocation=restart_in_allocation,
            hostname=os.uname().nodename,
        )
        for r in range(cfg.world_size)
    ]
    port_file(cfg.run.dir, envs[0].attempt).unlink(missing_ok=True)  # a rerun in this run dir names attempts again
    events.restart, events.attempt = restart, envs[0].attempt
    ctx = AttemptContext(
        run_dir=cfg.run.dir,
        attempt=envs[0].attempt,
        rank=-1,
        world_size=cfg.world_size,
        job_id=None,
        restart_count=restart,
        cfg=cfg.failure,
        events=events,
        supervised=True,
        restart_in_allocation=restart_in_allocation,
    )
    open_attempt(ctx, nodes=[envs[0].hostname], launcher="local", restart_in_allocation=restart_in_allocation)
    # Signals wait (blocked) until every rank has its handlers and the launcher its forwarder: none is lost.
    signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
    try:
        pids = _fork_ranks(cfg, envs)
    except BaseException:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
        raise
    if early is not None and early.received is not None:
        for p in pids:
            _kill(p, signal.SIGUSR2)
    return _supervise(pids, ctx), ctx


@contextlib.contextmanager
def frozen_for_fork() -> Iterator[None]:
    """Around forks without exec: what this process built so far (torch, the trainer's modules: ~300k objects) is
    frozen out of the garbage collector (gc.freeze, as Python's docs advise), so that a child's full collections,
    and the one the CPU memory tracker runs at a tracked step, do not scan it all again in every child (0.2-0.35
    CPU s each) nor write its headers, copying the pages fork shares. Thawed again afterwards here, unless
    something had frozen objects before (gc.unfreeze would thaw those too)."""
    before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not before:
            gc.unfreeze()


def _fork_ranks(cfg: JobConfig, envs: list[DistEnv]) -> dict[int, int]:
    parent = os.getpid()
    sys.stdout.flush()
    sys.stderr.flush()
    pids: dict[int, int] = {}
    with frozen_for_fork():
        for env in envs:
            pid = os.fork()
            if pid == 0:
                _run_forked_rank(cfg, env, parent)
            pids[pid] = env.rank
    return pids


def _run_forked_rank(cfg: JobConfig, env: DistEnv, parent: int) -> NoReturn:
    code = 1
    try:
        code = _rank_main(cfg, env, parent)
    except BaseException:  # noqa: BLE001 - a rank's own bug: show it, exit 1
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _supervise(pids: dict[int, int], ctx: AttemptContext) -> int:
    """Waits for every rank. Ctrl-C, SIGTERM or SIGUSR2 to the launcher reach every rank as SIGUSR2
    (save at the next step, exit 75); a second Ctrl-C stops them at once. A rank killed by a signal
    is recorded as a dead-rank incident (the launcher saw it die) and the others are stopped."""
    log, stopping, signals_seen = get_logger(), False, 0

    def _forward(signum, _frame):
        nonlocal stopping, signals_seen
        signals_seen += 1
        stopping = True
        for p in pids:
            _kill(p, signal.SIGUSR2 if signals_seen == 1 else signal.SIGKILL)

    ctx.pending_stop = lambda: "SIGUSR2" if stopping else None  # a stop turns this launcher's restart into a requeue

    old = {s: signal.signal(s, _forward) for s in _FORWARDED}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _FORWARDED)
    result = exitcodes.OK
    try:
        while pids:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            rank = pids.pop(pid, None)
            how, code = _describe(status)
            if rank is None or code == 0 or result != exitcodes.OK:
                continue
            result = exitcodes.RANK_DIED if code < 0 else code
            if code < 0 and not stopping:
                log.error("rank %d (pid %d) %s; stopping the other %d ranks", rank, pid, how, len(pids))
                on_failure(ctx, incident=_dead_rank(ctx, rank=rank, pid=pid, how=how))
            # The first rank to end badly ends the attempt: the others are told to stop, whatever the code
            # (a peer stuck in a collective, or SIGSTOPped, never ends by itself).
            _stop(pids)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return result


def _dead_rank(ctx: AttemptContext, *, rank: int, pid: int, how: str) -> Incident:
    node = os.uname().nodename
    return Incident(
        "dead_rank",
        ctx.attempt,
        -1,
        f"rank {rank} (node {node}, pid {pid}) {how}",
        [{"rank": rank, "node": node, "host": node, "pid": pid, "state": "dead"}],
        {"waitpid": how, "seen_by": "local launcher"},
    )


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
