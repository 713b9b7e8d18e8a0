"""The supervisor against a stand-in Slurm: it decides for ranks whose failure path could not write (restart in the
allocation, or the decision printed when the ledger refuses it); its start-up requeue off a quarantined node spends
the requeue budget; a later submission leaves out quarantined nodes Slurm no longer knows."""

from __future__ import annotations

import errno
import signal
import stat
import sys
from pathlib import Path

import pytest

from jobs import exitcodes
from jobs.config import FailureConfig, compose
from jobs.events import EventLog, read_events
from jobs.failure import quarantine, respond
from jobs.failure.respond import AttemptContext
from jobs.launch import supervise
from tests.unit.test_requeue_path import _job, _verbs, slurm  # noqa: F401 - slurm: the stand-in fixture

# A step of two ranks: the first time, rank 0 ends 75 without any decision (srun's line, as on the local cluster);
# the next time, both finish.
_SRUN = """#!{python}
import os, sys
d = os.environ["FAKE_SLURM"]
n = len(os.listdir(os.path.join(d, "steps"))) if os.path.isdir(os.path.join(d, "steps")) else 0
os.makedirs(os.path.join(d, "steps"), exist_ok=True)
open(os.path.join(d, "steps", str(n)), "w").close()
if n == 0:
    print("srun: error: node1: task 0: Exited with exit code 75", file=sys.stderr)
    sys.exit(75)
sys.exit(0)
"""


@pytest.fixture
def run_dir(tmp_path: Path, slurm: Path, monkeypatch) -> Path:  # noqa: F811 - the fixture imported above
    """Job 9 on node[1-2] in restart 0, its supervisor's signal handlers restored afterwards."""
    (slurm / "srun").write_text(_SRUN.format(python=sys.executable))
    (slurm / "srun").chmod((slurm / "srun").stat().st_mode | stat.S_IXUSR)
    for k, v in {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}  # supervise() installs its own
    yield tmp_path / "run"
    for s, h in handlers.items():
        signal.signal(s, h)


def _cfg(run_dir: Path, *overrides: str):
    return compose(
        [
            "launcher=slurm",
            f"run.dir={run_dir}",
            "launcher.nodes=2",
            "launcher.tasks_per_node=1",
            "failure.heartbeat_s=0.05",
            *overrides,
        ]
    )


def test_when_no_rank_could_write_a_decision_the_supervisor_restarts_the_ranks_itself(
    run_dir: Path, slurm: Path, caplog
) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "incidents").write_text("")  # not a folder: no claim, incident or decision can be written there
    # Before: the step ended without a claim or a decision and the supervisor returned 75 (the job ended FAILED).
    assert supervise.supervise(_cfg(run_dir), logs=("o", "e")) == exitcodes.OK
    ev = read_events(run_dir / "events.jsonl")
    assert [e["attempt"] for e in ev if e["kind"] == "attempt_start"] == ["9.0", "9.0.1"]
    (failure,) = [e for e in ev if e["kind"] == "failure"]
    assert failure["cls"] == "dead_rank" and failure["reported_by"] == -1 and failure["suspects"] == []
    assert failure["summary"].startswith("srun: error: node1: task 0: Exited with exit code 75, and no rank")
    (d,) = [e for e in ev if e["kind"] == "decision"]
    assert (d["attempt"], d["action"], d["reason"]) == (
        "9.0",
        "restart",
        "dead_rank: restart 1 of failure.restarts_in_allocation(3) inside the allocation",
    )
    assert "decision of attempt 9.0 not published" in caplog.text
    assert "scontrol requeue" not in _verbs(slurm)


def test_a_decision_the_ledger_refuses_is_printed_to_the_job_log_and_still_acted_on(
    tmp_path: Path, slurm: Path, monkeypatch, caplog
) -> None:
    events = EventLog(tmp_path / "events.jsonl", rank=-1, restart=0, attempt="9.0")
    events.emit("attempt_start", job_id="9")

    def full(self, kind, **fields):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(EventLog, "emit", full)
    ctx = AttemptContext(
        run_dir=str(tmp_path),
        attempt="9.0",
        rank=-1,
        world_size=2,
        job_id="9",
        restart_count=0,
        cfg=FailureConfig(heartbeat_s=0.05, restarts_in_allocation=0, max_requeues=2),
        events=events,
        supervised=True,
    )
    d = respond.decide_for_silent_attempt(ctx, step_code=75, why="srun: error: node2: task 1: Killed")
    assert d is not None and (d["action"], d["exit_code"]) == ("requeue", exitcodes.REQUEUE), d
    assert _job(slurm)["restarts"] == 1  # acted on: Slurm requeued the job
    err = caplog.text
    assert err.count("not written ([Errno 28] No space left on device)") == 4  # failure, decision, attempt_end, requeue
    assert '"kind": "decision", "attempt": "9.0", "cause": "dead_rank", "action": "requeue"' in err
    assert respond.decide_for_silent_attempt(ctx, step_code=75, why="again") is None  # claimed: decided once


@pytest.mark.parametrize(
    ("restart", "action", "code"), [(1, "requeue", exitcodes.REQUEUE), (2, "stop", exitcodes.STOPPED)]
)
def test_the_start_up_requeue_off_a_quarantined_node_spends_the_requeue_budget(
    run_dir: Path, slurm: Path, monkeypatch, restart: int, action: str, code: int
) -> None:
    # Before: any number of allocations on a quarantined node (an exclusion that never took) were requeued.
    monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
    run_dir.mkdir(parents=True)
    quarantine.add_to_quarantine(run_dir, ["node2"], reason="suspect", incident="9.0")
    assert supervise.supervise(_cfg(run_dir, "failure.max_requeues=2"), logs=("o", "e")) == code
    (d,) = read_events(run_dir / "events.jsonl", "decision")
    assert (d["attempt"], d["cause"], d["action"], d["requeues_used"]) == (
        f"9.{restart}",
        "quarantined_node",
        action,
        restart,
    )
    assert d["reason"].startswith(f"allocation includes quarantined node(s) node2 ({run_dir}/quarantine.json)")
    if action == "requeue":
        assert _job(slurm)["restarts"] == 1 and _job(slurm)["exc"] == "node2"
        assert d["reason"].endswith("requeue 2 of failure.max_requeues(2) without them")
    else:
        assert "requeue budget is spent: 2 requeues >= failure.max_requeues(2)" in d["reason"]
        assert "scontrol requeue" not in _verbs(slurm) and not (slurm / "steps").exists()


def test_a_later_submission_leaves_out_quarantined_nodes_slurm_no_longer_knows(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from jobs.launch import slurm as slurm_launch

    quarantine.add_to_quarantine(tmp_path, ["node3", "node99"], reason="x", incident="1.0")
    cfg = compose(["launcher=slurm", f"run.dir={tmp_path}", "cluster.exclude=node9"])
    # Before: --exclude=node9,node3,node99 and sbatch refused the job ("Invalid node name specified").
    monkeypatch.setattr(slurm_launch, "known_nodes", lambda: {"node1", "node2", "node3"})
    assert slurm_launch.make_executor(cfg, tmp_path / "slurm").parameters["exclude"] == "node9,node3"
    assert "quarantined node(s) node99" in capsys.readouterr().err
    monkeypatch.setattr(slurm_launch, "known_nodes", lambda: None)  # sinfo cannot say: all of them, as before
    assert slurm_launch.make_executor(cfg, tmp_path / "slurm").parameters["exclude"] == "node9,node3,node99"
