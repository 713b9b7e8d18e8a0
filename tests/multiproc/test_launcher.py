"""The local launcher: a rank that dies takes the others down, and the launcher says which and how."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from jobs import exitcodes
from tests.conftest import REPO, wait_for_step
from tests.multiproc._references import DP2_RUN, DP2_STEPS

pytestmark = pytest.mark.multiproc


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def test_a_killed_rank_is_restarted_in_place_and_the_run_matches_an_uninterrupted_one(
    tmp_path: Path, data_path: str, shared_run
) -> None:
    common = [*DP2_RUN, f"data.path={data_path}"]  # saves every 4 steps; the uninterrupted run is shared
    ref = shared_run(common)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.train", f"run.dir={run_dir}", *common],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(run_dir, 10, proc, timeout=240)  # step 8's save has begun, so step 4's is committed
        os.kill(json.loads((run_dir / "heartbeats/local.0/rank1.json").read_text())["pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == exitcodes.OK, err[-3000:]
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [(e["attempt"], e["action"]) for e in events if e["kind"] == "decision"] == [("local.0", "restart")]
    assert [(e["attempt"], e["cause"]) for e in events if e["kind"] == "attempt_end"] == [
        ("local.0", "dead_rank"),
        ("local.0.1", "completed"),
    ]
    (loaded,) = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert loaded["attempt"] == "local.0.1" and 4 <= loaded["step"] < DP2_STEPS
    assert _losses(run_dir) == _losses(ref.run_dir)  # every step's loss, bitwise


def test_a_killed_rank_past_the_restart_budget_stops_the_others_and_is_named(tmp_path: Path, data_path: str) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jobs.train",
            f"run.dir={run_dir}",
            "train.steps=10000",
            f"data.path={data_path}",
            "checkpoint.enabled=false",
            "mesh.pp=1",
            "mesh.tp=1",
            "mesh.dp_shard=4",
            "launcher.tasks_per_node=4",
            "failure.restarts_in_allocation=0",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(run_dir, 2, proc, timeout=240)
        ranks = _children(proc.pid)
        assert len(ranks) == 4, ranks
        victim = ranks[2]  # forked in rank order: rank 2
        assert json.loads((run_dir / "heartbeats/local.0/rank2.json").read_text())["pid"] == victim
        os.kill(victim, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == exitcodes.RANK_DIED, err[-3000:]
    assert f"rank 2 (pid {victim}) was killed by SIGKILL; stopping the other 3 ranks" in out + err
    for pid in ranks:  # every rank is gone (reaped by the launcher), none left training
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    # The death reaches the ledger once (so the MTBF counts it), reported by the launcher that saw it (rank -1)
    # or by a surviving rank whose collective failed first (CI once met that race); either names rank 2.
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    failures = [e for e in events if e["kind"] == "failure"]
    assert [(e["attempt"], e["cls"]) for e in failures] == [("local.0", "dead_rank")]
    assert failures[0]["reported_by"] in (-1, 0, 1, 3) and failures[0]["rank"] == failures[0]["reported_by"]
    assert [(s["rank"], s["pid"], s["state"]) for s in failures[0]["suspects"]] == [(2, victim, "dead")]
    assert [(e["attempt"], e["cause"], e["action"]) for e in events if e["kind"] == "attempt_end"] == [
        ("local.0", "dead_rank", "requeue")
    ]
    incident = json.loads((run_dir / "incidents/local.0/incident.json").read_text())
    assert (incident["cls"], incident["reported_by"], incident["suspects"][0]["pid"]) == (
        "dead_rank",
        failures[0]["reported_by"],
        victim,
    )


def test_a_nan_loss_with_no_checkpoint_to_roll_back_to_stops_the_run_with_exit_77(
    tmp_path: Path, data_path: str
) -> None:
    # A data file that does not match the model is refused on the launcher before any rank starts,
    # so break the run inside the ranks instead: a huge learning rate makes the second step non-finite.
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.train",
            f"run.dir={run_dir}",
            "train.steps=5",
            f"data.path={data_path}",
            "checkpoint.enabled=false",
            "mesh=single",
            "launcher.tasks_per_node=1",
            "optim.lr=1e30",
            "optim.grad_clip=0",
            "optim.warmup_steps=1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    # A non-finite loss (the grad norm at step 2) rolls back (jobs/failure/spike.py); with no checkpoint to go
    # back to, the run stops for good.
    assert p.returncode == exitcodes.DIVERGED, p.stderr[-3000:]
    assert "no committed checkpoint before step 2" in p.stdout + p.stderr and "Lower optim.lr" in p.stdout + p.stderr
    failures = [
        json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines() if json.loads(l)["kind"] == "failure"
    ]
    assert failures and failures[0]["cls"] == "non_finite_loss"


def test_the_ranks_meet_at_the_port_rank_0_bound_not_at_one_picked_before_it_or_left_by_an_earlier_run(
    tmp_path: Path, data_path: str
) -> None:
    # A port picked by the launcher (bind, close, hand it on) can be taken by another process (another run's
    # gloo connections) before rank 0 binds it: that attempt fails at rendezvous and costs a restart (seen in
    # CI: two restarts where one rank was killed). Rank 0 binds port 0 itself and publishes what it got. An
    # earlier run in this run dir named its first attempt the same; the launcher removes its published port
    # (closed now) before the ranks start (that part is a race this test does not force).
    run_dir = tmp_path / "run"
    stale = run_dir / "rendezvous" / "local.0.json"
    stale.parent.mkdir(parents=True)
    stale.write_text(json.dumps({"host": "127.0.0.1", "port": 1, "time": 0.0}))
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.train",
            f"run.dir={run_dir}",
            *DP2_RUN,
            "train.steps=2",
            "checkpoint.enabled=false",
            "failure.init_timeout_s=60",
            f"data.path={data_path}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert p.returncode == exitcodes.OK, p.stderr[-3000:]
    events = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    assert not [e for e in events if e["kind"] == "decision"]
    (met,) = [e["master"] for e in events if e["kind"] == "rendezvous"]
    published = json.loads(stale.read_text())
    assert met == f"127.0.0.1:{published['port']}" and published["port"] != 1
