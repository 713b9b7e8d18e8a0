"""The Slurm tier: real jobs on the local cluster, submitted the way a user on a login node would, checked through sacct/scontrol."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slurm.slurm_helpers import (
    REPO,
    cli,
    jobs_submitted_between,
    next_job_id,
    sacct,
    scontrol_job,
    submitted_job_id,
    wait_final,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

STEPS = "train.steps=4"


def losses(run_dir: Path) -> list[float]:
    return [json.loads(l)["loss"] for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_tiny_job_on_two_nodes_by_four_tasks_completes_with_the_local_runs_losses(run_root: Path) -> None:
    slurm_dir, local_dir = run_root / "slurm-job", run_root / "local"
    sub = cli("jobs.train", "launcher=slurm", STEPS, f"run.dir={slurm_dir}")
    assert sub.returncode == 0, sub.stderr
    job = submitted_job_id(sub.stdout)
    info = scontrol_job(job)
    # A job still PENDING shows its node range ("2-2": at least 2, at most 2); a running one "2".
    assert (info["NumNodes"] in ("2", "2-2"), info["NumTasks"]) == (True, "8"), info
    # The local reference runs meanwhile: the same embedded default, 8 forked ranks, pp2*dp_shard2*tp2.
    local = subprocess.Popen(
        [sys.executable, "-m", "jobs.train", STEPS, f"run.dir={local_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    (rec,) = wait_final(job)
    assert local.wait(timeout=240) == 0, local.stdout.read()
    assert (rec["State"], rec["ExitCode"], rec["NodeList"]) == ("COMPLETED", "0:0", "node[1-2]"), rec
    step = next(r for r in sacct(job, steps=True) if r["JobID"] == f"{job}.0")
    assert (step["State"], step["NNodes"], step["NTasks"]) == ("COMPLETED", "2", "8"), step
    nodes = {}
    for log in sorted((slurm_dir / "slurm" / job).glob(f"{job}_*_log.out")):
        m = re.search(r"rank (\d+)/8 node (\S+)", log.read_text())
        assert m, log
        nodes[int(m.group(1))] = m.group(2)
    assert nodes == {r: "node1" if r < 4 else "node2" for r in range(8)}
    assert len(losses(slurm_dir)) == 4
    assert losses(slurm_dir) == losses(local_dir)


def test_mesh_shape_sweep_is_one_array_job_and_the_infeasible_point_is_pruned(run_root: Path) -> None:
    # 2 x 2 points on 2 ranks (2 nodes x 1 task): tp2 * pp2 = 4 ranks cannot work and must not be submitted.
    sweep = cli(
        "jobs.train",
        "-m",
        "launcher=slurm",
        "launcher.nodes=2",
        "launcher.tasks_per_node=1",
        "mesh.dp_shard=-1",
        "train.steps=3",
        "mesh.tp=1,2",
        "mesh.pp=1,2",
        f"run.dir={run_root}",
    )
    assert sweep.returncode == 0, sweep.stdout + sweep.stderr
    array = submitted_job_id(sweep.stdout, r"4 points, 3 submitted as array job (\d+), 1 pruned")
    # Returned once queued, not after the elements ran: slurmctld (squeue, no accounting lag; sacct may not
    # even hold the submission yet, which CI once met) still has all three, none finished.
    queued = subprocess.run(
        ["squeue", "-h", "-r", "-j", array, "-o", "%i %T"], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    states = dict(line.split() for line in queued if line.strip())
    assert sorted(states) == [f"{array}_{i}" for i in range(3)], states
    assert set(states.values()) <= {"PENDING", "CONFIGURING", "RUNNING"}, states
    table = [json.loads(l) for l in (run_root / "sweep.jsonl").read_text().splitlines()]
    (pruned,) = [t for t in table if t["pruned"]]
    assert pruned["idx"] == 3 and pruned["job_id"] is None
    assert "mesh.pp(2) * mesh.dp_replicate(1) * mesh.cp(1) * mesh.tp(2) = 4" in pruned["pruned"]
    assert re.search(r"3 +mesh.tp=2 mesh.pp=2 +mesh.dp_shard=-1 cannot be inferred", sweep.stdout), sweep.stdout
    recs = wait_final(array, count=3, timeout=300)
    assert sorted(r["JobID"] for r in recs) == [f"{array}_{i}" for i in range(3)]  # nothing for the pruned point
    assert {r["State"] for r in recs} == {"COMPLETED"}, recs
    submitted = [t for t in table if not t["pruned"]]
    assert len({t["run_dir"] for t in submitted}) == 3
    for t in submitted:
        d = Path(t["run_dir"])
        assert len(losses(d)) == 3, d
        assert (d / "slurm").resolve().name == t["job_id"]  # its own submitit logs


def test_script_rendered_by_jobs_sbatch_completes_under_plain_sbatch(run_root: Path) -> None:
    script = run_root / "job.sbatch"
    run_root.mkdir(parents=True)
    r = cli(
        "jobs.sbatch",
        f"sbatch.out={script}",
        "launcher=slurm",
        "launcher.nodes=2",
        "launcher.tasks_per_node=1",
        "mesh=single",
        "mesh.dp_shard=2",
        "train.steps=3",
        f"run.dir={run_root / 'run'}",
    )
    assert r.returncode == 0, r.stderr
    out = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, check=True, cwd="/tmp")
    job = out.stdout.strip()
    (rec,) = wait_final(job)
    assert (rec["State"], rec["ExitCode"], rec["NodeList"]) == ("COMPLETED", "0:0", "node[1-2]"), rec
    assert len(losses(run_root / "run")) == 3
    assert (run_root / "run" / "config.yaml").exists()
    logs = sorted(p.name for p in (run_root / "run" / "slurm").iterdir())
    assert logs == [
        f"{job}_batch.out",
        f"{job}_r0_rank0.err",
        f"{job}_r0_rank0.out",
        f"{job}_r0_rank1.err",
        f"{job}_r0_rank1.out",
    ]


@pytest.mark.parametrize(
    ("override", "message"),
    [("mesh.tp=3", "mesh.tp(3)"), ("run.dir=/tmp/elsewhere", "is not under cluster.run_root=runs")],
)
def test_wrong_config_is_refused_on_the_login_node_before_sbatch(run_root: Path, override: str, message: str) -> None:
    args = ["jobs.train", "launcher=slurm", STEPS, f"run.dir={run_root}", override]
    before = next_job_id()
    r = cli(*args)
    after = next_job_id()
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr and "submitted job" not in r.stdout
    assert jobs_submitted_between(before, after) == []  # nothing reached slurmctld in between
    assert not run_root.exists()


def test_usr2_saves_then_requeues_the_job_under_the_same_id_into_the_same_run_dir_while_wait_relays_it(
    run_root: Path,
) -> None:
    waiting = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jobs.train",
            "launcher=slurm",
            "launcher.wait=true",
            "launcher.nodes=2",
            "launcher.tasks_per_node=1",
            "mesh=single",
            "mesh.dp_shard=2",
            "train.steps=40",
            f"run.dir={run_root}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert waiting.stdout is not None
    head = ""
    while "submitted job" not in head:
        line = waiting.stdout.readline()
        assert line, head  # the CLI ended before submitting
        head += line
    job = submitted_job_id(head)
    metrics = run_root / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics.exists() and metrics.read_text().strip()):  # training, not still starting
        assert time.monotonic() < deadline, sacct(job)
        time.sleep(0.5)
    # What Slurm sends before a time limit or on preemption (to the steps, as submitit expects).
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    recs = wait_final(job, count=2, timeout=300)
    assert [r["State"] for r in recs] == ["REQUEUED", "COMPLETED"], recs
    assert scontrol_job(job)["Restarts"] == "1"
    log = (run_root / "slurm" / job / f"{job}_0_log.out").read_text()
    assert f"job {job} restart 0 rank 0/2" in log and f"job {job} restart 1 rank 0/2" in log  # appended
    assert f"run.dir {run_root}\n" in log.split("restart 1 rank 0/2", 1)[1]
    assert max(json.loads(l)["restart"] for l in metrics.read_text().splitlines()) == 1
    # The ranks saved at the step boundary after the signal, and the requeued run resumed from there.
    events = [json.loads(l) for l in (run_root / "events.jsonl").read_text().splitlines()]
    (stop_step,) = {e["step"] for e in events if e["kind"] == "stop_requested"}
    loaded = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert [(e["step"], e["restart"]) for e in loaded] == [(stop_step, 1)], loaded
    first_restart_step = min(
        json.loads(l)["step"] for l in metrics.read_text().splitlines() if json.loads(l)["restart"] == 1
    )
    assert first_restart_step == stop_step + 1  # no step trained twice, none lost
    # launcher.wait=true followed it all and exits with the job's outcome.
    out = waiting.communicate(timeout=60)[0]
    assert waiting.returncode == 0, out
    assert f"job {job}: RUNNING (restart 1)" in out and f"job {job}: COMPLETED" in out, out
    assert "step=40 " in out, out
    _assert_report_of_a_requeued_run(run_root, job)
    _assert_status_of_a_requeued_run(run_root, job, recs)


def _assert_status_of_a_requeued_run(run_dir: Path, job: str, recs: list[dict[str, str]]) -> None:
    """`python -m jobs.status` on the same run dir: its Slurm section lists both allocations of the job as sacct
    --duplicates keeps them (`recs`, read by this test), the requeued one first, the last one COMPLETED 0:0."""
    r = subprocess.run(
        [sys.executable, "-m", "jobs.status", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-3000:]
    section = r.stdout.split(f"slurm job {job} (sacct --duplicates):\n", 1)
    assert len(section) == 2, r.stdout
    rows = [dict(kv.split("=", 1) for kv in line.split()) for line in section[1].splitlines() if line.strip()]
    keys = ("JobID", "State", "ExitCode", "NodeList")
    assert [tuple(row[k] for k in keys) for row in rows] == [tuple(rec[k] for k in keys) for rec in recs], r.stdout
    assert [(row["JobID"], row["State"]) for row in rows] == [(job, "REQUEUED"), (job, "COMPLETED")], r.stdout
    assert rows[-1]["ExitCode"] == "0:0", r.stdout


def _assert_report_of_a_requeued_run(run_dir: Path, job: str) -> None:
    """`python -m jobs.report` on the requeued run dir, as a user would run it: both attempts and the cause of the
    requeue, the queue wait from sacct, the goodput next to the planned one, the plots and the HTML page."""
    from jobs.report import sacct_records
    from jobs.telemetry.run_report import collect

    r = subprocess.run(
        [sys.executable, "-m", "jobs.report", str(run_dir)], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert ": ended; step 40 of 40" in r.stdout, r.stdout
    assert "-> requeue x1" in r.stdout and "completed -> done x1" in r.stdout, r.stdout
    assert "expected (jobs.plan's costs, start-up and restarts included)" in r.stdout, r.stdout
    assert "sacct not available" not in r.stdout, r.stdout
    g = collect(run_dir, sacct_records=sacct_records(run_dir)).goodput
    assert g.steps_productive == 40 and g.steps_lost == 0  # saved at the boundary after USR2: nothing redone
    assert g.seconds["queue_wait"] > 0 and 0 < g.goodput < 1
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
    assert {p.name for p in (run_dir / "report").iterdir()} >= {"goodput.png", "loss.png", "report.html"}
    html = (run_dir / "report" / "report.html").read_text()
    assert f"{job}.0" in html and f"{job}.1" in html
