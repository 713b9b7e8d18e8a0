"""Hot spares on the local cluster (3 nodes): a 2-node job holding one spare, keeping a RAM copy of every step with a
partner copy on the other node, loses a node, taken down from outside with its RAM folder; it goes on inside the same
allocation on the other node and the spare, the replaced rank reading its state from the copy the surviving node
holds (newer than the filesystem's newest), bitwise equal to the uninterrupted run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from checkpoint.config import memory_root
from jobs.launch.rundir import run_id
from tests.chaos.chaos_helpers import (
    SHORT_FAULT_STEP,
    SHORT_STEPS,
    STEP_S,
    assert_bitwise_equal_to_reference,
    bound_s,
    bring_nodes_back,
    events,
    node_path,
    nodes_are_hosts,
    rank_pid,
    status,
    submit,
    take_node_down,
    wait_for_step,
    wait_job_done,
)
from tests.slurm.slurm_helpers import scontrol_job

SWAP_DONE_S = 600  # Slurm declares the node down SlurmdTimeout (10 s here) after its last answer; the rest is training
FS_EVERY = 25  # chaos_helpers.BASE: checkpoint.every_steps
# A RAM save of every step (checkpoint.memory_every_steps=1), each rank's copied to the other node.
RAM = ["checkpoint.memory_every_steps=1", "checkpoint.memory_replicas=1"]

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.slow,
    pytest.mark.usefixtures("slurm_cluster"),
    pytest.mark.timeout(bound_s(STEP_S, SWAP_DONE_S, 300)),
]  # 300: scripts/slurm/start bringing node2 back


def _step_daemon(pid: int) -> int:
    """The slurmstepd that started rank `pid` (its parent): a power cut takes it too, so that srun learns of the
    node's end from Slurm, not from its step daemon."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert Path(f"/proc/{ppid}/comm").read_text().strip() == "slurmstepd", ppid
    return ppid


def _freeze_between_filesystem_saves(run_root: Path, pid: int) -> int:
    """SIGSTOPs rank 0 (`pid`) at a moment when the newest RAM step the ledger says committed, R, is 3 to 20 steps
    past a filesystem save (else lets it run a little and tries again); returns R. Stopped, rank 0 commits nothing
    and trains at most to step R + 2 (the RAM save of R + 1 in flight), so no filesystem save of a step above
    R - 3 can exist, now or later (one in flight may still commit, of an older step)."""
    deadline = time.monotonic() + STEP_S
    while True:
        assert time.monotonic() < deadline, "rank 0 was never caught between two filesystem saves"
        os.kill(pid, signal.SIGSTOP)
        try:
            ram = [e["step"] for e in events(run_root, "checkpoint_saved") if e["tier"] == "memory"]
        except BaseException:
            os.kill(pid, signal.SIGCONT)
            raise
        if ram and ram[-1] > FS_EVERY and 3 <= ram[-1] % FS_EVERY <= 20:
            return ram[-1]
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)


def _ranks_steps(job: str) -> list[tuple[str, str]]:
    """(step id, NodeList) of the job's rank steps, as sacct records them."""
    out = subprocess.run(
        ["sacct", "-n", "-P", "-j", job, "-o", "JobID,JobName,NodeList"], capture_output=True, text=True, check=True
    ).stdout.split()
    return [(f[0], f[2]) for f in (line.split("|") for line in out) if f[1] == "meshjob-ranks"]


def test_a_node_taken_down_is_swapped_for_the_spare_inside_the_same_allocation_and_finishes_bitwise(
    run_root: Path, short_reference, tmp_path
) -> None:
    job = submit(run_root, "launcher.spare_nodes=1", *RAM, steps=SHORT_STEPS)
    wait_for_step(run_root, SHORT_FAULT_STEP)  # past the save at step 25
    (start,) = [e for e in events(run_root, "attempt_start") if e["attempt"] == f"{job}.0"]
    assert (start["step_nodes"], start["spares"]) == (["node1", "node2"], ["node3"]), start
    rank0, rank1 = rank_pid(run_root, f"{job}.0", 0), rank_pid(run_root, f"{job}.0", 1)
    ram_root = memory_root("/dev/shm", run_id(run_root))  # on each node's /dev/shm, in a folder named after the node
    try:
        stepd = None if nodes_are_hosts() else _step_daemon(rank1)  # on a host of its own, node2's end takes it
        frozen_at = _freeze_between_filesystem_saves(run_root, rank0)
        try:
            take_node_down("node2", [rank1])
            if stepd is not None:  # the nodes share this host: its step daemon and its RAM go by hand
                os.kill(stepd, signal.SIGKILL)
                shutil.rmtree(ram_root / "node2")
        finally:
            os.kill(rank0, signal.SIGCONT)
        recs = wait_job_done(job, timeout=SWAP_DONE_S)
    finally:
        bring_nodes_back()
    # One allocation from start to end: no REQUEUED record, no restart of the job; sacct records Slurm taking node2
    # out of the job (--no-kill) as a resize, before the ranks start again on node1 and the spare.
    assert [r["State"].split()[0] for r in recs] == ["RESIZING", "COMPLETED"], recs
    assert recs[-1]["NodeList"] == "node[1,3]", recs
    assert scontrol_job(job)["Restarts"] == "0"
    (d,) = events(run_root, "decision")
    assert (d["attempt"], d["action"]) == (f"{job}.0", "restart") and "node node2 replaced by spare node node3" in d[
        "reason"
    ], d
    (s,) = events(run_root, "spare_swap")
    assert s["swapped"] == {"node2": "node3"} and s["excluded"] == ["node2"], s
    assert [q["node"] for q in json.loads((run_root / "quarantine.json").read_text())] == ["node2"]
    (after,) = [e for e in events(run_root, "attempt_start") if e["attempt"] == f"{job}.0.1"]
    assert (after["step_nodes"], after["spares"]) == (["node1", "node3"], []), after
    assert [n for _, n in _ranks_steps(job)] == ["node[1-2]", "node[1,3]"], _ranks_steps(job)
    # The replaced rank 1 has no copy on the spare: it reads the copy of its state that node1 holds (sent by rank 0),
    # rank 0 its own, at the newest RAM step the ranks agreed on (or the one after it, when both its copies on node1
    # committed before the kill cut its agreement short), newer than every filesystem step committed before the load
    # (an async filesystem save may commit after the freeze: the ledger says which existed).
    ledger = events(run_root)
    [(i, load)] = [
        (i, e) for i, e in enumerate(ledger) if e["kind"] == "checkpoint_loaded" and e["attempt"] == f"{job}.0.1"
    ]
    saved = {
        t: [e["step"] for e in ledger[:i] if e["kind"] == "checkpoint_saved" and e["tier"] == t]
        for t in ("memory", "filesystem")
    }
    assert (load["tier"], load.get("partner_ranks")) == ("partner", [1]), load
    assert load["step"] in (max(saved["memory"]), max(saved["memory"]) + 1), (load, saved["memory"][-3:])
    assert load["step"] >= frozen_at > max(saved["filesystem"], default=0) + 2, (frozen_at, saved["filesystem"])
    out = status(run_root)
    assert f"spare swap after attempt {job}.0: node2 -> node3" in out
    resumed = {
        f[1]: f[5] for f in map(str.split, out.splitlines()) if len(f) > 5 and f[1] in (f"{job}.0", f"{job}.0.1")
    }
    assert resumed == {f"{job}.0": "-", f"{job}.0.1": "peer"}, out  # the `from` column: where each attempt resumed
    assert_bitwise_equal_to_reference(run_root, short_reference, tmp_path)
    # the finished run's copies are gone, on the spare and the surviving node alike
    assert [n for n in ("node1", "node3") if node_path(n, str(ram_root)).exists()] == []
