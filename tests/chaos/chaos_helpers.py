"""Helpers of the chaos tier: the common job, the uninterrupted reference, faults injected from outside, and the bitwise comparison."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from checkpoint.convert import convert
from jobs.events import read_events
from tests.conftest import assert_states_bitwise, run_train
from tests.slurm.slurm_helpers import FINAL, REPO, cli, sacct, submitted_job_id

# 100 steps: the faults land at step ~40 (past the save at 25) and, for the sbatch case, again at 60; the
# rest is what the job trains after its recovery. (The time-limit case holds its first attempt's ranks back
# instead of running longer: Slurm's warning comes up to 60 s into an attempt, which it must outlast on any machine.)
STEPS = 100
# The cases whose fault is a kill, a requeue or a stop that acts at once run 60 steps: the fault at step 30 (past the
# save at 25, 30 steps before the end), then 30-35 steps trained after the recovery, against their own reference
# (made once per session). The rest stay at STEPS: a preemption waits for the scheduler, the sbatch and supervisor
# cases need a second fault after the first recovery, the time-limit case stalls every step.
SHORT_STEPS = 60
SHORT_FAULT_STEP = 30
# A shorter failure.hang_timeout_s (conf/failure/debug.yaml: 20 s) for the cases that wait one out: the save held past
# it, and the supervisor's wait for a decision that no rank can publish. What they prove is relative to it.
SHORT_HANG_S = 10.0
# Bounds of the waits (seconds): each fires with its own message, and a test's pytest-timeout marker
# (bound_s) sits above their sum, so a slow day reports the wait that expired, not pytest-timeout.
REFERENCE_S, STEP_S, DONE_S = 300, 180, 360
# Two ranks on two nodes (FSDP over dp_shard2), the debug failure policy (hang named after 20 s).
BASE = [
    "launcher.nodes=2",
    "launcher.tasks_per_node=1",
    "mesh=single",
    "mesh.dp_shard=2",
    "checkpoint.every_steps=25",
    "failure=debug",
]


def common(steps: int = STEPS) -> list[str]:
    """The chaos tier's job config at `steps` steps."""
    return [*BASE, f"train.steps={steps}"]


COMMON = common(STEPS)


def bound_s(*waits: float) -> float:
    """A pytest-timeout for a test whose own waits are `waits` (its first use of the shared reference run
    included), with a minute for the rest (submission, conversions, comparisons)."""
    return REFERENCE_S + sum(waits) + 60


def reference_run(run_dir: Path, tmp: Path, steps: int = STEPS) -> tuple[dict, Path]:
    """The config run uninterrupted by the local launcher (2 forked ranks, the same mesh and data): every
    step's loss and the file of its final state, what a recovered run must equal bit for bit. The state stays
    on disk: the session keeps references, and tensors held by the pytest process are inherited by every rank
    the later tiers fork (tests/multiproc/test_plan_vs_measured.py counts every live tensor)."""
    r = run_train(["launcher=local", *common(steps)], run_dir, timeout=REFERENCE_S)
    assert r.returncode == 0, r.stderr[-3000:]
    return losses(run_dir), final_state_file(run_dir, tmp, steps=steps)


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl; a requeued attempt appends, so the newest line of a step wins."""
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def final_state_file(run_dir: Path, tmp: Path, *, steps: int = STEPS) -> Path:
    """The run's step-`steps` checkpoint converted to one torch.save file under `tmp`."""
    out = tmp / f"{run_dir.name}-{time.monotonic_ns()}.pt"
    convert(run_dir / f"checkpoints/step_{steps}", out)
    return out


def final_state(run_dir: Path, tmp: Path, *, steps: int = STEPS) -> dict:
    return torch.load(final_state_file(run_dir, tmp, steps=steps), weights_only=False)


def assert_bitwise_equal_to_reference(run_dir: Path, reference: tuple[dict, Path], tmp: Path) -> None:
    """Every step's loss and the final parameters and optimizer state are bit-for-bit the reference's
    (`reference`: its losses and its final state's file, see `reference_run`)."""
    ref_losses, ref_file = reference
    ref_final = torch.load(ref_file, weights_only=False)
    steps = max(ref_losses)  # the reference's length
    got = losses(run_dir)
    assert sorted(got) == list(range(1, steps + 1)), sorted(set(range(1, steps + 1)) - set(got))
    bad = [(s, got[s], ref_losses[s]) for s in got if got[s] != ref_losses[s]]
    assert not bad, bad[:5]
    final = final_state(run_dir, tmp, steps=steps)
    assert_states_bitwise(final, ref_final)


def submit(run_dir: Path, *extra: str, steps: int = STEPS) -> str:
    r = cli("jobs.train", "launcher=slurm", *common(steps), *extra, f"run.dir={run_dir}")
    assert r.returncode == 0, r.stdout + r.stderr
    return submitted_job_id(r.stdout)


def wait_for_step(run_dir: Path, step: int, *, timeout: float = STEP_S) -> None:
    """Until metrics.jsonl has reached `step` (the job is training, past its first checkpoint)."""
    deadline = time.monotonic() + timeout
    path = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if path.exists() and any(json.loads(l)["step"] >= step for l in path.read_text().splitlines()[-3:] if l):
            return
        time.sleep(0.2)
    raise AssertionError(f"{run_dir} did not reach step {step} within {timeout} s")


def reported_pid(run_dir: Path, attempt: str, rank: int) -> int:
    """Rank `rank`'s pid as its heartbeat reports it: on its own node (what the product's incidents name)."""
    return json.loads((run_dir / "heartbeats" / attempt / f"rank{rank}.json").read_text())["pid"]


def rank_node(run_dir: Path, attempt: str, rank: int) -> str:
    """The Slurm node rank `rank` runs on, as its heartbeat reports it."""
    return json.loads((run_dir / "heartbeats" / attempt / f"rank{rank}.json").read_text())["node"]


def rank_pid(run_dir: Path, attempt: str, rank: int) -> int:
    """Rank `rank`'s pid on this host, the one a signal from here takes (its heartbeat names its node and its pid
    there)."""
    beat = json.loads((run_dir / "heartbeats" / attempt / f"rank{rank}.json").read_text())
    return host_pid(beat["node"], beat["pid"])


def wait_job_done(job: str, *, timeout: float = DONE_S) -> list[dict[str, str]]:
    """Polls until the job has no PENDING/RUNNING/REQUEUED-waiting record left; returns sacct's records."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.strip()
        if not state:
            return _accounted(job)
        time.sleep(0.25)
    raise AssertionError(f"job {job} still queued or running after {timeout} s: {sacct(job)}")


# What a job that has left the queue ends in: a REQUEUED, RESIZING or (PreemptMode=REQUEUE, scripts/slurm/start)
# PREEMPTED record is always followed by the record of the allocation after it. Accounting may write that one later:
# CI once read [REQUEUED] alone for a job that had completed.
ENDED = FINAL - {"REQUEUED", "RESIZING", "PREEMPTED"}


def _accounted(job: str, *, wait_s: float = 30) -> list[dict[str, str]]:
    """sacct's records of a job that has left the queue, once accounting shows every one of them final and the last
    one the job's end (ENDED) (it lags the queue by about 0.1 s here; this replaced a fixed 2 s sleep per chaos
    test). A record still not final after `wait_s` fails here, naming it: a state missing from FINAL (RESIZING was)
    would otherwise cost every test that meets it the whole wait, unseen."""
    deadline = time.monotonic() + wait_s
    while True:
        recs = sacct(job)
        if recs and all(r["State"].split()[0] in FINAL for r in recs) and recs[-1]["State"].split()[0] in ENDED:
            return recs
        assert time.monotonic() < deadline, (
            f"job {job} left the queue, but sacct's records are not final after {wait_s} s: {recs}"
        )
        time.sleep(0.1)


def supervisor_and_guard(run_dir: Path) -> tuple[int, int]:
    """The batch step's two pythons, found from outside: the supervisor is the parent of the ranks'
    `srun` (its --rank-config lies in this run dir), the guard is the supervisor's parent."""
    ps = subprocess.run(["ps", "-ww", "-eo", "pid=,ppid=,args="], capture_output=True, text=True, check=True).stdout
    procs = {
        int(p): (int(pp), args) for p, pp, args in (line.split(None, 2) for line in ps.splitlines() if line.strip())
    }
    sruns = {
        p
        for p, (_, args) in procs.items()
        if args.startswith("srun ") and "--rank-config" in args and str(run_dir) in args
    }
    (srun_parent,) = {procs[p][0] for p in sruns} - sruns  # srun runs a child srun of its own
    return srun_parent, procs[srun_parent][0]


def events(run_dir: Path, kind: str | None = None) -> list[dict]:
    return read_events(run_dir / "events.jsonl", kind)


def status(run_dir: Path) -> str:
    r = subprocess.run([sys.executable, "-m", "jobs.status", str(run_dir)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


SLURM_RUN = Path(os.environ.get("SLURM_CI_ROOT", "/var/tmp/meshjob-slurm")) / "run"


# --- the cluster's nodes are hosts of their own (scripts/slurm/start, SLURM_CI_HOSTS=1): each has its own PID
# namespace and /dev/shm. This host (the login node) sees their processes under other pids, and their /dev/shm
# through their namespace's init. On the one-host layout (SLURM_CI_HOSTS=0) every helper is the identity.


def _node_init(node: str) -> int | None:
    """This host's pid of the init of `node`'s PID namespace, or None when the nodes share this host's."""
    f = SLURM_RUN / f"node-{node}.pid"
    return int(f.read_text().strip()) if f.exists() else None


def nodes_are_hosts() -> bool:
    """Whether the running cluster's nodes are hosts of their own (else they share this one)."""
    return _node_init("node1") is not None


def _nspid(proc: Path) -> list[int]:
    """A process's pids, from this host's namespace's down to its own (/proc/PID/status NSpid)."""
    for line in (proc / "status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(p) for p in line.split()[1:]]
    return [int(proc.name)]


def host_pid(node: str, pid: int) -> int:
    """The pid on this host of the process that `node` knows as `pid`."""
    init = _node_init(node)
    if init is None:
        return pid
    ns = os.readlink(f"/proc/{init}/ns/pid")
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "ns/pid") == ns and _nspid(proc)[-1] == pid:
                return int(proc.name)
        except OSError:  # gone meanwhile
            continue
    raise ProcessLookupError(f"no process {pid} on {node}")


def node_pid(pid: int) -> int:
    """The pid that this host's process `pid` has on its own node (what the product running there reports)."""
    return _nspid(Path(f"/proc/{pid}"))[-1]


def node_path(node: str, path: str) -> Path:
    """`path` as `node` sees it (its /dev/shm is its own), read from this host."""
    init = _node_init(node)
    return Path(path) if init is None else Path(f"/proc/{init}/root") / path.lstrip("/")


def take_node_down(node: str, rank_pids: list[int]) -> None:
    """A node lost from outside, as a power cut looks to the rest of the job: every process on it SIGKILLed (the
    init of its PID namespace; the kernel kills the rest), its slurmd included, so that it no longer answers Slurm or
    a probe step, and its /dev/shm gone with its mount namespace. On the one-host layout: its slurmd and the job's
    ranks on it (`rank_pids`, pids on this host)."""
    init = _node_init(node)
    if init is not None:
        os.kill(init, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{init}").exists() and _state(init) not in ("Z", "X"):
            assert time.monotonic() < deadline, f"{node}'s init (pid {init}) still there 30 s after SIGKILL"
            time.sleep(0.05)
        return
    os.kill(int((SLURM_RUN / f"slurmd-{node}.pid").read_text().strip()), signal.SIGKILL)
    for pid in rank_pids:
        os.kill(pid, signal.SIGKILL)


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def bring_nodes_back() -> None:
    """scripts/slurm/start restarts a missing slurmd and resumes nodes left down (idempotent)."""
    subprocess.run([REPO / "scripts/slurm/start"], check=True, timeout=300, capture_output=True)
