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
from pathlib import Path

from jobs import exitcodes
from jobs.config import JobConfig
from jobs.events import EventLog
from jobs.failure.policy import read_decision
from jobs.failure.quarantine import quarantined, requeue_excluding
from jobs.failure.respond import AttemptContext, decide_for_lost_decider, open_attempt
from jobs.launch.env import RESTART_IN_ALLOCATION_VAR, attempt_name, expand_nodelist, slurm_job_id
from jobs.log import get_logger

__all__ = ["supervise", "rank_config_path", "load_rank_config"]

_GRACE_S = 10.0  # after a decision, how long the step may take to end before it is killed
_POLL_S = 0.2


def rank_config_path(run_dir: str, job_id: str, restart_count: int) -> Path:
    return Path(run_dir) / "rendezvous" / f"{job_id}.{restart_count}.config.pkl"


def load_rank_config(path: str | os.PathLike[str]) -> JobConfig:
    with open(path, "rb") as f:
        return pickle.load(f)


def supervise(cfg: JobConfig, *, logs: tuple[str, str]) -> int:
    """Runs the ranks until an attempt ends with anything but "restart"; returns that attempt's exit
    code. `logs`: srun's --output and --error patterns; `{attempt}` is replaced per attempt."""
    job_id, restart = slurm_job_id(os.environ), int(os.environ.get("SLURM_RESTART_COUNT", 0))
    nodes = expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", os.uname().nodename))
    stopping: list[int] = []
    for s in (signal.SIGTERM, signal.SIGUSR2):
        signal.signal(s, lambda signum, _f: stopping.append(signum))
    listed = sorted({e["node"] for e in quarantined(cfg.run.dir)})
    bad = sorted(set(nodes) & set(listed))
    if bad:  # the exclusion of an earlier requeue did not take (or a later submission of the same run dir)
        ok, said = requeue_excluding(job_id, listed)
        get_logger().error("allocation includes quarantined node(s) %s: requeued without them (%s)", bad, said)
        return exitcodes.REQUEUE
    path = rank_config_path(cfg.run.dir, job_id, restart)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(cfg))
    n = 0
    while True:
        attempt = attempt_name(job_id, restart, n)
        events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=restart, attempt=attempt)
        ctx = AttemptContext(run_dir=cfg.run.dir, attempt=attempt, rank=-1, world_size=cfg.world_size, job_id=job_id,
                             restart_count=restart, cfg=cfg.failure, events=events, supervised=True,
                             restart_in_allocation=n, partition=cfg.cluster.partition, nodes_needed=cfg.launcher.nodes)
        open_attempt(ctx, nodes=nodes, launcher="slurm", restart_in_allocation=n)
        cmd = _srun(cfg, path, [p.replace("{attempt}", attempt.split(".", 1)[1]) for p in logs])
        code = _run_step(cmd, {**os.environ, RESTART_IN_ALLOCATION_VAR: str(n)}, cfg.run.dir, attempt,
                         no_decision_s=cfg.failure.hang_timeout_s)  # a decider has long published by then
        # A claimed attempt without a decision: its decider died deciding; decide in its place.
        d = read_decision(cfg.run.dir, attempt, wait_s=0) or decide_for_lost_decider(ctx, step_code=code)
        if d is None or d["action"] != "restart" or stopping:
            return code if d is None else int(d["exit_code"])
        get_logger().warning("attempt %s ended by a restart decision: starting the ranks again (restart %d "
                             "inside job %s)", attempt, n + 1, job_id)
        n += 1


def _srun(cfg: JobConfig, config_path: Path, logs: list[str]) -> list[str]:
    cl = cfg.cluster
    args = ["srun", "--job-name=meshjob-ranks", "--kill-on-bad-exit=0", "--unbuffered", "--open-mode=append", f"--output={logs[0]}",
            f"--error={logs[1]}"]
    if cl.container_image:
        args.append(f"--container-image={cl.container_image}")
    if cl.container_mounts:
        args.append(f"--container-mounts={cl.container_mounts}")
    return [*args, sys.executable, "-u", "-m", "jobs.launch.slurm", "--rank-config", str(config_path)]


def _run_step(cmd: list[str], env: dict[str, str], run_dir: str, attempt: str, *, no_decision_s: float) -> int:
    """One srun step: its exit code; killed `_GRACE_S` after a published decision if still running, or
    `no_decision_s` after a rank left without any decision (see `_RankExits`)."""
    get_logger().info("starting attempt %s: %s", attempt, shlex.join(cmd))
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, errors="replace")
    exits = _RankExits(proc)
    decided_at = None
    while True:
        try:
            return proc.wait(timeout=_POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if decided_at is None and read_decision(run_dir, attempt, wait_s=0) is not None:
            decided_at = time.monotonic()
        if decided_at is None and exits.first_at is not None and time.monotonic() - exits.first_at > no_decision_s:
            get_logger().error("attempt %s: %s, and no decision %.0f s later (the failure path could not write?): "
                               "ending the step", attempt, exits.first, no_decision_s)
            decided_at = float("-inf")  # kill now
        if decided_at is not None and time.monotonic() - decided_at > _GRACE_S:
            _kill_steps()
            decided_at = float("inf")  # once


class _RankExits:
    """srun's own stderr, passed through, watched for its line about a rank that ended (`srun: error:
    node1: task 1: Exited with exit code 75`; srun prints it when the task ends, while the step goes on
    under --kill-on-bad-exit=0): a rank that left without a decision (its failure path could not write
    to a full or read-only disk) must not leave the others waiting until the time limit."""

    _ENDED = re.compile(r"tasks? [\d,\-]+: (Exited with exit code \d+|Killed|Terminated|Aborted|Segmentation fault)")

    def __init__(self, proc: subprocess.Popen) -> None:
        self.first: str | None = None
        self.first_at: float | None = None
        threading.Thread(target=self._pump, args=(proc.stderr,), name="srun-stderr", daemon=True).start()

    def _pump(self, stream) -> None:
        for line in stream:
            sys.stderr.write(line)
            sys.stderr.flush()
            m = self._ENDED.search(line)
            if m and self.first_at is None:
                self.first, self.first_at = line.strip(), time.monotonic()


def _kill_steps() -> None:
    """SIGKILL to every numbered step of this job (a SIGSTOPped or stuck rank never ends by itself)."""
    job = os.environ["SLURM_JOB_ID"]
    out = subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True, text=True).stdout
    steps = [s for s in out.split() if s.split(".")[-1].isdigit()]
    get_logger().warning("killing step(s) %s: still running %.0f s after the decision", steps, _GRACE_S)
    for s in steps:
        subprocess.run(["scancel", "--signal=KILL", s], capture_output=True)
