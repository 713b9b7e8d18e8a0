"""Hot spares (launcher.spare_nodes) against a stand-in Slurm: which nodes run the ranks, a failed node swapped for a
spare inside the allocation (the decider's ledger records, the supervisor's next srun), spares spent -> the requeue
without the node as before, and what a submission and a rendered script ask Slurm for."""

from __future__ import annotations

import json
import signal
import stat
import sys
from pathlib import Path

import pytest

from jobs import exitcodes
from jobs.config import FailureConfig, compose
from jobs.events import EventLog, read_events
from jobs.failure import quarantine
from jobs.failure.incident import Incident
from jobs.failure.policy import Restart, decide
from jobs.failure.respond import AttemptContext, conclude
from jobs.failure.spares import place, spares_of, swap
from jobs.launch import supervise
from jobs.sbatch import render_for
from jobs.validate import validate
from tests.unit.test_requeue_path import _job, _verbs, slurm  # noqa: F401 - slurm: the stand-in fixture

NODES = ["node1", "node2", "node3"]


def test_the_ranks_run_on_the_first_nodes_off_quarantine_and_the_rest_wait_as_spares() -> None:
    assert place(NODES, excluded=set(), nodes=2) == (["node1", "node2"], ["node3"])
    assert place(NODES, excluded={"node2", "node9"}, nodes=2) == (["node1", "node3"], [])
    assert place(NODES, excluded={"node1"}, nodes=2) == (["node2", "node3"], [])
    assert place(NODES, excluded={"node1", "node3"}, nodes=2) == (["node2"], [])  # too few: the caller requeues


def test_a_failed_node_is_paired_with_the_first_spare_and_none_when_spares_run_out() -> None:
    assert swap(["node2"], ["node3", "node4"]) == {"node2": "node3"}
    assert swap(["node2", "node1"], ["node3", "node4"]) == {"node2": "node3", "node1": "node4"}
    assert swap(["node2", "node1"], ["node3"]) is None
    assert swap(["node2"], []) is None and swap(["node2"], None) is None  # spent; no spares configured


def test_the_spares_are_read_from_the_attempts_start_record() -> None:
    events = [
        {"kind": "attempt_start", "attempt": "9.0", "step_nodes": ["node1", "node2"], "spares": ["node3"]},
        {"kind": "attempt_start", "attempt": "9.0.1", "step_nodes": ["node1", "node3"], "spares": []},
        {"kind": "attempt_start", "attempt": "10.0"},
    ]
    assert spares_of(events, "9.0") == ["node3"] and spares_of(events, "9.0.1") == []
    assert spares_of(events, "10.0") is None  # launcher.spare_nodes=0


def test_the_policy_restarts_inside_the_allocation_while_spares_cover_the_bad_nodes() -> None:
    cfg = FailureConfig()
    d = decide([], cause="dead_rank", cfg=cfg, restart_count=0, restart=Restart(True, 0, ["node2"], ["node3"]))
    assert d.action == "restart" and d.reason.endswith("inside the allocation; node node2 replaced by spare node node3")
    d = decide([], cause="dead_rank", cfg=cfg, restart_count=0, restart=Restart(True, 0, ["node2"], []))
    assert d.action == "requeue" and "suspect node node2: requeue without it, no spare node left" in d.reason, d
    d = decide([], cause="dead_rank", cfg=cfg, restart_count=0, restart=Restart(True, 0, ["node2"]))
    assert d.action == "requeue" and "suspect node node2: requeue without it)" in d.reason, d  # no spares: as before
    # Classes a plain restart does not cure go back to the queue without a spare, and restart with one.
    assert decide([], cause="sdc", cfg=cfg, restart_count=0, restart=None).action == "requeue"
    assert (
        decide([], cause="sdc", cfg=cfg, restart_count=0, restart=Restart(True, 0, ["node2"], ["node3"])).action
        == "restart"
    )
    spent = FailureConfig(restarts_in_allocation=1)
    d = decide([], cause="dead_rank", cfg=spent, restart_count=0, restart=Restart(True, 1, ["node2"], ["node3"]))
    assert d.action == "requeue" and "failure.restarts_in_allocation(1) spent" in d.reason, d


def _ctx(run_dir: Path, *, spares: list[str] | None) -> AttemptContext:
    """Attempt 9.0 on node1,node2 of job 9 (node[1-3]), as its supervisor recorded it, past a checkpoint."""
    events = EventLog(run_dir / "events.jsonl", rank=0, restart=0, attempt="9.0")
    placed = {} if spares is None else {"step_nodes": ["node1", "node2"], "spares": spares}
    events.emit("attempt_start", job_id="9", nodes=NODES, **placed)
    events.emit("train_start", step=0)
    events.emit("checkpoint_saved", step=10)
    return AttemptContext(
        run_dir=str(run_dir),
        attempt="9.0",
        rank=0,
        world_size=2,
        job_id="9",
        restart_count=0,
        cfg=FailureConfig(heartbeat_s=0.05, node_probe_timeout_s=5),
        events=events,
        supervised=True,
        nodes_needed=2 + len(spares or []),
    )


def _incident(cls: str) -> Incident:
    return Incident(cls, "9.0", 0, f"a {cls} incident", [{"rank": 1, "node": "node2", "pid": 77, "state": "dead"}])


def test_a_dead_node_is_quarantined_and_swapped_for_the_spare_without_a_requeue(tmp_path: Path, slurm: Path) -> None:
    # node2 does not answer (the stand-in srun fails every probe step); node3 waits idle.
    assert (
        conclude(_ctx(tmp_path, spares=["node3"]), cause="dead_rank", step=12, incident=_incident("dead_rank"))
        == exitcodes.REQUEUE
    )
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert d["action"] == "restart" and "node node2 replaced by spare node node3" in d["reason"], d
    (s,) = read_events(tmp_path / "events.jsonl", "spare_swap")
    assert s["swapped"] == {"node2": "node3"} and s["excluded"] == ["node2"] and s["attempt"] == "9.0"
    assert [e["node"] for e in quarantine.quarantined(tmp_path)] == ["node2"]
    assert "scontrol requeue" not in _verbs(slurm) and _verbs(slurm).count("srun") == 1  # one probe, no requeue
    assert json.loads((tmp_path / "incidents/9.0/decision.json").read_text())["action"] == "restart"


def test_with_the_spares_spent_a_dead_node_requeues_the_job_without_it(tmp_path: Path, slurm: Path) -> None:
    assert (
        conclude(_ctx(tmp_path, spares=[]), cause="dead_rank", step=12, incident=_incident("dead_rank"))
        == exitcodes.REQUEUE
    )
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert d["action"] == "requeue" and "no spare node left" in d["reason"] and d["excluded"] == ["node2"], d
    assert read_events(tmp_path / "events.jsonl", "spare_swap") == []
    assert _job(slurm)["restarts"] == 1 and _job(slurm)["exc"] == "node2"


def test_silent_data_corruption_swaps_its_node_for_a_spare_without_probing_it(tmp_path: Path, slurm: Path) -> None:
    assert (
        conclude(_ctx(tmp_path, spares=["node3"]), cause="sdc", step=12, incident=_incident("sdc")) == exitcodes.REQUEUE
    )
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert d["action"] == "restart" and d["excluded"] == ["node2"], d
    assert "srun" not in _verbs(slurm) and "scontrol requeue" not in _verbs(slurm)


# The ranks' step, twice: the first time its decider swaps node2 for the spare (quarantine, decision "restart"), as
# conclude does; the second time it finishes. Each call's arguments are kept.
_SRUN = """#!{python}
import json, os, sys, time
d = os.environ["FAKE_SLURM"]
os.makedirs(os.path.join(d, "steps"), exist_ok=True)
n = len(os.listdir(os.path.join(d, "steps")))
json.dump(sys.argv[1:], open(os.path.join(d, "steps", str(n)), "w"))
if n == 0:
    run = os.environ["RUN"]
    json.dump([{{"node": "node2", "reason": "x", "incident": "9.0", "time": time.time()}}], open(run + "/quarantine.json", "w"))
    os.makedirs(run + "/incidents/9.0", exist_ok=True)
    json.dump({{"action": "restart", "reason": "x", "exit_code": 75}}, open(run + "/incidents/9.0/decision.json", "w"))
    sys.exit(75)
sys.exit(0)
"""


def test_the_supervisor_runs_the_ranks_on_launcher_nodes_and_restarts_them_on_the_spare(
    tmp_path: Path, slurm: Path, monkeypatch
) -> None:
    (slurm / "srun").write_text(_SRUN.format(python=sys.executable))
    (slurm / "srun").chmod((slurm / "srun").stat().st_mode | stat.S_IXUSR)
    run = tmp_path / "run"
    for k, v in {
        "SLURM_JOB_ID": "9",
        "SLURM_JOB_NODELIST": "node[1-3]",
        "SLURM_RESTART_COUNT": "0",
        "RUN": str(run),
    }.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}  # supervise() installs its own
    cfg = compose(
        [
            "launcher=slurm",
            f"run.dir={run}",
            "launcher.nodes=2",
            "launcher.spare_nodes=1",
            "launcher.tasks_per_node=1",
            "failure.heartbeat_s=0.05",
        ]
    )
    try:
        assert supervise.supervise(cfg, logs=("o", "e")) == exitcodes.OK
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    steps = [json.loads((slurm / "steps" / str(i)).read_text()) for i in range(2)]
    for argv, nodelist in zip(steps, ("node1,node2", "node1,node3")):
        assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1", f"--nodelist={nodelist}", "--overlap"} <= set(argv), (
            argv
        )
    starts = read_events(run / "events.jsonl", "attempt_start")
    assert [(e["attempt"], e["step_nodes"], e["spares"]) for e in starts] == [
        ("9.0", ["node1", "node2"], ["node3"]),
        ("9.0.1", ["node1", "node3"], []),
    ]
    assert "scontrol requeue" not in _verbs(slurm)  # the quarantined node2 in the allocation is no cause to requeue


def test_a_submission_asks_for_the_spares_too_and_keeps_the_allocation_when_a_node_fails(tmp_path: Path) -> None:
    from jobs.launch.slurm import make_executor

    cfg = compose(["launcher=slurm", f"run.dir={tmp_path}", "launcher.nodes=2", "launcher.spare_nodes=1"])
    p = make_executor(cfg, tmp_path / "slurm").parameters
    assert p["nodes"] == 3 and p["additional_parameters"] == {"requeue": True, "no_kill": True}, p
    p = make_executor(compose(["launcher=slurm", f"run.dir={tmp_path}"]), tmp_path / "slurm").parameters
    assert p["nodes"] == 2 and p["additional_parameters"] == {"requeue": True}, p


def test_spare_nodes_below_0_or_outside_slurm_are_refused_naming_the_override() -> None:
    for overrides in (["launcher=slurm", "launcher.spare_nodes=-1"], ["launcher=local", "launcher.spare_nodes=1"]):
        with pytest.raises(
            ValueError, match=r"launcher\.spare_nodes\((-1|1)\) must be >= 0.*set launcher.spare_nodes=0"
        ):
            validate(compose(overrides))


def test_a_rendered_script_holds_the_spares_with_no_kill_and_the_torchrun_style_refuses_them() -> None:
    overrides = ["launcher=slurm", "launcher.spare_nodes=1", "run.dir=/work/meshjob/runs/tiny-2x4"]
    text = render_for(compose(overrides), overrides=overrides, python="python", workdir="/opt/meshjob")
    assert "#SBATCH --nodes=3 " in text and "\n#SBATCH --no-kill " in text and "launcher.spare_nodes=1" in text
    with pytest.raises(ValueError, match="launcher.spare_nodes.1. with sbatch.style=torchrun"):
        render_for(compose(overrides), overrides=overrides, style="torchrun", python="python", workdir="/opt/meshjob")
