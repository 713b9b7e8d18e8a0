"""Restart inside the allocation and the quarantine: the decision, the list, and a requeue that honours it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs import exitcodes
from jobs.config import FailureConfig, compose
from jobs.events import EventLog, read_events
from jobs.failure import quarantine, respond
from jobs.failure.incident import Incident
from jobs.failure.policy import Restart, decide
from jobs.failure.respond import AttemptContext, conclude
from jobs.launch.env import DistEnv, attempt_name

CFG = FailureConfig(restarts_in_allocation=2, max_requeues=5)
HEALTHY = Restart(supervised=True, used=0, bad_nodes=[])


def _progress(n: int = 1) -> list[dict]:
    """n attempts that each committed a checkpoint (the no-progress breaker stays quiet)."""
    out = []
    for i in range(n):
        a = f"j.0.{i}" if i else "j.0"
        out += [
            {"kind": "attempt_start", "attempt": a, "time": i},
            {"kind": "train_start", "attempt": a, "step": 10 * i},
            {"kind": "checkpoint_saved", "attempt": a, "step": 10 * i + 5},
        ]
    return out


@pytest.mark.parametrize(
    ("cause", "restart", "action"),
    [
        ("dead_rank", HEALTHY, "restart"),
        ("hung_rank", HEALTHY, "restart"),
        ("dead_rank", Restart(True, 0, ["node2"]), "requeue"),  # its node does not answer
        ("dead_rank", Restart(True, 2, []), "requeue"),  # failure.restarts_in_allocation(2) spent
        ("dead_rank", Restart(False, 0, []), "requeue"),  # nobody would start the ranks again
        ("SIGUSR2", HEALTHY, "requeue"),  # preemption / time limit: the allocation is going away
        ("out_of_memory", HEALTHY, "stop"),  # a restart cures nothing
    ],
)
def test_a_dead_or_hung_rank_on_a_node_that_answers_restarts_inside_the_allocation(cause, restart, action) -> None:
    d = decide(_progress(), cause=cause, cfg=CFG, restart_count=0, restart=restart)
    assert d.action == action, d
    if action == "restart":
        assert d.exit_code == exitcodes.REQUEUE and "restart 1 of failure.restarts_in_allocation(2)" in d.reason


def test_restarts_that_commit_nothing_trip_the_no_progress_breaker() -> None:
    stuck = [{"kind": "attempt_start", "attempt": a, "time": i} for i, a in enumerate(["j.0", "j.0.1", "j.0.2"])]
    d = decide(stuck, cause="dead_rank", cfg=CFG, restart_count=0, restart=Restart(True, 1, []))
    assert d.action == "stop" and "committed no new checkpoint" in d.reason


def test_attempt_names_count_restarts_inside_the_allocation() -> None:
    assert [attempt_name("7", 1, n) for n in (0, 1, 2)] == ["7.1", "7.1.1", "7.1.2"]
    env = DistEnv.from_environ(
        {
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_JOB_ID": "7",
            "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_RESTART_COUNT": "1",
            "MESHJOB_RESTART_IN_ALLOCATION": "2",
        }
    )
    assert env.attempt == "7.1.2"


def test_the_quarantine_list_only_grows_and_names_each_node_once(tmp_path: Path) -> None:
    quarantine.add_to_quarantine(tmp_path, ["node3"], reason="suspect of a dead_rank incident", incident="9.0")
    entries = quarantine.add_to_quarantine(tmp_path, ["node3", "node1"], reason="x", incident="9.1")
    assert [(e["node"], e["incident"]) for e in entries] == [("node3", "9.0"), ("node1", "9.1")]
    assert json.loads((tmp_path / "quarantine.json").read_text()) == entries == quarantine.quarantined(tmp_path)


def _ctx(tmp_path: Path, **kw) -> AttemptContext:
    events = EventLog(tmp_path / "events.jsonl", rank=0, restart=0, attempt="9.0")
    for e in _progress():
        events.emit(e["kind"], **{k: v for k, v in e.items() if k not in ("kind", "attempt", "time")})
    return AttemptContext(
        run_dir=str(tmp_path),
        attempt="9.0",
        rank=0,
        world_size=2,
        job_id="9",
        restart_count=0,
        cfg=CFG,
        events=events,
        supervised=True,
        nodes_needed=2,
        **kw,
    )


def _dead(node: str) -> Incident:
    return Incident("dead_rank", "9.0", 0, "rank 1 died", [{"rank": 1, "node": node, "pid": 5, "state": "dead"}])


@pytest.fixture
def slurm(monkeypatch):
    """What the decider asks Slurm, answered here (the real calls are exercised by the chaos tier)."""
    calls: dict[str, list] = {"requeue_excluding": [], "requeue": []}
    monkeypatch.setattr(respond, "slurm_intent", lambda job, restart_count: None)
    monkeypatch.setattr(
        respond, "requeue_excluding", lambda job, nodes: calls["requeue_excluding"].append(nodes) or (True, "")
    )
    monkeypatch.setattr(respond, "requeue_job", lambda job: calls["requeue"].append(job) or (True, ""))
    monkeypatch.setattr(
        respond,
        "usable_nodes",
        lambda partition, excluded: [n for n in ("node1", "node2", "node3") if n not in excluded],
    )
    return calls


def _probes(answers):
    """A stand-in for `quarantine.probe_nodes`: each node answers or is silent as `answers(node)` says."""
    return lambda job, nodes, timeout_s: {n: ("answers", "ok") if answers(n) else ("silent", "rc 1") for n in nodes}


def test_a_dead_rank_whose_node_does_not_answer_is_quarantined_and_excluded_from_the_requeue(
    tmp_path: Path, slurm, monkeypatch
) -> None:
    monkeypatch.setattr(respond, "probe_nodes", _probes(lambda node: node != "node2"))
    assert conclude(_ctx(tmp_path), cause="dead_rank", step=12, incident=_dead("node2")) == exitcodes.REQUEUE
    assert [e["node"] for e in quarantine.quarantined(tmp_path)] == ["node2"]
    assert slurm == {"requeue_excluding": [["node2"]], "requeue": []}
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert d["action"] == "requeue" and d["excluded"] == ["node2"] and "suspect node node2" in d["cause"] + d["reason"]


def test_a_dead_rank_whose_node_answers_restarts_and_quarantines_nothing(tmp_path: Path, slurm, monkeypatch) -> None:
    probed = []
    monkeypatch.setattr(respond, "probe_nodes", _probes(lambda node: probed.append(node) or True))
    assert conclude(_ctx(tmp_path), cause="dead_rank", step=12, incident=_dead("node2")) == exitcodes.REQUEUE
    assert probed == ["node2"] and quarantine.quarantined(tmp_path) == []
    assert slurm == {"requeue_excluding": [], "requeue": []}  # the supervisor starts the ranks again
    assert json.loads((tmp_path / "incidents/9.0/decision.json").read_text())["action"] == "restart"


def test_a_requeue_honours_the_quarantine_of_earlier_incidents(tmp_path: Path, slurm) -> None:
    quarantine.add_to_quarantine(tmp_path, ["node3"], reason="earlier", incident="9.0")
    assert conclude(_ctx(tmp_path), cause="SIGUSR2", step=12) == exitcodes.REQUEUE
    assert slurm["requeue_excluding"] == [["node3"]]


def test_when_the_quarantine_leaves_too_few_nodes_the_job_stops_and_says_why(
    tmp_path: Path, slurm, monkeypatch
) -> None:
    monkeypatch.setattr(respond, "probe_nodes", _probes(lambda node: False))
    quarantine.add_to_quarantine(tmp_path, ["node3"], reason="earlier", incident="8.0")
    assert conclude(_ctx(tmp_path), cause="dead_rank", step=12, incident=_dead("node2")) == exitcodes.STOPPED
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert d["action"] == "stop" and "leaves 1 usable node(s)" in d["reason"] and "the job needs 2" in d["reason"]
    assert slurm == {"requeue_excluding": [], "requeue": []}  # nothing waits forever in the queue


def test_a_later_submission_of_the_run_excludes_its_quarantine(tmp_path: Path) -> None:
    from jobs.launch.slurm import make_executor

    quarantine.add_to_quarantine(tmp_path, ["node3"], reason="x", incident="1.0")
    cfg = compose(["launcher=slurm", f"run.dir={tmp_path}", "cluster.exclude=node9"])
    assert make_executor(cfg, tmp_path / "slurm").parameters["exclude"] == "node9,node3"


def test_usable_nodes_leaves_out_down_drained_and_unresponsive_ones(monkeypatch) -> None:
    import subprocess

    out = "node1 idle\nnode1 idle\nnode2 alloc\nnode3 down*\nnode4 drain\nnode5 idle*\nnode6 mix\n"
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=out))
    assert quarantine.usable_nodes("debug", {"node6"}) == ["node1", "node2"]


def test_under_torchrun_its_restarts_count_and_a_decision_other_than_restart_keeps_the_ranks_from_training(
    tmp_path: Path, monkeypatch
) -> None:
    from jobs.failure.policy import Decision, publish
    from jobs.launch import rank, slurm

    torch_env = {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29500",
        "SLURM_JOB_ID": "7",
        "SLURM_RESTART_COUNT": "1",
        "TORCHELASTIC_RUN_ID": "7",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "TORCHELASTIC_MAX_RESTARTS": "3",
    }
    env = DistEnv.from_environ(torch_env)
    assert env.attempt == "7.1.2"
    monkeypatch.setattr(rank.os, "environ", torch_env)
    assert rank.supervised()  # torchrun's agents start the ranks again: a "restart" decision is honoured
    cfg = compose([f"run.dir={tmp_path}"])
    assert slurm._ended_for_good(cfg, env) is None  # no decision published for 7.1.1
    publish(tmp_path, "7.1.1", Decision("restart", "dead_rank", 75, 0, 4, 0))
    assert slurm._ended_for_good(cfg, env) is None
    publish(tmp_path, "7.1.1", Decision("stop", "out_of_memory is not cured by a restart", 76, 0, 4, 0))
    assert slurm._ended_for_good(cfg, env) == 76  # torchrun restarts anyway; the ranks do not train again
