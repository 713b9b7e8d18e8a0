"""The slurm tier of one run per directory (tests/unit/test_sweep_run_dirs.py, test_rundir.py): every point of a sweep trains in its own run directory however long composing
the points takes, and a second job pointed at a live run directory is refused on the login node."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from jobs.events import read_events
from jobs.launch.rundir import read_owner
from tests.slurm.slurm_helpers import cli, submitted_job_id, wait_ended, wait_final

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

TWO_RANKS = ["launcher=slurm", "launcher.nodes=1", "launcher.tasks_per_node=2"]


def test_sweep_composed_across_second_boundaries_trains_each_point_in_its_own_run_dir(run_root: Path) -> None:
    # 20 points on 2 ranks: tp1 and tp2 are submitted, tp3..tp20 pruned; all 20 are composed first (0.1-0.5 s
    # each), each resolving the default-style run.dir runs/.../${now:%Y%m%d-%H%M%S} anew.
    sweep = cli(
        "jobs.train",
        "-m",
        *TWO_RANKS,
        "mesh.pp=1",
        "mesh.dp_shard=-1",
        "train.steps=2",
        "mesh.tp=range(1,21)",
        f"run.dir={run_root}/${{now:%Y%m%d-%H%M%S}}",
        timeout=600,
    )
    assert sweep.returncode == 0, sweep.stdout[-3000:] + sweep.stderr[-3000:]
    array = submitted_job_id(sweep.stdout, r"20 points, 2 submitted as array job (\d+), 18 pruned")
    (sweep_dir,) = [d for d in run_root.iterdir()]  # one directory for the sweep, whatever the clock did
    table = [json.loads(l) for l in (sweep_dir / "sweep.jsonl").read_text().splitlines()]
    submitted = {t["idx"]: t for t in table if not t["pruned"]}
    assert {i: (t["run_dir"], t["job_id"]) for i, t in submitted.items()} == {
        0: (str(sweep_dir / "0"), f"{array}_0"),
        1: (str(sweep_dir / "1"), f"{array}_1"),
    }
    for i in (0, 1):
        assert f"{array}_{i}" in sweep.stdout and str(sweep_dir / str(i)) in sweep.stdout  # the printed table
    recs = wait_final(array, count=2, timeout=420)
    assert {r["State"] for r in recs} == {"COMPLETED"}, recs
    for i, mesh in ((0, "dp_shard2"), (1, "tp2")):
        events = sweep_dir / str(i) / "events.jsonl"
        starts = read_events(events, "train_start")
        assert {(e["attempt"], e["mesh"]) for e in starts} == {(f"{array}_{i}.0", mesh)}, starts
        assert {e["job_id"] for e in read_events(events, "attempt_start")} == {f"{array}_{i}"}
        metrics = (sweep_dir / str(i) / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(l)["step"] for l in metrics] == [1, 2]


def test_second_job_pointed_at_a_live_run_dir_with_another_mesh_is_refused_on_the_login_node(run_root: Path) -> None:
    dp2 = [*TWO_RANKS, "mesh=single", "mesh.dp_shard=2", "train.steps=100000", f"run.dir={run_root}"]
    first, second = submitted_job_id(cli("jobs.train", *dp2).stdout), None
    try:
        metrics, deadline = run_root / "metrics.jsonl", time.monotonic() + 300
        while not (metrics.exists() and metrics.read_text().strip()):  # training, heartbeats beating
            assert time.monotonic() < deadline, "the first job never trained"
            time.sleep(0.5)
        second = cli("jobs.train", *TWO_RANKS, "mesh=single", "mesh.tp=2", "train.steps=100000", f"run.dir={run_root}")
    finally:
        subprocess.run(["scancel", first], check=True)
        if second is not None and "submitted job" in second.stdout:  # (without the check) not left training
            subprocess.run(["scancel", submitted_job_id(second.stdout)], check=True)
    assert second.returncode == 2, second.stdout + second.stderr
    assert f"run.dir={run_root} is in use by another live job (Slurm job {first} is RUNNING" in second.stderr
    assert f"of attempt {first}.0 on node" in second.stderr  # and its ranks' heartbeats
    assert "submitted job" not in second.stdout
    # nothing of the second reached sbatch (on a cluster others share, jobs_submitted_between would see theirs)
    assert [p.name for p in (run_root / "slurm").iterdir() if not p.name.startswith(".")] == [first]
    assert read_owner(run_root)["last"]["job_id"] == first
    wait_final(first, timeout=120)
    wait_ended(first)  # sacct's CANCELLED comes while scontrol may still show COMPLETING: that is still live
    # The first job has ended: a start that changes what the run is, is still refused, naming the keys.
    third = cli("jobs.train", *dp2, "optim.lr=0.001")
    assert third.returncode == 2, third.stdout + third.stderr
    assert "in use" not in third.stderr and "optim.lr (0.01 -> 0.001)" in third.stderr
    assert {e["job_id"] for e in read_events(run_root / "events.jsonl", "attempt_start")} == {first}
