"""A run directory belongs to one run and one live job at a time: `RUN_DIR/owner.json`, the config keys a
resume may change, and live jobs seen through the owner record and the ranks' heartbeats."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from jobs.config import compose
from jobs.failure.heartbeat import Beat, beat_path, write_beat
from jobs.launch import rundir
from jobs.launch.rundir import check_run_dir, claim_run_dir, config_changes, flat_config, read_owner, record_job
from jobs.launch.slurm_state import JobState

BASE = ["mesh=single", "mesh.dp_shard=2", "launcher.tasks_per_node=2", "data.path=/tmp/meshjob-test-tokens.h5"]


def _cfg(run_dir: Path, *extra: str):
    return compose([*BASE, f"run.dir={run_dir}", *extra])


@pytest.fixture
def sleeper():
    """A live process of ours on this host, standing in for another job's launcher or rank."""
    p = subprocess.Popen(["sleep", "60"])
    yield p
    p.kill()
    p.wait()


def _pretend_owner(run_dir: Path, pid: int, **starter) -> None:
    """Makes the recorded last start `pid` on this host (what another launcher's claim would have written)."""
    owner = read_owner(run_dir)
    owner["last"].update({"pid": pid, "pid_start": rundir._pid_start(pid), "job_id": None, **starter})
    (run_dir / "owner.json").write_text(json.dumps(owner))


def _beat(run_dir: Path, attempt: str, *, pid: int, age_s: float = 0.0) -> None:
    now = time.time() - age_s
    write_beat(
        beat_path(run_dir, attempt, 0),
        Beat(
            rank=0, pid=pid, host=os.uname().nodename, node="node1", time=now, step=3, phase="train", progress_time=now
        ),
    )


def test_only_keys_outside_the_resumable_list_count_as_a_change(tmp_path: Path) -> None:
    old = flat_config(_cfg(tmp_path))
    resumed = flat_config(
        _cfg(
            tmp_path / "moved",
            "train.steps=99",
            "mesh.dp_shard=1",
            "mesh.tp=2",
            "launcher.tasks_per_node=2",
            "failure.max_requeues=3",
            "checkpoint.every_steps=5",
            "metrics.flush_every_s=1",
            "train.micro_batch=1",
            "cluster.time_min=5",
        )
    )
    assert config_changes(old, resumed) == []
    other = flat_config(_cfg(tmp_path, "optim.lr=0.001", "train.seed=7", "checkpoint.enabled=false"))
    assert config_changes(old, other) == [
        "checkpoint.enabled (True -> False)",
        "optim.lr (0.01 -> 0.001)",
        "train.seed (0 -> 7)",
    ]
    assert (
        config_changes(
            {**old, "model.gone": 1}, other | {"optim.lr": 0.01, "train.seed": 0, "checkpoint.enabled": True}
        )
        == []
    )  # schema moved on


def test_first_start_records_config_hash_and_job_and_a_resume_with_the_same_config_is_accepted(tmp_path: Path) -> None:
    from jobs.config import config_hash

    cfg = _cfg(tmp_path / "run")
    claim_run_dir(cfg, launcher="local")
    first = read_owner(tmp_path / "run")
    assert first["config_hash"] == config_hash(cfg) and first["starts"] == 1
    assert (first["first"]["launcher"], first["first"]["pid"], first["first"]["host"]) == (
        "local",
        os.getpid(),
        os.uname().nodename,
    )
    _pretend_owner(tmp_path / "run", 999_999_999)  # that launcher has ended
    claim_run_dir(_cfg(tmp_path / "run", "train.steps=80"), launcher="local")
    assert read_owner(tmp_path / "run")["starts"] == 2


def test_a_start_whose_config_changes_a_key_a_resume_may_not_change_is_refused_naming_the_keys(tmp_path: Path) -> None:
    run = tmp_path / "run"
    claim_run_dir(_cfg(run), launcher="local")
    _pretend_owner(run, 999_999_999)
    before = (run / "owner.json").read_text()
    with pytest.raises(ValueError) as e:
        claim_run_dir(_cfg(run, "optim.lr=0.001", "model.n_layers=3"), launcher="local")
    msg = str(e.value)
    assert f"run.dir={run} holds another run" in msg
    assert "model.n_layers (4 -> 3), optim.lr (0.01 -> 0.001)" in msg and "give this config its own run.dir" in msg
    assert (run / "owner.json").read_text() == before  # nothing recorded


def test_a_live_local_launcher_owning_the_dir_refuses_a_second_start_even_with_the_same_config(
    tmp_path: Path, sleeper: subprocess.Popen
) -> None:
    run = tmp_path / "run"
    claim_run_dir(_cfg(run), launcher="local")
    _pretend_owner(run, sleeper.pid)
    with pytest.raises(
        ValueError, match=f"in use by another live job \\(local launch by pid {sleeper.pid} .* is still running"
    ):
        check_run_dir(_cfg(run, "mesh.tp=2", "mesh.dp_shard=1"))
    sleeper.kill()
    sleeper.wait()
    check_run_dir(_cfg(run, "mesh.tp=2", "mesh.dp_shard=1"))  # ended: a resume on another mesh may start


def test_fresh_heartbeats_of_a_live_rank_refuse_a_start_and_stale_or_dead_ones_do_not(
    tmp_path: Path, sleeper: subprocess.Popen
) -> None:
    run = tmp_path / "run"
    cfg = _cfg(run)  # failure.heartbeat_s = 2: fresh means younger than 5 * 2 + 5 s
    _beat(run, "local.0", pid=sleeper.pid)
    with pytest.raises(ValueError, match=f"rank 0 of attempt local.0 on node1 \\(pid {sleeper.pid}, heartbeat 0 s ago"):
        check_run_dir(cfg)
    _beat(run, "local.0", pid=sleeper.pid, age_s=16)
    check_run_dir(cfg)
    _beat(run, "local.0", pid=999_999_999)  # fresh, but its process is gone (the launch just ended)
    check_run_dir(cfg)


def test_slurm_jobs_count_as_live_by_their_state_and_a_job_checking_its_own_dir_is_accepted(
    tmp_path: Path, sleeper: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = {"41_1": "RUNNING"}
    monkeypatch.setattr(rundir, "job_state", lambda job: JobState(job, states.get(job, "UNKNOWN")))
    run = tmp_path / "run"
    claim_run_dir(_cfg(run), launcher="slurm")
    record_job(run, "41_1")
    assert read_owner(run)["first"]["job_id"] == "41_1"
    _beat(run, "41_1.0", pid=sleeper.pid)
    with pytest.raises(ValueError, match="Slurm job 41_1 is RUNNING; rank 0 of attempt 41_1.0"):
        check_run_dir(_cfg(run))
    claim_run_dir(_cfg(run), launcher="slurm", job_id="41_1")  # its own requeue (a rendered script's batch step)
    states["41_1"] = "COMPLETED"
    _pretend_owner(run, 999_999_999, job_id="41_1")
    check_run_dir(_cfg(run))  # the job ended: its fresh beats are history
