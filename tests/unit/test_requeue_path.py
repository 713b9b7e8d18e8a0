"""The requeue path against a stand-in Slurm: an exclusion that never leaves the job held, the decision published
after the requeue, a transient sinfo failure, which incidents quarantine a node, and a hang that recurs on one node."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from jobs import exitcodes
from jobs.config import FailureConfig
from jobs.events import EventLog, read_events
from jobs.failure import policy, quarantine, respond
from jobs.failure.incident import Incident
from jobs.failure.policy import Decision, Restart, decide
from jobs.failure.respond import AttemptContext, conclude
from jobs.records import load_json

# Slurm 22.05's answers, as seen on the local cluster: `update ExcNodeList=node1,node99` -> rc 1 "Invalid node
# name specified for job 2"; on a RUNNING job Slurm refuses ExcNodeList; right after `scontrol requeue` the job is
# PENDING|COMPLETING (shown COMPLETING) and takes it, and a second `scontrol requeue` is refused: rc 1 "Job is pending
# execution for job 2". A held job stays PENDING until `scontrol release`.
_FAKE = """#!{python}
import json, os, sys
d = os.environ["FAKE_SLURM"]
name, args = os.path.basename(sys.argv[0]), sys.argv[1:]
path = os.path.join(d, "job.json")
job = json.load(open(path))
with open(os.path.join(d, "calls.jsonl"), "a") as f:
    f.write(json.dumps({{"cmd": [name, *args], "published": os.path.exists(job["decision"])}}) + "\\n")
def end(rc, text=""):
    json.dump(job, open(path, "w"))
    print(text, file=sys.stdout if rc == 0 else sys.stderr)
    sys.exit(rc)
if name == "sinfo":
    if job["sinfo_fails"]:
        end(1, "sinfo: error: Unable to contact slurm controller (connect failure)")
    end(0, "\\n".join(n + (" idle" if "%N %t" in args else "") for n in job["nodes"]))
if name == "srun":
    if any(a == "-w" + n for n in job.get("answering", []) for a in args):
        end(0)
    end(1, job.get("srun_error") or "srun: error: Unable to create step: node does not answer")
if args[:2] == ["-o", "show"]:
    end(0, f"JobId={{job['id']}} JobState={{job['state']}} Reason=None Restarts={{job['restarts']}} "
           f"ExcNodeList={{job['exc']}} EndTime={{job.get('end', 'Unknown')}}")
verb = args[0]
if verb == "ping":
    down = job.get("ctl_down")
    end(1 if down else 0, "Slurmctld(primary) at ctl is " + ("DOWN" if down else "UP"))
if verb in ("requeue", "requeuehold"):
    if job.get("requeue_fails"):  # slurmctld busy this many times
        job["requeue_fails"] -= 1
        end(1, "scontrol: error: slurm_requeue error: Socket timed out on send/recv operation")
    if job["state"] != "RUNNING":  # requeued already (PENDING|COMPLETING)
        end(1, f"Job is pending execution for job {{job['id']}}")
    job.update(state="COMPLETING", restarts=job["restarts"] + 1, held=verb == "requeuehold")
    if job.get("requeue_unanswered"):  # slurmctld read it only after scontrol gave up waiting (MessageTimeout)
        job["requeue_unanswered"] -= 1
        end(1, f"Unexpected message received for job {{job['id']}}")
    end(0)
if verb == "update":
    exc = args[2].split("=", 1)[1]
    if any(n not in job["nodes"] for n in exc.split(",") if n):
        end(1, f"Invalid node name specified for job {{job['id']}}")
    if job["state"] == "RUNNING":
        end(1, f"Job is no longer pending execution for job {{job['id']}}")
    job["exc"] = exc
    end(0)
if verb == "release":
    job["held"] = False
    end(0)
end(1, "unknown command")
"""


@pytest.fixture
def slurm(tmp_path: Path, monkeypatch) -> Path:
    """scontrol, sinfo and srun on PATH, answering for one RUNNING job 9 on node[1-3]; every call is logged
    (with whether the attempt's decision was published by then) to calls.jsonl beside job.json."""
    fake = tmp_path / "fake_slurm"
    fake.mkdir()
    for name in ("scontrol", "sinfo", "srun"):
        (fake / name).write_text(_FAKE.format(python=sys.executable))
        (fake / name).chmod((fake / name).stat().st_mode | stat.S_IXUSR)
    _job(
        fake,
        id="9",
        state="RUNNING",
        restarts=0,
        held=False,
        exc="(null)",
        nodes=["node1", "node2", "node3"],
        sinfo_fails=False,
        decision=str(tmp_path / "run/incidents/9.0/decision.json"),
    )
    monkeypatch.setenv("FAKE_SLURM", str(fake))
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    return fake


def _job(fake: Path, **fields) -> dict:
    path = fake / "job.json"
    job = {**(json.loads(path.read_text()) if path.exists() else {}), **fields}
    path.write_text(json.dumps(job))
    return job


def _calls(fake: Path) -> list[dict]:
    path = fake / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _verbs(fake: Path) -> list[str]:
    return [" ".join(c["cmd"][:2]) if c["cmd"][0] == "scontrol" else c["cmd"][0] for c in _calls(fake)]


# ----------------------------------------------------------------------- an exclusion never leaves it held


def test_a_quarantined_node_slurm_no_longer_knows_is_dropped_and_the_job_is_requeued_not_held(slurm: Path) -> None:
    # Before: requeuehold, then `update ExcNodeList=node1,node99` refused, and a return without release.
    ok, said = quarantine.requeue_excluding("9", ["node1", "node99"])
    job = _job(slurm)
    assert ok and not job["held"] and job["state"] == "COMPLETING" and job["restarts"] == 1, (job, said)
    assert job["exc"] == "node1" and "dropped node(s) Slurm does not know: node99" in said, said
    assert "scontrol requeuehold" not in _verbs(slurm)


def test_when_slurm_refuses_the_exclusion_the_job_is_still_requeued_and_never_held(slurm: Path) -> None:
    _job(slurm, sinfo_fails=True)  # the names cannot be checked first: the update is refused as a whole
    ok, said = quarantine.requeue_excluding("9", ["node1", "node99"])
    job = _job(slurm)
    assert ok and not job["held"] and job["restarts"] == 1 and job["exc"] == "(null)", (job, said)
    assert "requeued without the new exclusion" in said and "sinfo could not list the nodes" in said, said


def _ctx(run_dir: Path, *, attempt: str = "9.0", cfg: FailureConfig | None = None, **kw) -> AttemptContext:
    events = EventLog(run_dir / "events.jsonl", rank=0, restart=0, attempt=attempt)
    events.emit("attempt_start", job_id="9")
    events.emit("train_start", step=0)
    events.emit("checkpoint_saved", step=10)
    return AttemptContext(
        run_dir=str(run_dir),
        attempt=attempt,
        rank=0,
        world_size=2,
        job_id="9",
        restart_count=0,
        cfg=cfg or FailureConfig(heartbeat_s=0.05, node_probe_timeout_s=5),
        events=events,
        nodes_needed=2,
        **kw,
    )


def test_the_decision_is_published_only_after_the_requeue_command_returned(tmp_path: Path, slurm: Path) -> None:
    # Published first, the supervisor may end the step on it and its batch script the job, before the
    # requeue reached Slurm.
    run = tmp_path / "run"
    run.mkdir()
    quarantine.add_to_quarantine(run, ["node3"], reason="by hand", incident="8.0")
    assert conclude(_ctx(run), cause="SIGUSR2", step=12) == exitcodes.REQUEUE
    scontrol = [(c["cmd"][1], c["published"]) for c in _calls(slurm) if c["cmd"][0] == "scontrol"]
    assert scontrol == [("-o", False), ("requeue", False), ("update", False)], scontrol
    assert json.loads((run / "incidents/9.0/decision.json").read_text())["action"] == "requeue"
    (rq,) = read_events(run / "events.jsonl", "requeue")
    assert rq["ok"] and rq["excluded"] == ["node3"] and _job(slurm)["exc"] == "node3"


def test_the_other_ranks_wait_for_a_decision_longer_than_the_decider_may_probe_and_ask_slurm() -> None:
    cfg = FailureConfig(heartbeat_s=2.0, node_probe_timeout_s=15.0)
    assert policy.decision_wait_s(cfg) == 5 * 2.0 + 15.0 + 20.0  # not 5 * heartbeat + 10 = 20 s < one probe


# -------------------------------------------------------------------- Slurm cannot answer -> requeue


def test_a_transient_sinfo_failure_requeues_instead_of_stopping_for_good(tmp_path: Path, slurm: Path) -> None:
    # Before: usable_nodes answered [] and the job stopped with exit 76, "leaves 0 usable node(s)".
    run = tmp_path / "run"
    run.mkdir()
    quarantine.add_to_quarantine(run, ["node3"], reason="by hand", incident="8.0")
    _job(slurm, sinfo_fails=True)
    assert quarantine.usable_nodes(None, {"node3"}) is None
    assert conclude(_ctx(run), cause="SIGUSR2", step=12) == exitcodes.REQUEUE
    (d,) = read_events(run / "events.jsonl", "decision")
    assert d["action"] == "requeue" and "sinfo could not say which nodes are usable" in d["reason"], d
    assert _job(slurm)["restarts"] == 1


# ----------------------------------------------------------- only incidents that point at a node quarantine


def _incident(cls: str) -> Incident:
    return Incident(
        cls,
        "9.0",
        0,
        f"a {cls} incident",
        [{"rank": 1, "node": "node2", "pid": 77, "state": "x", "step": 12, "beat_age_s": 9.5}],
    )


@pytest.mark.parametrize(
    ("cls", "quarantines"),
    [
        ("dead_rank", True),
        ("hung_rank", True),
        ("unhealthy_gpu", True),
        ("checkpoint_error", False),  # a full shared disk: node2 is as good as any other
        ("collective_mismatch", False),  # the minority of a mismatch is arbitrary
        ("rank_crashed", False),
        ("collective_timeout", False),
        ("everything_slow", False),
    ],
)
def test_only_node_pointing_incidents_put_their_suspects_node_on_the_quarantine_list(
    tmp_path: Path, slurm: Path, cls: str, quarantines: bool
) -> None:
    assert conclude(_ctx(tmp_path), cause=cls, step=12, incident=_incident(cls)) == exitcodes.REQUEUE
    assert [e["node"] for e in quarantine.quarantined(tmp_path)] == (["node2"] if quarantines else [])
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert d["action"] == "requeue" and d["excluded"] == (["node2"] if quarantines else []), d
    assert _job(slurm)["exc"] == ("node2" if quarantines else "(null)")


@pytest.mark.parametrize("cls", ["straggler", "sdc"])
def test_a_straggler_or_silent_data_corruption_quarantines_its_node_on_a_requeue(
    tmp_path: Path, slurm: Path, cls: str
) -> None:
    d = Decision("requeue", cls, exitcodes.REQUEUE, 0, 10, 0)
    assert respond._quarantine(_ctx(tmp_path), d, _incident(cls), None) == ["node2"]
    (entry,) = quarantine.quarantined(tmp_path)
    assert entry["evidence"]["cls"] == cls and entry["evidence"]["suspects"][0]["pid"] == 77


def test_a_quarantined_node_carries_its_evidence(tmp_path: Path, slurm: Path) -> None:
    # A hung rank past its restarts whose node does not answer the probe step (the fake srun fails).
    ctx = _ctx(tmp_path, supervised=True)
    assert conclude(ctx, cause="hung_rank", step=12, incident=_incident("hung_rank")) == exitcodes.REQUEUE
    (entry,) = quarantine.quarantined(tmp_path)
    ev = entry["evidence"]
    assert (entry["node"], entry["incident"], ev["cls"]) == ("node2", "9.0", "hung_rank")
    assert ev["summary"] == "a hung_rank incident"
    assert [(s["rank"], s["pid"], s["step"], s["beat_age_s"]) for s in ev["suspects"]] == [(1, 77, 12, 9.5)]
    assert ev["probe"].startswith("no one-task step ran on it within failure.node_probe_timeout_s: srun exited 1")
    assert "srun" in _verbs(slurm) and _job(slurm)["exc"] == "node2"


# ------------------------------------------------------- a hang that recurs on one node is requeued without it


def _hung(attempt: str, t: float, node: str, *, cls: str = "hung_rank", saved: int | None = None) -> list[dict]:
    """An attempt that resumed from step 10 and ended by a `cls` incident naming `node` (restarted in place)."""
    out = [
        {"kind": "attempt_start", "attempt": attempt, "time": t},
        {"kind": "train_start", "attempt": attempt, "time": t + 1, "step": 0 if saved else 10},
    ]
    if saved:
        out.append({"kind": "checkpoint_saved", "attempt": attempt, "time": t + 2, "step": saved})
    return out + [
        {
            "kind": "failure",
            "attempt": attempt,
            "time": t + 3,
            "cls": cls,
            "suspects": [{"rank": 1, "node": node, "state": "stopped"}],
        },
        {"kind": "decision", "attempt": attempt, "time": t + 3, "action": "restart", "cause": cls},
        {"kind": "attempt_end", "attempt": attempt, "time": t + 3, "cause": cls, "action": "restart"},
    ]


def _third_hang(node: str, *, cls: str = "hung_rank") -> list[dict]:
    """Attempt 9.0 committed step 10 and hung on node2; 9.0.1 hung on node2 without committing; 9.0.2 (being
    decided) ended by a `cls` incident naming `node`."""
    return _hung("9.0", 0, "node2", saved=10) + _hung("9.0.1", 10, "node2") + _hung("9.0.2", 20, node, cls=cls)[:-2]


def test_a_hang_that_recurs_on_the_same_node_requeues_without_it_when_the_breaker_trips() -> None:
    # Before: the restarts on node2 (its probe passes, its device hangs) tripped the no-progress breaker: stop, 76.
    cfg = FailureConfig(max_attempts_without_progress=2, restarts_in_allocation=3, max_requeues=4)
    d = decide(
        _third_hang("node2"),
        cause="hung_rank",
        cfg=cfg,
        restart_count=0,
        restart=Restart(True, 2, []),
        suspect_nodes=["node2"],
    )
    assert (d.action, d.exit_code, d.attempts_without_progress) == ("requeue", exitcodes.REQUEUE, 2), d
    assert "suspect node node2 again after 2 attempts" in d.reason, d.reason


@pytest.mark.parametrize(
    ("node", "cls"),
    [
        ("node3", "hung_rank"),  # a different node: nothing points at one
        ("node2", "rank_crashed"),
    ],
)  # a crash loop is a bug, not a node
def test_the_breaker_still_stops_when_the_suspect_node_is_new_or_the_class_points_at_no_node(
    node: str, cls: str
) -> None:
    cfg = FailureConfig(max_attempts_without_progress=2, restarts_in_allocation=3, max_requeues=4)
    d = decide(
        _third_hang(node, cls=cls),
        cause=cls,
        cfg=cfg,
        restart_count=0,
        restart=Restart(True, 2, []),
        suspect_nodes=[node],
    )
    assert (d.action, d.exit_code) == ("stop", exitcodes.STOPPED), d


def test_a_recurring_hang_ends_with_the_node_quarantined_and_excluded(tmp_path: Path, slurm: Path) -> None:
    events = EventLog(tmp_path / "events.jsonl", rank=0, restart=0, attempt="9.0.2")
    for e in _third_hang("node2"):
        events.emit(e["kind"], **{k: v for k, v in e.items() if k not in ("kind", "time")})
    ctx = AttemptContext(
        run_dir=str(tmp_path),
        attempt="9.0.2",
        rank=0,
        world_size=2,
        job_id="9",
        restart_count=0,
        cfg=FailureConfig(max_attempts_without_progress=2, heartbeat_s=0.05),
        events=events,
        supervised=True,
        restart_in_allocation=2,
        nodes_needed=2,
    )
    inc = Incident("hung_rank", "9.0.2", 0, "rank 1 hung", [{"rank": 1, "node": "node2", "state": "stopped"}])
    assert conclude(ctx, cause="hung_rank", step=10, incident=inc) == exitcodes.REQUEUE
    assert [e["node"] for e in quarantine.quarantined(tmp_path)] == ["node2"]
    assert _job(slurm)["exc"] == "node2" and _job(slurm)["restarts"] == 1


# ----------------------------------------- a decider that dies before publishing: the supervisor decides


def _lost_decider(run_dir: Path, *, incident: Incident | None = None) -> AttemptContext:
    """Attempt 9.0 on node[1-2]: rank 0 (node1) claimed its decision, maybe wrote `incident`, and died; the
    step has ended. Returns the supervisor's context."""
    from jobs.failure.heartbeat import Beat, beat_path, write_beat
    from jobs.failure.incident import write_incident

    for r, node in ((0, "node1"), (1, "node2")):
        write_beat(beat_path(run_dir, "9.0", r), Beat(r, 100 + r, "vm", node, 0.0, 17, "train", 0.0))
    assert policy.claim(run_dir, "9.0", rank=0)
    if incident is not None:
        write_incident(run_dir, incident)
    ctx = _ctx(run_dir, supervised=True)
    ctx.rank = -1
    return ctx


def test_the_supervisor_decides_for_a_decider_that_died_before_publishing(tmp_path: Path, slurm: Path) -> None:
    # Before: the step ended without a decision, the supervisor returned its exit code and the job ended there.
    d = respond.decide_for_lost_decider(_lost_decider(tmp_path), step_code=137)
    assert d is not None and d["action"] == "requeue", d  # the fake srun fails: node1 does not answer
    (failure,) = read_events(tmp_path / "events.jsonl", "failure")
    assert failure["cls"] == "dead_rank" and failure["reported_by"] == -1
    assert [(s["rank"], s["node"], s["pid"]) for s in failure["suspects"]] == [(0, "node1", 100)]
    assert [e["node"] for e in quarantine.quarantined(tmp_path)] == ["node1"] and _job(slurm)["exc"] == "node1"
    assert load_json(tmp_path / "incidents/9.0/decision.json") == d  # the file, read as every reader reads it


def test_the_supervisor_decides_from_the_incident_the_lost_decider_wrote(tmp_path: Path, slurm: Path) -> None:
    inc = Incident("collective_mismatch", "9.0", 0, "ranks stopped in different places", [{"rank": 1, "node": "node2"}])
    d = respond.decide_for_lost_decider(_lost_decider(tmp_path, incident=inc), step_code=75)
    assert d is not None and d["action"] == "requeue" and d["reason"].startswith("collective_mismatch"), d
    assert read_events(tmp_path / "events.jsonl", "failure") == []  # the incident is not recorded twice
    assert quarantine.quarantined(tmp_path) == [] and _job(slurm)["restarts"] == 1


def test_an_attempt_nobody_claimed_or_already_decided_is_left_to_its_step(tmp_path: Path, slurm: Path) -> None:
    ctx = _ctx(tmp_path, supervised=True)
    assert respond.decide_for_lost_decider(ctx, step_code=0) is None  # finished, or ended by a stop signal
    policy.claim(tmp_path, "9.0", rank=1)
    policy.publish(tmp_path, "9.0", Decision("restart", "dead_rank", 75, 0, 10, 0))
    assert respond.decide_for_lost_decider(ctx, step_code=75) is None
    assert _calls(slurm) == [] and read_events(tmp_path / "events.jsonl", "decision") == []


def test_a_straggler_put_on_the_quarantine_list_carries_its_measurements(tmp_path: Path) -> None:
    import torch

    from jobs.config import compose
    from jobs.launch.env import DistEnv
    from jobs.telemetry.rank_telemetry import build_step_telemetry
    from jobs.telemetry.stragglers import Detection

    cfg = compose(
        [
            "mesh=single",
            "launcher.tasks_per_node=1",
            f"run.dir={tmp_path}",
            f"cluster.run_root={tmp_path}",
            "failure.exclude_stragglers=true",
        ]
    )
    env = DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        nodes=1,
        master_addr="x",
        master_port=0,
        hostname="node7",
    )
    st = build_step_telemetry(
        cfg,
        env,
        events=EventLog(tmp_path / "events.jsonl"),
        pp=False,
        mesh="single",
        device=torch.device("cpu"),
        mixed_precision="fp32",
    )
    st.on_straggler(["node7"], Detection("relative", "backward", [0], 1.3, 0.13, 0.1))
    (entry,) = quarantine.quarantined(tmp_path)
    assert entry["evidence"] == {
        "cls": "straggler",
        "check": "relative",
        "phase": "backward",
        "ranks": [0],
        "ratio": 1.3,
        "seconds": 0.13,
        "reference_s": 0.1,
    }
