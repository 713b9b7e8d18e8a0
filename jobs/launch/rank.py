"""What every rank runs, under any launcher: rendezvous, train, and end the attempt the one right way.

Three endings: finished (exit 0); stopped by an agreed signal after saving (the decider, rank 0,
requeues before anyone tears down and exits 75; the other ranks exit 0, so `srun
--kill-on-bad-exit` can never kill the decider first); or a failure (an exception, or the watchdog
seeing no step within the timeout): stacks dumped, the incident classified and recorded by the
first rank to claim it, which requeues or stops the job (`jobs.failure`).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from checkpoint.errors import CheckpointConfigError
from jobs import exitcodes
from jobs.config import JobConfig
from jobs.data import DataChanged
from jobs.device import backend_for, dump_flight_recorder, export_environ, rank_device, set_determinism, trace_dir
from jobs.events import EventLog
from jobs.failure.policy import claim, read_decision
from jobs.failure.respond import AttemptContext, conclude, on_failure
from jobs.failure.signals import StopSignals
from jobs.failure.spike import LossDiverged
from jobs.failure.watchdog import Watchdog
from jobs.launch.collector import imports_frozen
from jobs.launch.env import RESTART_IN_ALLOCATION_VAR, DistEnv, always_excluded, expand_nodelist
from jobs.launch.rendezvous import rendezvous
from jobs.launch.scavenge import scavenge_allocation
from jobs.log import get_logger, setup_logging
from jobs.telemetry.health import GpuHealth, rank_health

__all__ = ["run_rank", "attempt_context", "supervised"]


def supervised() -> bool:
    """Whether something starts the ranks again after a "restart" decision: our supervisor (srun step,
    local launcher) or torchrun's agents (`--max-restarts` > 0)."""
    return RESTART_IN_ALLOCATION_VAR in os.environ or int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0


def attempt_context(cfg: JobConfig, env: DistEnv, events: EventLog, *, rank: int) -> AttemptContext:
    """`supervised`: a supervisor (jobs.launch.supervise, the local launcher) can start the ranks again."""
    return AttemptContext(
        run_dir=cfg.run.dir,
        attempt=env.attempt,
        rank=rank,
        world_size=env.world_size,
        job_id=env.job_id,
        restart_count=env.restart_count,
        cfg=cfg.failure,
        events=events,
        supervised=supervised(),
        restart_in_allocation=env.restart_in_allocation,
        partition=cfg.cluster.partition,
        nodes_needed=cfg.launcher.nodes + cfg.launcher.spare_nodes,
        always_excluded=always_excluded(cfg),
        # under Slurm: the RAM tier flushed and removed on every node of the job before the decider requeues it
        before_requeue=_scavenger(cfg, events) if env.job_id else None,
    )


def _scavenger(cfg: JobConfig, events: EventLog) -> Callable[[], object]:
    """The RAM tier's scavenge of every node of the job (jobs/launch/scavenge.py), for `before_requeue`."""
    return lambda: scavenge_allocation(
        cfg, expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", "")), when="requeue", events=events
    )


def _setup_torch(cfg: JobConfig, env: DistEnv, *, device_type: str) -> torch.device:
    """Threads, the cluster's and NCCL's environment (exported before anything touches the GPU: CUDA
    reads CUDA_DEVICE_MAX_CONNECTIONS and PYTORCH_CUDA_ALLOC_CONF when its context is created), this
    rank's GPU, determinism (logged with what it costs); returns this rank's device."""
    threads = cfg.launcher.threads_per_rank or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(threads)
    traces = trace_dir(cfg.run.dir, env.attempt)  # the flight recorder's dumps (NCCL timeout, watchdog)
    if device_type == "cuda":
        traces.mkdir(parents=True, exist_ok=True)
    export_environ(cfg.cluster.env, device_type=device_type, trace_dir=str(traces))
    device = rank_device(device_type, local_rank=env.local_rank)
    get_logger().info("%s", set_determinism(cfg.train.deterministic, device_type=device_type))
    # DTensor warns on every grad-norm redistribute over the 2-D (dp_shard, tp) mesh; it is expected here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    return device


def _alike_on_every_rank(
    cfg: JobConfig,
    env: DistEnv,
    ctx: AttemptContext,
    events: EventLog,
    guards: tuple,
    *,
    cls: str,
    error: BaseException,
    fallback: int,
) -> int:
    """An error every rank meets alike (the same all-reduced losses, the same files): rank 0 records the failure
    and decides, the others wait for its decision (`fallback` if none comes)."""
    for guard in guards:
        guard.stop()
    if env.rank != 0:
        d = read_decision(cfg.run.dir, env.attempt, wait_s=5 * cfg.failure.heartbeat_s + 10)
        return int(d["exit_code"]) if d else fallback
    claim(cfg.run.dir, env.attempt)
    events.emit("failure", cls=cls, error=str(error), suspects=[])
    return conclude(ctx, cause=cls, step=guards[0].beat.step)


def stop_notice(stop: StopSignals, *, torchrun: bool) -> str | None:
    """The stop signal that arrived and means the job's end is coming (its name), or None. Under torchrun SIGTERM is
    also how an agent stops its surviving workers when one of them dies (torch.distributed.elastic's
    `_stop_workers`), so there it is no notice: Slurm's notice is the first of failure.requeue_signals (USR2)."""
    if not stop.arrived() or (torchrun and stop.name == "SIGTERM"):
        return None
    return stop.name


def run_rank(cfg: JobConfig, env: DistEnv, *, stop: StopSignals) -> int:
    """Trains this rank's share of `cfg`; returns an exit code from `jobs.exitcodes` (never raises).
    `stop` was installed at process start, before anything else could take time."""
    from jobs.validate import check_device, validate  # the same checks as on the login node, now on every rank

    log = setup_logging(env.rank)
    events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=env.rank, restart=env.restart_count, attempt=env.attempt)
    ctx = attempt_context(cfg, env, events, rank=env.rank)
    ctx.pending_stop = lambda: stop_notice(stop, torchrun=env.torchrun)  # a stop turns a restart into a requeue
    try:
        derived = validate(cfg)
        device_type, _ = check_device(cfg, per_task=True)  # and the GPUs this rank sees
    except ValueError as e:
        log.error("config error: %s", e)
        return conclude(ctx, cause="config_error", step=None) if env.rank == 0 else exitcodes.CONFIG_ERROR
    device = _setup_torch(cfg, env, device_type=device_type)
    watchdog, health = _guards(cfg, env, ctx, device, stop=stop)
    trainer, during = None, "rendezvous"
    try:
        env = rendezvous(
            env, run_dir=cfg.run.dir, timeout_s=cfg.failure.init_timeout_s, backend=backend_for(device_type)
        )
        watchdog.attach(env.master_addr, env.master_port)  # beats through the store the ranks met at from now on
        if env.rank == 0:
            events.emit(
                "rendezvous",
                world_size=env.world_size,
                master=f"{env.master_addr}:{env.master_port}",
                nodes=env.nodes,
                job_id=env.job_id,
            )
        with imports_frozen():  # a Slurm rank's first import of the trainer (a local rank's was before its fork)
            from jobs.trainer import Trainer

        during = "build"
        watchdog.phase(during)
        trainer = Trainer(cfg, derived, env, events=events, stop=stop, watchdog=watchdog)
        during = "train"
        outcome = trainer.fit()
    except BaseException as e:  # noqa: BLE001 - every error ends the attempt (`_ended_by`)
        return _ended_by(e, cfg, env, ctx, events, (watchdog, health), during=during)
    watchdog.stop(ended=outcome in ("done", "stopped"))  # peers still in their final save see it ended, not died
    health.stop()
    if outcome == "done":
        stop.ignore_from_now()
    code = _end_attempt(outcome, ctx, events, step=trainer.state.step, signal_name=stop.name)
    try:
        trainer.close()
    finally:
        if outcome != "done":  # saved and decided: get out of Slurm's way now (KillWait is short)
            _exit_now(code)
        dist.destroy_process_group()
    return code


def _ended_by(
    e: BaseException, cfg: JobConfig, env: DistEnv, ctx: AttemptContext, events: EventLog, guards: tuple, *, during: str
) -> int:
    """The end of an attempt that `e` ended while `during`: the exit code of an error every rank meets alike (rank 0
    decides); any other error goes through the failure path (`_fail`), which ends this process."""
    log = get_logger()
    if isinstance(e, LossDiverged):  # jobs/failure/spike.py: past failure.max_rollbacks, or nothing to roll back to
        log.error("%s", e)
        return _alike_on_every_rank(cfg, env, ctx, events, guards, cls=e.cls, error=e, fallback=exitcodes.DIVERGED)
    if isinstance(e, (DataChanged, CheckpointConfigError)):  # a data file changed since the checkpoint
        # (jobs/data/cursor.py), or the RAM checkpoint tier does not fit (checkpoint/memory_tier.py): alike on every
        # rank, no restart cures it
        log.error("config error: %s", e)
        return _alike_on_every_rank(
            cfg, env, ctx, events, guards, cls="config_error", error=e, fallback=exitcodes.CONFIG_ERROR
        )
    log.error(
        "%s during %s: %s",
        type(e).__name__,
        during,
        e,
        exc_info=not isinstance(e, dist.DistError) and not hasattr(e, "incident"),
    )
    # An error that classified itself (jobs/failure/sdc.py's SilentCorruption) brings its incident along.
    _fail(ctx, error=e, during=during, step=guards[0].beat.step, incident=getattr(e, "incident", None))


def _guards(
    cfg: JobConfig, env: DistEnv, ctx: AttemptContext, device: torch.device, *, stop: StopSignals
) -> tuple[Watchdog, GpuHealth]:
    """The rank's watchdog (heartbeats, hangs) and GPU health checks (now: a failing GPU never joins the
    rendezvous; then every failure.health_every_s), both started; either ends the attempt itself."""
    f = cfg.failure
    watchdog = Watchdog(
        run_dir=cfg.run.dir,
        attempt=env.attempt,
        rank=env.rank,
        node=env.hostname,
        heartbeat_s=f.heartbeat_s,
        init_timeout_s=f.init_timeout_s,
        hang_timeout_s=f.hang_timeout_s,
        world_size=env.world_size,
        missed_beats=f.missed_beats,
        on_hang=lambda idle: (
            dump_flight_recorder(trace_dir(cfg.run.dir, env.attempt), rank=env.rank),
            _fail(ctx, during=watchdog.beat.phase, step=watchdog.beat.step, incident=watchdog.incident),
        ),
        stop_received=stop.arrived,
        on_stop=lambda: _stop_now(ctx, stop, during=watchdog.beat.phase),
    )
    watchdog.start()
    health = rank_health(
        device.type,
        device.index,
        cfg=f,
        rank=env.rank,
        node=env.hostname,
        attempt=env.attempt,
        emit=ctx.events.emit,
        on_failing=lambda inc: _fail(ctx, during=watchdog.beat.phase, step=watchdog.beat.step, incident=inc),
    ).start()
    return watchdog, health


def _fail(ctx: AttemptContext, **facts) -> NoReturn:
    """The failure path (`on_failure`), then the exit: whatever writing the stacks, the incident or the
    ledger did (a full or read-only disk), this process ends, with 75 ("run again") unless a decision
    said otherwise; a supervisor bounds the step once a rank left without a decision."""
    code = exitcodes.REQUEUE
    try:
        code = on_failure(ctx, **facts)
    except BaseException as e:  # noqa: BLE001 - nothing may keep a failed rank alive
        _log_quietly("the failure path failed (%s: %s): exiting %d without a decision", type(e).__name__, e, code)
    finally:
        _exit_now(code)


def _stop_now(ctx: AttemptContext, stop: StopSignals, *, during: str) -> NoReturn:
    """A stop signal during rendezvous, build or load (the watchdog thread notices it within a second):
    nothing was trained, so nothing is saved; the first rank to claim the attempt decides (a requeue),
    the others take its exit code. Ranks stuck waiting for a peer are stopped by the launcher."""
    code = exitcodes.REQUEUE
    try:
        ctx.events.emit("stop_requested", step=None, signal=stop.name, action=f"exit during {during}")
        if claim(ctx.run_dir, ctx.attempt, rank=ctx.rank):
            code = conclude(ctx, cause=stop.name or "stop_signal", step=None)
        else:
            d = read_decision(ctx.run_dir, ctx.attempt, wait_s=5 * ctx.cfg.heartbeat_s + 10)
            code = int(d["exit_code"]) if d else exitcodes.REQUEUE
    except BaseException as e:  # noqa: BLE001 - the stop must end the process
        _log_quietly("the stop path failed (%s: %s): exiting %d", type(e).__name__, e, code)
    finally:
        _exit_now(code)


def _log_quietly(msg: str, *args) -> None:
    try:
        logging.getLogger("meshjob").error(msg, *args)
    except BaseException:  # noqa: BLE001 - stderr itself may be gone
        pass


def _end_attempt(outcome: str, ctx: AttemptContext, events: EventLog, *, step: int, signal_name: str | None) -> int:
    """Finished: rank 0 closes the attempt. Stopped by a signal: rank 0 decides (and requeues) while
    every rank is still alive; the others exit 0."""
    if ctx.rank != 0:
        return exitcodes.OK
    if outcome == "done":
        events.emit("attempt_end", cause="completed", action="done", step=step)
        return exitcodes.OK
    if not claim(ctx.run_dir, ctx.attempt, rank=ctx.rank):  # a watchdog (a stop during start-up) decided already
        d = read_decision(ctx.run_dir, ctx.attempt, wait_s=5 * ctx.cfg.heartbeat_s + 10)
        return int(d["exit_code"]) if d else exitcodes.REQUEUE
    return conclude(ctx, cause=signal_name or "stop_signal", step=step)  # the signal may have reached a peer only


def _exit_now(code: int) -> None:
    """Ends the process without teardown: after a failure a peer may be gone, and destroying groups,
    joining the checkpoint thread or Python's exit handlers could wait on it forever."""
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
    finally:
        os._exit(code)
