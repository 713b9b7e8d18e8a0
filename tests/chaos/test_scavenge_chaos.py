"""The RAM tier's scavenge on the local cluster (each node a host with its own /dev/shm): a rank killed with
`kill -9` while RAM holds a step newer than the filesystem's ends the allocation (failure.restarts_in_allocation=0:
a requeue); before `scontrol requeue` that step is flushed to the filesystem and every node's RAM folder of the run
removed; the requeued job resumes from the flushed step, trains the same losses again, finishes, and leaves no
folder of the run in any node's /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from checkpoint.config import memory_root
from checkpoint.manifest import step_dirs
from jobs.launch.rundir import run_id
from tests.chaos.chaos_helpers import DONE_S, STEP_S, events, node_path, rank_node, rank_pid, submit, wait_job_done

STEPS = 12
FS_EVERY = 4
RAM = [
    f"checkpoint.every_steps={FS_EVERY}",
    "checkpoint.memory_every_steps=2",
    "checkpoint.memory_replicas=0",
    "failure.restarts_in_allocation=0",  # a dead rank ends the allocation: the scavenge's case
]
NODES = ("node1", "node2", "node3")

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.slow,
    pytest.mark.usefixtures("slurm_cluster"),
    pytest.mark.timeout(STEP_S + DONE_S + 60),
]


def _newest(path: Path) -> int:
    """The newest step in metrics.jsonl (0 when none)."""
    lines = path.read_text().splitlines() if path.exists() else []
    return max([json.loads(line)["step"] for line in lines[-3:] if line] or [0])


def _frozen_ram_above_fs(run_dir: Path, attempt: str, root: str, pids: list[int]) -> int | None:
    """With both ranks stopped (SIGSTOP): the newest RAM step both ranks' nodes hold committed when it is above the
    filesystem's newest committed step and below the newest step trained (so the first attempt trained a step after
    it, to compare after the resume); else None (the ranks are let go on)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    fs = max([s for s, _ in step_dirs(run_dir / "checkpoints")], default=0)
    held = []
    for r in (0, 1):
        rank_dir = node_path(rank_node(run_dir, attempt, r), root)
        held.append({s for d in rank_dir.glob(f"*/rank_{r}") for s, _ in step_dirs(d)})
    common = held[0] & held[1]
    ram = max(common, default=0)
    if fs >= FS_EVERY and ram > fs and ram < _newest(run_dir / "metrics.jsonl"):
        return ram
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    return None


def _losses_by_attempt(run_dir: Path) -> list[dict[int, float]]:
    """[{step: loss}] of each attempt in order (metrics.jsonl appends; a step trained again starts a new one)."""
    out: list[dict[int, float]] = [{}]
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "loss" not in m:
            continue
        if m["step"] in out[-1] or (out[-1] and m["step"] < max(out[-1])):
            out.append({})
        out[-1][m["step"]] = m["loss"]
    return out


def test_a_requeue_flushes_the_newer_ram_step_resumes_from_it_and_no_node_keeps_the_runs_ram_folders(
    run_root: Path,
) -> None:
    job = submit(run_root, *RAM, steps=STEPS)
    first = f"{job}.0"
    root = str(memory_root("/dev/shm", run_id(run_root)))
    try:
        deadline = time.monotonic() + STEP_S
        while not all((run_root / f"heartbeats/{first}/rank{r}.json").exists() for r in (0, 1)):
            assert time.monotonic() < deadline, f"no rank of {first} within {STEP_S} s"
            time.sleep(0.2)
        pids = [rank_pid(run_root, first, r) for r in (0, 1)]
        while (ram := _frozen_ram_above_fs(run_root, first, root, pids)) is None:
            assert time.monotonic() < deadline, f"RAM never held a step above the filesystem's within {STEP_S} s"
            time.sleep(0.1)
        os.kill(pids[1], signal.SIGKILL)
        os.kill(pids[0], signal.SIGCONT)
        recs = wait_job_done(job)
    finally:
        subprocess.run(["scancel", job], capture_output=True)
    assert [r["State"].split()[0] for r in recs] == ["REQUEUED", "COMPLETED"], recs
    scav = events(run_root, "ram_scavenged")
    # before the requeue: the newest complete RAM step above the filesystem's flushed, both nodes cleaned
    requeue = [e for e in scav if e["when"] == "requeue"]
    assert len(requeue) == 1 and "failed_nodes" not in requeue[0] and "flush_error" not in requeue[0], scav
    flushed, fs = requeue[0]["flushed_step"], requeue[0]["filesystem_step"]
    assert flushed == ram and ram > fs >= FS_EVERY, (ram, requeue)
    # the requeued allocation resumed from the flushed step, through the filesystem tier
    loaded = [(e["step"], e["tier"]) for e in events(run_root, "checkpoint_loaded")]
    assert loaded == [(flushed, "filesystem")], loaded
    # and trained the steps after it to the same losses as the first attempt did before the kill
    attempts = _losses_by_attempt(run_root)
    again = sorted(set(attempts[0]) & set(attempts[-1]))
    assert again and again[0] == flushed + 1, (flushed, again)
    assert [attempts[-1][s] for s in again] == [attempts[0][s] for s in again]
    assert max(attempts[-1]) == STEPS
    # the ends of both allocations: the start found nothing left, the end removed what the finished ranks left
    assert [e["when"] for e in scav] == ["allocation_start", "requeue", "allocation_start", "allocation_end"], scav
    assert all(not e.get("failed_nodes") and not e.get("error") for e in scav), scav
    assert [n for n in NODES if node_path(n, root).exists()] == []
