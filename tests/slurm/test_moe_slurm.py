"""The Slurm tier for a folded MoE mesh: tiny_moe with ep2 folded over dp_shard4 on 2 nodes x 2 tasks (so the
experts' data-parallel pairs, edp2, span the two nodes) completes under Slurm with the local run's losses."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.slurm.slurm_helpers import REPO, cli, sacct, submitted_job_id, wait_final

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

MOE = ["model=tiny_moe", "mesh=single", "mesh.dp_shard=4", "mesh.ep=2", "train.steps=3"]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_moe_folded_over_dp_shard_on_two_nodes_completes_with_the_local_runs_losses(run_root: Path) -> None:
    slurm_dir, local_dir = run_root / "slurm-moe", run_root / "local-moe"
    sub = cli(
        "jobs.train", "launcher=slurm", "launcher.nodes=2", "launcher.tasks_per_node=2", *MOE, f"run.dir={slurm_dir}"
    )
    assert sub.returncode == 0, sub.stderr
    job = submitted_job_id(sub.stdout)
    # The local reference meanwhile: the same 4 ranks, forked on this machine.
    local = subprocess.Popen(
        [sys.executable, "-m", "jobs.train", *MOE, "launcher.tasks_per_node=4", f"run.dir={local_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    (rec,) = wait_final(job, timeout=900)  # other jobs may queue ahead of it on a shared cluster
    local_out = local.communicate(timeout=600)[0]
    assert local.returncode == 0, local_out[-3000:]
    assert (rec["State"], rec["ExitCode"], rec["NodeList"]) == ("COMPLETED", "0:0", "node[1-2]"), rec
    step = next(r for r in sacct(job, steps=True) if r["JobID"] == f"{job}.0")
    assert (step["State"], step["NNodes"], step["NTasks"]) == ("COMPLETED", "2", "4"), step
    logs = {}
    for log in sorted((slurm_dir / "slurm" / job).glob(f"{job}_*_log.out")):
        text = log.read_text()
        m = re.search(r"rank (\d+)/4 node (\S+)", text)
        assert m, log
        logs[int(m.group(1))] = (m.group(2), text)
    assert {r: node for r, (node, _) in logs.items()} == {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    # Rank 0 says how the MoE mesh folds over the attention mesh's ranks: ep pairs in a node, edp across.
    assert "meshes: attention dp_shard4 | MoE edp2 * ep2 (folded over the same 4 ranks)" in logs[0][1]
    assert len(_losses(slurm_dir)) == 3
    assert _losses(slurm_dir) == _losses(local_dir)
