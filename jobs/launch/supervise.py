"""The supervisor: one process per allocation, in the batch step, that starts the ranks as an `srun`
step and starts them again, in a new step of the same job, when the attempt's decider says "restart".

Why a new srun step from the batch step rather than a supervisor per node: a step is what Slurm
already knows how to start on every node, signal, account (`sacct` shows one step per restart) and
kill as a whole, including a rank that is SIGSTOPped or stuck in a collective; the job keeps its id,
its nodes and its restart count, and no process of ours has to outlive a dead rank on its node. Both
the submitit launcher (`SlurmJob`, submitted with use_srun=False so that it runs here) and the scripts
of `python -m jobs.sbatch` (`python -m jobs.launch.slurm --supervise`) run this loop.

Each start is an attempt `<job>.<restart>[.<n>]` with its own rendezvous file (a fresh port); the
ranks load the config this supervisor pickled. After the decision is published the step gets
`_GRACE_S` to end by itself, then it is killed. A SIGTERM or SIGUSR2 to this process (scancel, a
requeue) is recorded and lets the running step end; no new step starts after it.

The supervisor can die too (kill -9, the OOM killer, a bug): `guarded` runs it in a forked child, and
the parent, a guard that does nothing else, outlives it, so the batch step (and with it the job and
the ranks) does not end. The guard writes a `supervisor_died` failure, sends the ranks' step the first
of `failure.requeue_signals` (they save at the next step and their decider requeues within the budget,
as for a preemption), waits for them, and decides itself (`conclude`, cause `supervisor_died`) when no
rank did; then it ends the allocation as the supervisor would have (the RAM tier's scavenge,
`_end_allocation`). When the guard dies as well, the batch step ends and Slurm SIGTERMs the ranks: their
decider asks Slurm (`policy.slurm_intent`: COMPLETING with reason NonZeroExitCode, not a scancel) and requeues.
"""

from __future__ import annotations

import os
import pickle
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jobs import exitcodes
from jobs.config import JobConfig
from jobs.events import EventLog, read_events
from jobs.failure.incident import incident_dir
from jobs.failure.policy import claim, read_decision, requeues_used
from jobs.failure.quarantine import quarantined, requeue_excluding
from jobs.failure.respond import (
    AttemptContext,
    conclude,
    decide_for_lost_decider,
    decide_for_silent_attempt,
    open_attempt,
)
from jobs.failure.signals import parse_signals
from jobs.failure.spares import place
from jobs.launch.env import RESTART_IN_ALLOCATION_VAR, always_excluded, attempt_name, expand_nodelist, slurm_job_id
from jobs.launch.scavenge import scavenge_allocation
from jobs.launch.slurm_state import seconds_left
from jobs.launch.task_exits import read_records
from jobs.log import get_logger

__all__ = [
    "guarded",
    "supervise",
    "after_agents",
    "rank_config_path",
    "load_rank_config",
    "task_code",
    "srun_step_command",
    "exits_dir",
    "StepEnd",
]

_GRACE_S = 10.0  # after a decision, how long the step may take to end before it is killed
_POLL_S = 0.2
_RECORDS_S = 1.0  # how often the tasks' exit records are looked at while the step runs
_SQUEUE_S = 20.0  # one squeue call's bound
_CRASHED = 70  # the forked supervisor raised (sysexits' EX_SOFTWARE); supervise() never returns it


def rank_config_path(run_dir: str, job_id: str, restart_count: int) -> Path:
    return Path(run_dir) / "rendezvous" / f"{job_id}.{restart_count}.config.pkl"


def exits_dir(run_dir: str | os.PathLike[str], attempt: str) -> Path:
    """Where the attempt's srun tasks write their exit records (`jobs.launch.task_exits`)."""
    return incident_dir(run_dir, attempt) / "exits"


def load_rank_config(path: str | os.PathLike[str]) -> JobConfig:
    with open(path, "rb") as f:
        return pickle.load(f)


def guarded(cfg: JobConfig, *, logs: tuple[str, str]) -> int:
    """`supervise` in a forked child, this process its guard: the supervisor's exit code, or, when it
    died while the job was not being stopped, what `_after_supervisor_death` decided."""
    stopping: list[int] = []
    for s in (signal.SIGTERM, signal.SIGUSR2):  # scancel / a requeue: the ranks handle it; outlive the child
        signal.signal(s, lambda signum, _f: stopping.append(signum))
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os._exit(_supervise_child(cfg, logs=logs))
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) != _CRASHED:
        return os.WEXITSTATUS(status)
    how = (
        f"was killed by {signal.Signals(os.WTERMSIG(status)).name}"
        if os.WIFSIGNALED(status)
        else "raised an exception (traceback above)"
    )
    # The job is being cancelled or requeued anyway (SIGTERM: scancel, scontrol requeue, the time limit, the end of a
    # preemption's grace; SIGUSR2 reaches this step only with scancel -b/-f): the ranks' decider has it, and a
    # requeue it made scavenged first. No scavenge here: the job is COMPLETING, and Slurm starts no step (the
    # scavenger's srun --overlap) in it; the next allocation's start scavenges the nodes it lands on.
    if stopping:
        get_logger().error("the supervisor (pid %d) %s after %s", pid, how, signal.Signals(stopping[0]).name)
        return exitcodes.REQUEUE
    return _after_supervisor_death(cfg, pid=pid, how=how)


def _supervise_child(cfg: JobConfig, *, logs: tuple[str, str]) -> int:
    try:
        return supervise(cfg, logs=logs)
    except BaseException:  # noqa: BLE001 - any error of the supervisor is the guard's to handle
        traceback.print_exc()
        return _CRASHED
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def supervise(cfg: JobConfig, *, logs: tuple[str, str]) -> int:
    """Runs the ranks until an attempt ends with anything but "restart"; returns that attempt's exit
    code. `logs`: srun's --output and --error patterns; `{attempt}` is replaced per attempt."""
    job_id, restart = slurm_job_id(os.environ), int(os.environ.get("SLURM_RESTART_COUNT", 0))
    nodes = _allocation_nodes()
    stopping: list[int] = []
    for s in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(s, lambda signum, _f: stopping.append(signum))
    path = rank_config_path(cfg.run.dir, job_id, restart)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(cfg))
    # What an allocation that could not scavenge left on these nodes (checkpoint/scavenge.py), before any rank
    edge = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=restart, attempt=attempt_name(job_id, restart))
    scavenge_allocation(cfg, nodes, when="allocation_start", events=edge)
    code = _attempts(cfg, logs=logs, job_id=job_id, restart=restart, nodes=nodes, path=path, stopping=stopping)
    return _end_allocation(cfg, code, events=edge)


def _allocation_nodes() -> list[str]:
    """Every node of this job's allocation (this host's name outside one)."""
    return expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", os.uname().nodename))


def _end_allocation(cfg: JobConfig, code: int, *, events: EventLog) -> int:
    """The end of the allocation with exit `code`, whoever ends it (the supervisor, its guard, the torchrun style's
    batch step): the RAM tier's scavenge on every node (no flush at 77: a diverged state is never made the newest
    checkpoint), but after a requeue, whose decider scavenged before `scontrol requeue` (after it Slurm starts no
    step in the job). Returns `code`."""
    if code != exitcodes.REQUEUE:
        scavenge_allocation(
            cfg, _allocation_nodes(), when="allocation_end", events=events, flush=code != exitcodes.DIVERGED
        )
    return code


def _attempts(
    cfg: JobConfig,
    *,
    logs: tuple[str, str],
    job_id: str,
    restart: int,
    nodes: list[str],
    path: Path,
    stopping: list[int],
) -> int:
    """The attempts of this allocation (see `supervise`); the last one's exit code."""
    n = 0
    while True:
        # Before every attempt: a spare may have replaced a node since (jobs.failure.spares).
        off = _off_quarantine(cfg, job_id=job_id, restart=restart, nodes=nodes, n=n)
        if off is not None:
            return off
        ctx, end = _attempt(cfg, logs=logs, job_id=job_id, restart=restart, nodes=nodes, path=path, n=n)
        d = _decided(ctx, end)
        if d is None or d["action"] != "restart":
            return end.job_code if d is None else int(d["exit_code"])
        why = _no_restart_now(cfg, job_id, stopping)
        if why is not None:  # a restarted step would start without the notice, or be killed by the time limit
            return _requeue_instead(cfg, job_id=job_id, restart=restart, n=n + 1, cause=why)
        get_logger().warning(
            "attempt %s ended by a restart decision: starting the ranks again (restart %d inside job %s)",
            ctx.attempt,
            n + 1,
            job_id,
        )
        n += 1


def _attempt(
    cfg: JobConfig, *, logs: tuple[str, str], job_id: str, restart: int, nodes: list[str], path: Path, n: int
) -> tuple[AttemptContext, StepEnd]:
    """Attempt `n` of this allocation: its `attempt_start`, its ranks' srun step run to its end; its context (the
    supervisor's, to decide with) and how the step ended."""
    attempt = attempt_name(job_id, restart, n)
    events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=restart, attempt=attempt)
    ctx = _supervisor_context(
        cfg,
        attempt,
        job_id=job_id,
        restart=restart,
        events=events,
        supervised=True,
        restart_in_allocation=n,
    )
    placed = _placement(cfg, nodes)
    open_attempt(ctx, nodes=nodes, launcher="slurm", restart_in_allocation=n, **placed)
    cmd = srun_step_command(
        cfg,
        path,
        [p.replace("{attempt}", attempt.split(".", 1)[1]) for p in logs],
        step_nodes=placed.get("step_nodes"),
        task_exits=exits_dir(cfg.run.dir, attempt),
    )
    end = _run_step(
        cmd,
        {**os.environ, RESTART_IN_ALLOCATION_VAR: str(n)},
        cfg.run.dir,
        attempt,
        no_decision_s=cfg.failure.hang_timeout_s,  # a decider has long published by then
        ntasks=cfg.world_size,
    )
    return ctx, end


def _decided(ctx: AttemptContext, end: StepEnd) -> dict | None:
    """The attempt's decision once its step ended: the ranks'; else, a claimed attempt without a decision (its
    decider died deciding) or a task gone with nobody having claimed (the ranks' failure path could not write) is
    decided here in their place; a step none of whose tasks ran is a `step_launch_failure`. None: nothing to decide
    (the ranks finished)."""
    d = read_decision(ctx.run_dir, ctx.attempt, wait_s=0) or decide_for_lost_decider(ctx, step_code=end.job_code)
    if d is None and end.gone:
        d = decide_for_silent_attempt(ctx, step_code=end.job_code, why=end.gone, tasks=end.task_codes)
    if d is None and end.code != exitcodes.OK and not end.ran:
        d = _step_failed(ctx, end.code, exits_said=end.srun_said)
    return d


def _no_restart_now(cfg: JobConfig, job_id: str, stopping: list[int]) -> str | None:
    """Why the ranks are not started again in this allocation (the cause of the requeue instead), or None: a stop
    signal reached this supervisor (a scancel or a requeue: the ranks' step saw it or was already gone), or the
    job is inside its time-limit warning (launcher.signal_delay_s before EndTime: the warning may have come while
    no rank was there to get it)."""
    if stopping:
        return signal.Signals(stopping[0]).name
    left = seconds_left(job_id)
    if left is not None and left <= cfg.launcher.signal_delay_s:
        get_logger().warning(
            "job %s ends in %.0f s <= launcher.signal_delay_s(%d): requeue instead of a restart",
            job_id,
            left,
            cfg.launcher.signal_delay_s,
        )
        return "walltime"
    return None


def _requeue_instead(cfg: JobConfig, *, job_id: str, restart: int, n: int, cause: str) -> int:
    """The restart that will not happen is decided as the attempt after it (as the guard does): a requeue
    within the budgets, nothing when Slurm is cancelling the job."""
    attempt = attempt_name(job_id, restart, n)
    events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=restart, attempt=attempt)
    ctx = _supervisor_context(
        cfg,
        attempt,
        job_id=job_id,
        restart=restart,
        events=events,
    )
    if not _claimed(cfg.run.dir, attempt):
        d = read_decision(cfg.run.dir, attempt, wait_s=5 * cfg.failure.heartbeat_s + 10)
        return int(d["exit_code"]) if d else exitcodes.REQUEUE
    return conclude(ctx, cause=cause, step=None)


def _scavenger(cfg: JobConfig, events: EventLog) -> Callable[[], object]:
    """The RAM tier's scavenge of this allocation, for a requeue decided here (`AttemptContext.before_requeue`)."""
    return lambda: scavenge_allocation(cfg, _allocation_nodes(), when="requeue", events=events)


def _step_failed(ctx: AttemptContext, code: int, *, exits_said: str | None) -> dict | None:
    """A step that ended badly with no task reported ended and no decision: srun could not create or launch it (a
    busy slurmctld, a node lost between the decision and the restart). Not FAILED: a `step_launch_failure`,
    requeued within the budgets (never restarted in the allocation again: that is what just failed)."""
    why = f"srun exited {code} before any rank ran" + (f" ({exits_said})" if exits_said else "")
    return decide_for_silent_attempt(ctx, step_code=code, why=why, cls="step_launch_failure")


def _placement(cfg: JobConfig, nodes: list[str]) -> dict[str, list[str]]:
    """With spares (launcher.spare_nodes): the attempt's `step_nodes` (the allocation's first launcher.nodes
    nodes off quarantine) and its idle `spares`, for its `attempt_start` and srun; {} without spares."""
    if not cfg.launcher.spare_nodes:
        return {}
    listed = quarantined(cfg.run.dir, ttl_h=cfg.failure.quarantine_ttl_h)
    step_nodes, spares = place(nodes, excluded={e["node"] for e in listed}, nodes=cfg.launcher.nodes)
    return {"step_nodes": step_nodes, "spares": spares}


def _off_quarantine(cfg: JobConfig, *, job_id: str, restart: int, nodes: list[str], n: int = 0) -> int | None:
    """An allocation that holds a quarantined node (the exclusion of an earlier requeue did not take, or a later
    submission of the same run dir) is requeued without them before any rank starts, within
    failure.max_requeues like every requeue (Slurm handing out the node again must not requeue the job
    forever): a `decision` of cause `quarantined_node` in the ledger, and the exit code; None when no
    quarantined node is in the allocation, or when its other nodes still hold launcher.nodes (spares: the
    ranks run on those, `_placement`)."""
    listed = sorted({e["node"] for e in quarantined(cfg.run.dir, ttl_h=cfg.failure.quarantine_ttl_h)})
    bad = sorted(set(nodes) & set(listed))
    if not bad or cfg.launcher.spare_nodes and len(set(nodes) - set(bad)) >= cfg.launcher.nodes:
        return None
    f, log = cfg.failure, get_logger()
    events = EventLog(
        Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=restart, attempt=attempt_name(job_id, restart, n)
    )
    used = requeues_used(read_events(events.path), restart_count=restart)
    facts = dict(cause="quarantined_node", requeues_used=used, max_requeues=f.max_requeues, excluded=listed)
    what = f"allocation includes quarantined node(s) {', '.join(bad)} ({cfg.run.dir}/quarantine.json)"
    if used >= f.max_requeues:
        reason = (
            f"{what} and the requeue budget is spent: {used} requeues >= failure.max_requeues({f.max_requeues}); "
            "check the nodes and remove them from quarantine.json, or exclude them in cluster.exclude"
        )
        events.emit("decision", action="stop", reason=reason, exit_code=exitcodes.STOPPED, **facts)
        log.error("%s: stop", reason)
        return exitcodes.STOPPED
    reason = f"{what}: requeue {used + 1} of failure.max_requeues({f.max_requeues}) without them"
    events.emit("decision", action="requeue", reason=reason, exit_code=exitcodes.REQUEUE, **facts)
    if n:  # attempts of this allocation ran since its start's scavenge: theirs, before `scontrol requeue`
        _scavenger(cfg, events)()
    ok, said = requeue_excluding(job_id, list(dict.fromkeys([*listed, *always_excluded(cfg)])))
    events.emit("requeue", job_id=job_id, ok=ok, scontrol=said, excluded=listed)
    log.error("%s (%s)", reason, said)
    return exitcodes.REQUEUE


def srun_step_command(
    cfg: JobConfig,
    config_path: Path,
    logs: list[str],
    *,
    step_nodes: list[str] | None = None,
    task_exits: Path | None = None,
) -> list[str]:
    """The ranks' srun step; `step_nodes` (with spares): exactly these nodes of the allocation, the others idle;
    `task_exits`: the folder where each task records how its rank ended (`jobs.launch.task_exits`)."""
    cl, ln = cfg.cluster, cfg.launcher
    args = [
        "srun",
        "--job-name=meshjob-ranks",
        "--kill-on-bad-exit=0",
        "--unbuffered",
        "--open-mode=append",
        f"--output={logs[0]}",
        f"--error={logs[1]}",
    ]
    if step_nodes is not None:  # --overlap: the step of a lost node lingers in Slurm 22.05 (RUNNING, its CPUs on
        # the surviving nodes held) after the node left the job; without it the spare's step waits for it forever
        args += [
            f"--nodes={ln.nodes}",
            f"--ntasks={cfg.world_size}",
            f"--ntasks-per-node={ln.tasks_per_node}",
            f"--nodelist={','.join(step_nodes)}",
            "--overlap",
        ]
    if cl.container_image:
        args.append(f"--container-image={cl.container_image}")
    if cl.container_mounts:
        args.append(f"--container-mounts={cl.container_mounts}")
    rank = [sys.executable, "-u", "-m", "jobs.launch.slurm", "--rank-config", str(config_path)]
    return [*args, *rank, *(["--task-exits", str(task_exits)] if task_exits is not None else [])]


@dataclass(slots=True)
class StepEnd:
    """How an srun step of the ranks ended, per task: each task's exit record (`jobs.launch.task_exits`: the
    task's own word, a death by signal included), else srun's line about it (the fallback for a task whose
    watcher died too: the step SIGKILLed, a lost node); a task with neither, in a step whose tasks wrote
    records, is lost."""

    code: int  # srun's exit code: the highest of the tasks' codes (a SIGKILLed node's 137 beats 76)
    gone: str | None  # the first task that ended badly, or the tasks lost; None: no task did
    srun_said: str | None  # srun's last `srun: error: ...` line
    task_codes: dict[int, int]  # task -> exit code, from its record, else from srun's line
    recorded: int = 0  # how many tasks wrote an exit record
    ntasks: int = 0

    @property
    def ran(self) -> bool:
        """Whether any task of the step ran (a record, or srun's word on a task's end)."""
        return bool(self.recorded or self.task_codes)

    @property
    def job_code(self) -> int:
        """One code for the step from its tasks' codes (`exitcodes.most_final`: 76 wins over a killed node's 137);
        srun's when the tasks do not say (no task ran, or no record and srun silent)."""
        bad = [c for c in self.task_codes.values() if c]
        if bad:
            return exitcodes.most_final(bad)
        return exitcodes.OK if self.ntasks and self.recorded == self.ntasks else self.code


def _run_step(
    cmd: list[str], env: dict[str, str], run_dir: str, attempt: str, *, no_decision_s: float, ntasks: int
) -> StepEnd:
    """One srun step of `ntasks` tasks, to its end; killed `_GRACE_S` after a published decision if still running,
    or `no_decision_s` after a task ended badly without any decision (see `_RankExits`)."""
    get_logger().info("starting attempt %s: %s", attempt, shlex.join(cmd))
    folder = exits_dir(run_dir, attempt)
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    exits = _RankExits(proc)
    decided_at, looked_at, records = None, 0.0, {}
    while True:
        try:
            code = proc.wait(timeout=_POLL_S)
            exits.settled()
            return exits.end(code, read_records(folder, known=records), ntasks=ntasks)
        except subprocess.TimeoutExpired:
            pass
        if exits.first_at is None and time.monotonic() - looked_at > _RECORDS_S:
            looked_at, records = time.monotonic(), read_records(folder, known=records)
            exits.recorded(records)
        if decided_at is None and read_decision(run_dir, attempt, wait_s=0) is not None:
            decided_at = time.monotonic()
        if decided_at is None and exits.first_at is not None and time.monotonic() - exits.first_at > no_decision_s:
            get_logger().error(
                "attempt %s: %s, and no decision %.0f s later (the failure path could not write?): ending the step",
                attempt,
                exits.first,
                no_decision_s,
            )
            decided_at = float("-inf")  # kill now
        if decided_at is not None and time.monotonic() - decided_at > _GRACE_S:
            _kill_steps()
            decided_at = float("inf")  # once


def _described(rec: dict) -> str:
    how = f"killed by {rec['signal']}" if rec.get("signal") else f"exited with code {rec['exit_code']}"
    return f"task {rec['task']} on {rec.get('node')} (pid {rec.get('pid')}): {how} (its exit record)"


class _RankExits:
    """The tasks that ended badly, as their exit records and srun's own stderr say: a rank that left without a
    decision (its failure path could not write to a full or read-only disk) must not leave the others waiting until
    the time limit. srun's stderr is passed through and watched for its lines about tasks that ended (`srun:
    error: node1: task 1: Exited with exit code 75`, `... tasks 0-3: Killed`, `... task 2: Out Of Memory`, `...
    task 0: Bus error`; srun prints one when a task ends badly, while the step goes on under --kill-on-bad-exit=0):
    any text after the task list counts as an end (srun words a death by signal with strsignal, whose text varies);
    `codes` keeps each task's exit code as far as the text says it (128 + N for signal N, 137 for Out Of Memory,
    FAILED when it cannot be told). A task's exit record, when there is one, says it better (`end`)."""

    _ENDED = re.compile(r"srun: error: [^:\s]+: tasks? ([\d,\-]+): (.+)$")
    _EXITED = re.compile(r"Exited with exit code (\d+)")

    def __init__(self, proc: subprocess.Popen) -> None:
        self.first: str | None = None
        self.first_at: float | None = None
        self.codes: dict[int, int] = {}  # task -> exit code, for the tasks srun reported ended badly
        self.last_error: str | None = None  # srun's last `srun: error: ...` line
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, args=(proc.stderr,), name="srun-stderr", daemon=True)
        self._thread.start()

    def settled(self) -> str | None:
        """`first`, once srun's last lines are read (it prints a task's end as the step ends, too)."""
        self._thread.join(timeout=5.0)
        return self.first

    def recorded(self, records: dict[int, dict]) -> None:
        """The first record of a task that ended badly starts the bound, whatever srun printed."""
        bad = sorted((r for r in records.values() if r.get("exit_code")), key=lambda r: r.get("time", 0))
        if bad:
            self._ended(_described(bad[0]))

    def end(self, code: int, records: dict[int, dict], *, ntasks: int) -> StepEnd:
        """The step's end: each task's code from its record, else srun's line; the tasks with neither are lost
        (in a step whose tasks wrote records and that srun saw end badly: then a missing record means something)."""
        self.recorded(records)
        codes = {**self.codes, **{t: int(r["exit_code"]) for t, r in records.items()}}
        gone = self.first
        # srun exits 0 only when every task did: then a missing record is a write that failed, not a lost task
        lost = [t for t in range(ntasks) if t not in codes] if records and code != exitcodes.OK else []
        if gone is None and lost:
            gone = f"task(s) {_ranges(lost)} left no exit record and srun named no end for them (lost with their node?)"
        return StepEnd(code, gone, self.last_error, codes, recorded=len(records), ntasks=ntasks)

    def _ended(self, what: str) -> None:
        with self._lock:
            if self.first_at is None:
                self.first, self.first_at = what, time.monotonic()

    def _pump(self, stream) -> None:
        for line in stream:
            sys.stderr.write(line)
            sys.stderr.flush()
            if line.startswith("srun: error:"):
                self.last_error = line.strip()
            m = self._ENDED.search(line.strip())
            if m is None:
                continue
            for task in _task_list(m.group(1)):
                self.codes[task] = task_code(m.group(2))
            self._ended(line.strip())


def _ranges(tasks: list[int]) -> str:
    """[0, 2, 3, 4] -> `0,2-4` (srun's own notation)."""
    spans: list[list[int]] = []
    for t in sorted(tasks):
        if spans and spans[-1][1] == t - 1:
            spans[-1][1] = t
        else:
            spans.append([t, t])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


_SIGNAL_TEXT = {signal.strsignal(s): int(s) for s in signal.Signals if signal.strsignal(s)}


def task_code(text: str) -> int:
    """The exit code of a task from srun's words for its end: `Exited with exit code N` -> N, a signal's
    strsignal text -> 128 + N, `Out Of Memory` -> 137 (the OOM killer's SIGKILL), else FAILED."""
    m = _RankExits._EXITED.search(text)
    if m:
        return int(m.group(1))
    if text.strip().lower().startswith("out of memory"):
        return 128 + signal.SIGKILL
    sig = _SIGNAL_TEXT.get(text.strip().removesuffix(" (core dumped)"))
    return 128 + sig if sig else exitcodes.FAILED


def _task_list(spec: str) -> list[int]:
    """`0,2-4` -> [0, 2, 3, 4]."""
    out: list[int] = []
    for part in filter(None, spec.split(",")):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def _numbered_steps(tries: int = 3) -> list[str]:
    """The running steps of this job but the batch step: the ranks' srun step and any probe step. `squeue` is
    bounded by `_SQUEUE_S` and tried `tries` times (a busy slurmctld); [] when it never answered (logged)."""
    cmd = ["squeue", "-h", "-s", "-j", os.environ["SLURM_JOB_ID"], "-o", "%i"]
    for n in range(tries):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=_SQUEUE_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            said = str(e)
        else:
            if out.returncode == 0:
                return [s for s in out.stdout.split() if s.split(".")[-1].isdigit()]
            said = f"rc {out.returncode} {out.stderr.strip()}"
        get_logger().warning("squeue (try %d of %d): %s", n + 1, tries, said)
        if n + 1 < tries:
            time.sleep(min(2.0**n, 5.0))
    return []


def _kill_steps(why: str = f"still running {_GRACE_S:.0f} s after the decision") -> None:
    """SIGKILL to every numbered step of this job (a SIGSTOPped or stuck rank never ends by itself)."""
    steps = _numbered_steps()
    get_logger().warning("killing step(s) %s: %s", steps, why)
    for s in steps:
        subprocess.run(["scancel", "--signal=KILL", s], capture_output=True)


def _after_supervisor_death(cfg: JobConfig, *, pid: int, how: str) -> int:
    """The guard's part: record the death, stop the ranks as a preemption would (they save and decide),
    wait for them, and decide here when none did (no step was running, or it had to be killed); then end the
    allocation as the dead supervisor would have (`_end_allocation`; a requeue decided here scavenged before it)."""
    code, events = _guard_decides(cfg, pid=pid, how=how)
    return _end_allocation(cfg, code, events=events)


def _guard_decides(cfg: JobConfig, *, pid: int, how: str) -> tuple[int, EventLog]:
    """`_after_supervisor_death` up to the end of the allocation: the exit code, and the ledger it recorded in."""
    job_id, restart = slurm_job_id(os.environ), int(os.environ.get("SLURM_RESTART_COUNT", 0))
    attempt, n = _current_attempt(cfg.run.dir, job_id, restart)
    events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=restart, attempt=attempt)
    signals = parse_signals(cfg.failure.requeue_signals)
    steps = _numbered_steps()
    summary = f"the supervisor (pid {pid}) {how} while step(s) {steps or 'none'} ran; " + (
        f"sending {signals[0].name} to the ranks" if steps and signals else "deciding in its place"
    )
    get_logger().error("attempt %s: %s", attempt, summary)
    events.emit("failure", cls="supervisor_died", summary=summary, suspects=[], reported_by=-1)
    if steps and signals:
        subprocess.run(["scancel", f"--signal={signals[0].name.removeprefix('SIG')}", job_id], capture_output=True)
        _wait_for_ranks(cfg, attempt)
    if _numbered_steps():
        _kill_steps("the supervisor is gone and the ranks did not end")
    d = read_decision(cfg.run.dir, attempt, wait_s=0)
    if d is not None and d["action"] != "restart":
        return int(d["exit_code"]), events
    if d is not None:  # the ranks asked for a restart that nobody will start: the attempt after it decides
        attempt = attempt_name(job_id, restart, n + 1)
        events = EventLog(events.path, rank=-1, restart=restart, attempt=attempt)
    ctx = _supervisor_context(cfg, attempt, job_id=job_id, restart=restart, events=events)
    if _claimed(cfg.run.dir, attempt):
        return conclude(ctx, cause="supervisor_died", step=None), events
    # A decider claimed it: it publishes soon, or it died as well (the double fault): then decide in its place,
    # as the supervisor would have (`decide_for_lost_decider`: a requeue within the budget), never a bare 75.
    d = read_decision(cfg.run.dir, attempt, wait_s=5 * cfg.failure.heartbeat_s + 10)
    d = d or decide_for_lost_decider(ctx, step_code=exitcodes.REQUEUE)
    return int(d["exit_code"]) if d else conclude(ctx, cause="supervisor_died", step=None), events


def _claimed(run_dir: str, attempt: str) -> bool:
    """`claim`; an incidents folder that refuses the claim leaves nobody else to decide: True."""
    try:
        return claim(run_dir, attempt)
    except OSError as e:
        get_logger().error("attempt %s: cannot claim its decision (%s); deciding without a claim", attempt, e)
        return True


def after_agents(cfg: JobConfig, *, step_code: int) -> int:
    """The torchrun style's batch step once its agents' srun step ended: the job's exit code is the allocation's
    newest decision's, not srun's (the highest of the agents' codes: a SIGKILLed node's 137 would beat 76, "do not
    requeue"); and, as the supervisor does, decided here when that attempt's decider died between claim and publish,
    or when the step failed and no rank could claim it. No restart follows here: the agents are gone."""
    job_id, restart = slurm_job_id(os.environ), int(os.environ.get("SLURM_RESTART_COUNT", 0))
    attempt, n = _current_attempt(cfg.run.dir, job_id, restart)
    ctx = _supervisor_context(
        cfg,
        attempt,
        job_id=job_id,
        restart=restart,
        events=EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=restart, attempt=attempt),
        restart_in_allocation=n,
    )
    d = read_decision(cfg.run.dir, attempt, wait_s=0) or decide_for_lost_decider(ctx, step_code=step_code)
    if d is None and step_code != exitcodes.OK:
        d = decide_for_silent_attempt(ctx, step_code=step_code, why=f"the agents' srun step exited {step_code}")
    return _end_allocation(cfg, step_code if d is None else int(d["exit_code"]), events=ctx.events)


def _current_attempt(run_dir: str, job_id: str, restart: int) -> tuple[str, int]:
    """The newest attempt of this allocation that the ledger knows, and its restart inside the allocation."""
    base = attempt_name(job_id, restart)
    starts = [
        e["attempt"]
        for e in read_events(Path(run_dir) / "events.jsonl", "attempt_start")
        if e.get("attempt") == base or str(e.get("attempt", "")).startswith(base + ".")
    ]
    if not starts:
        return base, 0
    return starts[-1], int(starts[-1][len(base) + 1 :] or 0)


def _wait_for_ranks(cfg: JobConfig, attempt: str) -> None:
    """Until the ranks' steps have ended; `_GRACE_S` after their decision, or past the longest bound
    of their own watchdog (they may still be loading), the caller kills what is left."""
    f = cfg.failure
    deadline = time.monotonic() + max(f.init_timeout_s, f.hang_timeout_s) + _GRACE_S
    decided_at = None
    while _numbered_steps() and time.monotonic() < deadline:
        if decided_at is None and read_decision(cfg.run.dir, attempt, wait_s=0) is not None:
            decided_at = time.monotonic()
        if decided_at is not None and time.monotonic() - decided_at > _GRACE_S:
            return
        time.sleep(1.0)


def _supervisor_context(
    cfg: JobConfig, attempt: str, *, job_id: str | None, restart: int, events, **facts
) -> AttemptContext:
    """The supervisor's view of `attempt` (rank -1): the run's failure policy and ledger, the job's Slurm facts (its
    partition and the nodes it needs, which a quarantine must leave usable), and, in a job, the allocation's scavenge
    before any requeue decided with it (the supervisor's, its guard's, the torchrun style's batch step's: every
    requeue path); `facts`: the rest of `AttemptContext` (its restarts inside the allocation, whether supervised)."""
    return AttemptContext(
        run_dir=cfg.run.dir,
        attempt=attempt,
        rank=-1,
        world_size=cfg.world_size,
        job_id=job_id,
        restart_count=restart,
        cfg=cfg.failure,
        events=events,
        always_excluded=always_excluded(cfg),
        partition=cfg.cluster.partition,
        nodes_needed=cfg.launcher.nodes + cfg.launcher.spare_nodes,
        before_requeue=_scavenger(cfg, events) if job_id else None,
        **facts,
    )
