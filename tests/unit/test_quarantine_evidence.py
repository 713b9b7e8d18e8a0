"""Healthy nodes stay off the quarantine list: a dead or hung rank quarantines its node only on
evidence from the node itself (a probe it did not answer while slurmctld did, or the fault recurring on it), never
when the fault followed a rank to another node; a probe that slurmctld failed is no evidence; entries expire after
failure.quarantine_ttl_h; cluster.exclude stays in every ExcNodeList update; probes run all at once."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from jobs import exitcodes
from jobs.config import FailureConfig, compose
from jobs.events import read_events
from jobs.failure import quarantine
from jobs.failure.incident import Incident
from jobs.failure.respond import conclude
from jobs.validate import validate
from tests.unit.test_requeue_path import _ctx, _job, _verbs, slurm  # noqa: F401 - slurm: the stand-in fixture


def _dead(node: str, *, rank: int = 1, attempt: str = "9.0") -> Incident:
    return Incident("dead_rank", attempt, 0, f"rank {rank} died", [{"rank": rank, "node": node, "state": "dead"}])


def test_a_dead_rank_whose_node_answers_the_probe_is_requeued_without_quarantining_it(
    tmp_path: Path, slurm: Path
) -> None:
    # Before: restarts spent (or none possible), any dead rank's node went on the list unprobed.
    _job(slurm, answering=["node2"])
    assert conclude(_ctx(tmp_path), cause="dead_rank", step=12, incident=_dead("node2")) == exitcodes.REQUEUE
    assert quarantine.quarantined(tmp_path) == []
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert (d["action"], d["excluded"]) == ("requeue", []) and _job(slurm)["exc"] == "(null)"
    assert _verbs(slurm).count("srun") == 1  # probed once, now


@pytest.mark.parametrize(
    "error",
    [
        "srun: error: Unable to create step for job 9: Socket timed out on send/recv operation",
        # 22.05.8's srun inside a job whose slurmctld stays silent past MessageTimeout (SIGSTOPped, on the cluster)
        pytest.param(
            "srun: error: Unable to confirm allocation for job 9: Socket timed out on send/recv operation\n"
            "srun: Check SLURM_JOB_ID environment variable. Expired or invalid job 9",
            id="srun: error: Unable to confirm allocation for job 9: Socket timed out",
        ),
        "srun: error: Unable to contact slurm controller (connect failure)",
        "srun: error: Slurm temporarily unable to accept job, sleeping and retrying",
    ],
)
def test_a_probe_that_slurmctld_failed_is_no_evidence_against_the_node(tmp_path: Path, slurm: Path, error: str) -> None:
    _job(slurm, srun_error=error)
    assert quarantine.probe_node("9", "node2", timeout_s=5)[0] == "unknown"
    assert conclude(_ctx(tmp_path), cause="dead_rank", step=12, incident=_dead("node2")) == exitcodes.REQUEUE
    assert quarantine.quarantined(tmp_path) == []


def test_a_node_whose_slurmd_fails_the_task_launch_is_silent_whatever_the_words(tmp_path: Path, slurm: Path) -> None:
    # A communication error at task launch is the node's slurmd, not slurmctld: still evidence against the node.
    _job(
        slurm, srun_error="srun: error: Task launch for StepId=9.3 failed on node node2: Socket timed out on send/recv"
    )
    assert quarantine.probe_node("9", "node2", timeout_s=5)[0] == "silent"


def test_a_failed_probe_while_slurmctld_does_not_answer_ping_is_no_evidence(tmp_path: Path, slurm: Path) -> None:
    _job(slurm, ctl_down=True)
    assert quarantine.probe_node("9", "node2", timeout_s=5)[0] == "unknown"
    _job(slurm, ctl_down=False)
    verdict, said = quarantine.probe_node("9", "node2", timeout_s=5)
    assert (verdict, said) == ("silent", "srun exited 1: srun: error: Unable to create step: node does not answer")


def test_a_restart_is_not_refused_for_a_node_that_slurmctld_could_not_probe(tmp_path: Path, slurm: Path) -> None:
    _job(slurm, srun_error="srun: error: Unable to create step for job 9: Socket timed out on send/recv operation")
    assert conclude(_ctx(tmp_path, supervised=True), cause="dead_rank", step=12, incident=_dead("node2")) == 75
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert d["action"] == "restart" and quarantine.quarantined(tmp_path) == [], d


def test_a_fault_that_follows_a_rank_to_another_node_quarantines_neither(tmp_path: Path, slurm: Path) -> None:
    ctx = _ctx(tmp_path, attempt="9.1")
    ctx.events.emit("failure", attempt="9.0", cls="dead_rank", suspects=[{"rank": 1, "node": "node3"}])
    # node2 does not answer its probe (the stand-in srun fails), but rank 1 died on node3 before as well
    assert conclude(ctx, cause="dead_rank", step=12, incident=_dead("node2", attempt="9.1")) == exitcodes.REQUEUE
    assert quarantine.quarantined(tmp_path) == []
    assert "srun" not in _verbs(slurm)


def test_a_node_that_does_not_answer_is_quarantined_with_the_probes_words(tmp_path: Path, slurm: Path) -> None:
    assert conclude(_ctx(tmp_path), cause="hung_rank", step=12, incident=_dead("node2")) == exitcodes.REQUEUE
    (entry,) = quarantine.quarantined(tmp_path)
    assert entry["node"] == "node2" and entry["evidence"]["probe"] == (
        "no one-task step ran on it within failure.node_probe_timeout_s: "
        "srun exited 1: srun: error: Unable to create step: node does not answer"
    )


def test_probes_of_several_nodes_run_at_once(tmp_path: Path, slurm: Path) -> None:
    # Before: one after another, 8 lost nodes took 8 timeouts. Each stand-in probe waits (up to 5 s) until all six
    # have started: run at once they all meet, whatever the machine's load; one after another none does.
    started, seen = tmp_path / "started", tmp_path / "seen"
    (slurm / "srun").write_text(
        "#!/bin/sh\n"
        f"echo x >> {started}\n"
        "i=0\n"
        f'while [ "$(wc -l < {started})" -lt 6 ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done\n'
        f'if [ "$(wc -l < {started})" -ge 6 ]; then echo met >> {seen}; else echo alone >> {seen}; fi\n'
        f'exec {slurm / "scontrol"} "$@"\n'
    )
    found = quarantine.probe_nodes("9", [f"node{i}" for i in range(6)], timeout_s=60)
    assert len(found) == 6 and seen.read_text().split() == ["met"] * 6


def test_quarantine_entries_expire_after_failure_quarantine_ttl_h(tmp_path: Path) -> None:
    (tmp_path / "quarantine.json").write_text(
        json.dumps(
            [
                {"node": "node1", "time": time.time() - 25 * 3600},
                {"node": "node2", "time": time.time() - 3600},
                {"node": "node3"},  # written by hand, no time: kept until removed
            ]
        )
    )
    assert [e["node"] for e in quarantine.quarantined(tmp_path, ttl_h=24)] == ["node2", "node3"]
    assert [e["node"] for e in quarantine.quarantined(tmp_path, ttl_h=0)] == ["node1", "node2", "node3"]
    entries = quarantine.add_to_quarantine(tmp_path, ["node1"], reason="again", incident="9.3", ttl_h=24)
    assert [(e["node"], e.get("incident")) for e in entries] == [("node2", None), ("node3", None), ("node1", "9.3")]


def test_a_negative_quarantine_ttl_is_refused_with_the_fix() -> None:
    cfg = compose(["failure.quarantine_ttl_h=-1"])
    with pytest.raises(ValueError, match=r"failure.quarantine_ttl_h\(-1.0\) must be >= 0"):
        validate(cfg)
    assert compose([]).failure.quarantine_ttl_h == 24.0


def test_every_exclusion_update_keeps_cluster_exclude(tmp_path: Path, slurm: Path) -> None:
    # Before: `scontrol update ExcNodeList=node2` replaced the job's --exclude=node1 (cluster.exclude).
    ctx = _ctx(tmp_path, cfg=FailureConfig(heartbeat_s=0.05))
    ctx.always_excluded, ctx.nodes_needed = ["node1"], 1
    assert conclude(ctx, cause="hung_rank", step=12, incident=_dead("node2")) == exitcodes.REQUEUE
    assert _job(slurm)["exc"] == "node2,node1"


def test_the_supervisors_start_up_requeue_keeps_cluster_exclude(tmp_path: Path, slurm: Path, monkeypatch) -> None:
    from jobs.launch import supervise

    for k, v in {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    quarantine.add_to_quarantine(tmp_path, ["node2"], reason="x", incident="8.0")
    cfg = compose(["launcher=slurm", f"run.dir={tmp_path}", "launcher.nodes=2", "cluster.exclude=node3"])
    assert supervise._off_quarantine(cfg, job_id="9", restart=0, nodes=["node1", "node2"]) == exitcodes.REQUEUE
    assert _job(slurm)["exc"] == "node2,node3"
