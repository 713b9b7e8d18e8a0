"""The decision path is exception-safe: a hand-edited quarantine.json that is not what the code
writes is tolerated and reported, and anything that raises between the claim and the publish still requeues the job
and publishes a decision, for the ranks' decider, the supervisor's fallback, the guard and the local launcher."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from jobs import exitcodes
from jobs.config import FailureConfig
from jobs.events import read_events
from jobs.failure import policy, quarantine, respond
from jobs.failure.incident import Incident
from jobs.failure.respond import conclude
from tests.unit.test_requeue_path import _ctx, _job, _lost_decider, _verbs, slurm  # noqa: F401 - slurm: the fixture

_HINT = 'write it as a JSON list of objects, one per node, e.g. [{"node": "node3"'


@pytest.mark.parametrize(
    ("text", "nodes", "said"),
    [
        ('["node3"]', ["node3"], "bare node name(s) node3 taken as quarantined"),
        ("[{'node': 'node3'}", [], "cannot be read (Expecting property name"),
        ('{"node": "node3"}', [], "holds a dict, not a list"),
        ('[{"node": 3}, {"host": "node2"}, {"node": "node1"}, 7]', ["node1"], "entries without a node name left out"),
        ("", [], "cannot be read (Expecting value"),
    ],
)
def test_a_malformed_quarantine_file_is_read_as_far_as_it_can_be_and_reported_with_the_fix(
    tmp_path: Path, caplog, text: str, nodes: list[str], said: str
) -> None:
    (tmp_path / "quarantine.json").write_text(text)
    with caplog.at_level(logging.WARNING, logger="meshjob"):
        assert [e["node"] for e in quarantine.quarantined(tmp_path)] == nodes
    assert f"{tmp_path}/quarantine.json" in caplog.text and said in caplog.text and _HINT in caplog.text


def test_a_hand_written_list_of_names_requeues_the_job_excluding_them(tmp_path: Path, slurm: Path) -> None:
    # Reproduced on the cluster: `["node3"]` in quarantine.json, then kill -9 of a rank: TypeError (string indices
    # must be integers) before `scontrol requeue`, and the job ended FAILED at once.
    (tmp_path / "quarantine.json").write_text('["node3"]')
    inc = Incident("dead_rank", "9.0", 0, "rank 1 died", [{"rank": 1, "node": "node2", "state": "dead"}])
    ctx = _ctx(tmp_path)
    ctx.nodes_needed = 1
    assert conclude(ctx, cause="dead_rank", step=12, incident=inc) == exitcodes.REQUEUE
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert (d["action"], d["excluded"]) == ("requeue", ["node2", "node3"]), d
    assert _job(slurm)["restarts"] == 1 and _job(slurm)["exc"] == "node2,node3"
    # the file is rewritten in the form the code writes, the hand-written node kept
    assert [e["node"] for e in json.loads((tmp_path / "quarantine.json").read_text())] == ["node3", "node2"]


def test_an_error_between_claim_and_publish_still_requeues_and_publishes(
    tmp_path: Path, slurm: Path, monkeypatch
) -> None:
    def broken(*a, **k):
        raise KeyError("node")

    monkeypatch.setattr(respond, "decide", broken)
    assert conclude(_ctx(tmp_path), cause="SIGUSR2", step=12) == exitcodes.REQUEUE
    assert _verbs(slurm) == ["scontrol -o", "scontrol requeue"] and _job(slurm)["restarts"] == 1
    published = json.loads((tmp_path / "incidents/9.0/decision.json").read_text())
    assert (published["action"], published["exit_code"]) == ("requeue", exitcodes.REQUEUE)
    assert published["reason"] == (
        "SIGUSR2: the decision path failed (KeyError: 'node'); requeued as a last resort, without exclusions"
    )
    assert [e["action"] for e in read_events(tmp_path / "events.jsonl", "decision")] == ["requeue"]
    (rq,) = read_events(tmp_path / "events.jsonl", "requeue")
    assert rq["ok"] is True


def test_an_error_after_the_decision_was_recorded_requeues_once_and_records_it_once(
    tmp_path: Path, slurm: Path, monkeypatch
) -> None:
    def broken(job_id, nodes):
        raise OSError("sinfo: Resource temporarily unavailable")

    quarantine.add_to_quarantine(tmp_path, ["node3"], reason="by hand", incident="8.0")
    monkeypatch.setattr(respond, "requeue_excluding", broken)
    assert conclude(_ctx(tmp_path), cause="SIGUSR2", step=12) == exitcodes.REQUEUE
    assert _verbs(slurm).count("scontrol requeue") == 1 and _job(slurm)["restarts"] == 1
    assert [e["action"] for e in read_events(tmp_path / "events.jsonl", "decision")] == ["requeue"]
    assert json.loads((tmp_path / "incidents/9.0/decision.json").read_text())["action"] == "requeue"


def test_the_last_resort_does_not_requeue_a_job_that_slurm_cancels_or_past_the_requeue_budget(
    tmp_path: Path, slurm: Path, monkeypatch
) -> None:
    monkeypatch.setattr(respond, "decide", lambda *a, **k: 1 / 0)
    _job(slurm, state="CANCELLED")
    assert conclude(_ctx(tmp_path), cause="SIGTERM", step=12) == exitcodes.REQUEUE
    assert "scontrol requeue" not in _verbs(slurm)
    assert json.loads((tmp_path / "incidents/9.0/decision.json").read_text())["action"] == "none"
    _job(slurm, state="RUNNING")
    ctx = _ctx(tmp_path / "b", cfg=FailureConfig(max_requeues=2, heartbeat_s=0.05))
    ctx.restart_count = 2
    assert conclude(ctx, cause="dead_rank", step=12) == exitcodes.STOPPED
    assert "scontrol requeue" not in _verbs(slurm)


def test_the_supervisors_fallback_decides_past_a_malformed_quarantine_file(tmp_path: Path, slurm: Path) -> None:
    ctx = _lost_decider(tmp_path)
    (tmp_path / "quarantine.json").write_text("node3\n")
    d = respond.decide_for_lost_decider(ctx, step_code=137)
    assert d is not None and (d["action"], d["exit_code"]) == ("requeue", exitcodes.REQUEUE), d
    assert _job(slurm)["restarts"] == 1 and _job(slurm)["exc"] == "node1"


def test_a_failure_that_cannot_be_classified_is_still_decided(tmp_path: Path, slurm: Path, monkeypatch) -> None:
    def unreadable(**kw):
        raise PermissionError(13, "Permission denied", "heartbeats")

    monkeypatch.setattr(respond, "classify_settled", unreadable)
    monkeypatch.setattr(respond, "dump_stacks", lambda *a: None)
    assert respond.on_failure(_ctx(tmp_path), error=RuntimeError("boom"), step=12) == exitcodes.REQUEUE
    (f,) = read_events(tmp_path / "events.jsonl", "failure")
    assert f["cls"] == "rank_crashed" and "not classified (PermissionError" in f["summary"], f
    assert policy.read_decision(tmp_path, "9.0", wait_s=0)["action"] == "requeue"


def test_the_guard_decides_past_a_malformed_quarantine_file(tmp_path: Path, monkeypatch) -> None:
    from jobs.events import EventLog
    from jobs.launch import supervise
    from tests.unit.test_supervisor_guard import _cfg

    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    EventLog(tmp_path / "events.jsonl", rank=-1, restart=0, attempt="41.0").emit("attempt_start", job_id="41")
    (tmp_path / "quarantine.json").write_text('{"node3": "bad"}')
    asked: list[str] = []
    monkeypatch.setattr(supervise, "_numbered_steps", lambda: [])
    monkeypatch.setattr(respond, "slurm_intent", lambda job_id, restart_count: None)
    monkeypatch.setattr(respond, "requeue_job", lambda job_id: asked.append(job_id) or (True, ""))
    code = supervise._after_supervisor_death(_cfg(tmp_path), pid=7, how="was killed by SIGKILL")
    assert (code, asked) == (exitcodes.REQUEUE, ["41"])


def test_the_local_launcher_decides_for_a_decider_that_died_before_publishing(tmp_path: Path, monkeypatch) -> None:
    # Before: the launcher returned the rank's 75 and the run ended, where the Slurm supervisor restarts the ranks.
    from jobs.config import compose
    from jobs.launch import local

    cfg = compose([f"run.dir={tmp_path}", "launcher.tasks_per_node=2", "failure.heartbeat_s=0.05"])
    starts: list[str] = []

    def launch_once(cfg, events, *, restart, restart_in_allocation, early):
        attempt = "local.0" + (f".{restart_in_allocation}" if restart_in_allocation else "")
        events.attempt = attempt
        ctx = respond.AttemptContext(
            run_dir=cfg.run.dir,
            attempt=attempt,
            rank=-1,
            world_size=2,
            job_id=None,
            restart_count=0,
            cfg=cfg.failure,
            events=events,
            supervised=True,
            restart_in_allocation=restart_in_allocation,
        )
        respond.open_attempt(ctx, nodes=["here"], launcher="local", restart_in_allocation=restart_in_allocation)
        starts.append(attempt)
        if restart_in_allocation == 0:
            assert policy.claim(cfg.run.dir, attempt, rank=1)  # and died before publishing
            return exitcodes.REQUEUE, ctx
        return exitcodes.OK, ctx

    monkeypatch.setattr(local, "_launch_once", launch_once)
    assert local.launch(cfg) == exitcodes.OK
    assert starts == ["local.0", "local.0.1"]
    d = policy.read_decision(tmp_path, "local.0", wait_s=0)
    assert d["action"] == "restart" and d["reason"].startswith("dead_rank: restart 1 of"), d
