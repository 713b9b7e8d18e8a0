"""Hot spares on the local cluster (3 nodes): a 2-node job holding one spare loses a node, taken down from outside, and
goes on inside the same allocation on the other node and the spare, bitwise equal to the uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.chaos.chaos_helpers import (STEP_S, assert_bitwise_equal_to_reference, bound_s, bring_nodes_back, events,
                                       rank_pid, status, submit, take_node_down, wait_for_step, wait_job_done)
from tests.slurm.slurm_helpers import scontrol_job

SWAP_DONE_S = 600  # Slurm declares the node down SlurmdTimeout (30 s) after its last answer; the rest is training

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster"),
              pytest.mark.timeout(bound_s(STEP_S, SWAP_DONE_S, 300))]  # 300: scripts/slurm/start bringing node2 back


def _step_daemon(pid: int) -> int:
    """The slurmstepd that started rank `pid` (its parent): a power cut takes it too, so that srun learns of the
    node's end from Slurm, not from its step daemon."""
    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert Path(f"/proc/{ppid}/comm").read_text().strip() == "slurmstepd", ppid
    return ppid


def _ranks_steps(job: str) -> list[tuple[str, str]]:
    """(step id, NodeList) of the job's rank steps, as sacct records them."""
    out = subprocess.run(["sacct", "-n", "-P", "-j", job, "-o", "JobID,JobName,NodeList"], capture_output=True,
                         text=True, check=True).stdout.split()
    return [(f[0], f[2]) for f in (line.split("|") for line in out) if f[1] == "meshjob-ranks"]


def test_a_node_taken_down_is_swapped_for_the_spare_inside_the_same_allocation_and_finishes_bitwise(
        run_root: Path, reference, tmp_path) -> None:
    job = submit(run_root, "launcher.spare_nodes=1")
    wait_for_step(run_root, 30)  # past the save at step 25
    (start,) = [e for e in events(run_root, "attempt_start") if e["attempt"] == f"{job}.0"]
    assert (start["step_nodes"], start["spares"]) == (["node1", "node2"], ["node3"]), start
    rank1 = rank_pid(run_root, f"{job}.0", 1)
    try:
        stepd = _step_daemon(rank1)
        take_node_down("node2", [rank1])
        os.kill(stepd, signal.SIGKILL)
        recs = wait_job_done(job, timeout=SWAP_DONE_S)
    finally:
        bring_nodes_back()
    # One allocation from start to end: no REQUEUED record, no restart of the job; sacct records Slurm taking node2
    # out of the job (--no-kill) as a resize, before the ranks start again on node1 and the spare.
    assert [r["State"].split()[0] for r in recs] == ["RESIZING", "COMPLETED"], recs
    assert recs[-1]["NodeList"] == "node[1,3]", recs
    assert scontrol_job(job)["Restarts"] == "0"
    (d,) = events(run_root, "decision")
    assert (d["attempt"], d["action"]) == (f"{job}.0", "restart") and "node node2 replaced by spare node node3" in d["reason"], d
    (s,) = events(run_root, "spare_swap")
    assert s["swapped"] == {"node2": "node3"} and s["excluded"] == ["node2"], s
    assert [q["node"] for q in json.loads((run_root / "quarantine.json").read_text())] == ["node2"]
    (after,) = [e for e in events(run_root, "attempt_start") if e["attempt"] == f"{job}.0.1"]
    assert (after["step_nodes"], after["spares"]) == (["node1", "node3"], []), after
    assert [n for _, n in _ranks_steps(job)] == ["node[1-2]", "node[1,3]"], _ranks_steps(job)
    # The replaced rank has no RAM copy on the spare (and this run keeps none): the filesystem tier serves the restart.
    loaded = [e for e in events(run_root, "checkpoint_loaded") if e["attempt"] == f"{job}.0.1"]
    assert {e["tier"] for e in loaded} == {"filesystem"} and loaded[0]["step"] >= 25, loaded
    assert f"spare swap after attempt {job}.0: node2 -> node3" in status(run_root)
    assert_bitwise_equal_to_reference(run_root, reference, tmp_path)
