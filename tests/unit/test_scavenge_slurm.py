"""The RAM tier's scavenge at the edges of a Slurm allocation (jobs/launch/scavenge.py) against a stand-in `srun`
that runs each node's task here: the newest RAM step is flushed and the run's folders removed, within its bound
when a node never answers; the decider runs it before `scontrol requeue`, and its failure never stops the requeue."""

from __future__ import annotations

import json
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint import CheckpointManager
from checkpoint.manifest import read_manifest, step_dirs
from jobs import exitcodes
from jobs.config import compose
from jobs.events import EventLog, read_events
from jobs.failure import policy, quarantine, respond
from jobs.failure.policy import Decision, publish
from jobs.failure.respond import conclude
from jobs.launch import scavenge as scavenge_mod
from jobs.launch import supervise
from jobs.launch.rundir import memory_root, run_id
from jobs.launch.scavenge import scavenge_allocation
from tests.unit.test_memory_tier import _cfg, _fresh, _train
from tests.unit.test_requeue_path import _ctx, _verbs, slurm  # noqa: F401 - slurm: the stand-in fixture

# srun: logs its node, then runs the command after its options here (node3 never answers)
_SRUN = """#!{python}
import json, os, subprocess, sys, time
args = sys.argv[1:]
node = next(a.split("=", 1)[1] for a in args if a.startswith("--nodelist="))
with open(os.path.join(os.path.dirname(sys.argv[0]), "sruns.jsonl"), "a") as f:
    f.write(json.dumps({{"node": node, "args": args}}) + "\\n")
if node == "node3":
    time.sleep(60)
cmd = args[next(i for i, a in enumerate(args) if not a.startswith("--")):]
sys.exit(subprocess.call(cmd))
"""


@pytest.fixture
def srun(tmp_path: Path, monkeypatch) -> Path:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text(_SRUN.format(python=sys.executable))
    (fake / "srun").chmod((fake / "srun").stat().st_mode | stat.S_IXUSR)
    (fake / "sinfo").write_text('#!/bin/sh\ncat "$(dirname "$0")/sinfo.out" 2>/dev/null || exit 1\n')
    (fake / "sinfo").chmod(0o755)  # says what sinfo.out holds; without it, cannot say (exit 1)
    monkeypatch.setenv("PATH", f"{fake}:{Path(sys.executable).parent}:/usr/bin:/bin")
    return fake


def _job_cfg(tmp_path: Path, *extra: str):
    return compose(
        [
            f"run.dir={tmp_path / 'run'}",
            "launcher.nodes=1",
            "launcher.tasks_per_node=1",
            "checkpoint.memory_every_steps=1",
            f"checkpoint.memory_dir={tmp_path / 'shm'}",
            *extra,
        ]
    )


def _train_run(tmp_path: Path, cfg) -> None:
    """5 steps of one rank: filesystem steps 2 and 4, RAM step 5, in the job's checkpoint folder and RAM root."""
    model, opt = _fresh()
    ck = CheckpointManager(
        Path(cfg.run.dir) / "checkpoints", cfg=_cfg(tmp_path), run_id=run_id(cfg.run.dir), total_steps=100
    )
    ck.load_latest(model_parts=[model], optimizers=[opt])
    for step in range(1, 6):
        _train(model, opt, step)
        if ck.memory_due(step):
            ck.save_memory(step)
        if ck.due(step):
            ck.save(step)
    ck.close()


def test_the_end_of_an_allocation_flushes_the_newer_ram_step_and_removes_the_runs_folders(tmp_path, srun) -> None:
    cfg = _job_cfg(tmp_path)
    _train_run(tmp_path, cfg)
    shutil.copytree(memory_root(cfg), tmp_path / "ram-copy")
    events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=0, attempt="9.0")
    folder = Path(cfg.run.dir) / "checkpoints"
    # exit 77 (diverged): nothing is flushed, the folders still go
    out = scavenge_allocation(cfg, ["node1"], when="allocation_end", events=events, flush=False)
    assert out["flushed_step"] is None and out["ram_steps"] == [5] and not memory_root(cfg).exists()
    assert [s for s, _ in step_dirs(folder)] == [4, 2]
    shutil.copytree(tmp_path / "ram-copy", memory_root(cfg))
    out = scavenge_allocation(cfg, ["node1", "node2"], when="allocation_end", events=events)
    assert out is not None and out["flushed_step"] == 5 and out["filesystem_step"] == 4 and out["ram_steps"] == [5]
    assert "failed_nodes" not in out and "error" not in out and out["removed_bytes"] > 0
    assert [s for s, _ in step_dirs(folder)] == [5, 4, 2] and read_manifest(folder / "step_5", step=5)["scavenged"]
    assert not memory_root(cfg).exists()
    assert [(e["when"], e["flushed_step"]) for e in read_events(events.path, "ram_scavenged")] == [
        ("allocation_end", None),
        ("allocation_end", 5),
    ]
    # list on both nodes, flush on the node that holds the copy only, clean on both
    sruns = [json.loads(line) for line in (srun / "sruns.jsonl").read_text().splitlines()][2:]  # the 77 case's 2
    rounds = [(c["node"], c["args"][c["args"].index("checkpoint.scavenge") + 1]) for c in sruns]
    assert sorted(rounds) == sorted(
        [("node1", "list"), ("node2", "list"), ("node1", "flush"), ("node1", "clean"), ("node2", "clean")]
    )


def test_a_node_that_never_answers_does_not_hold_up_the_end_of_the_allocation(tmp_path, srun) -> None:
    cfg = _job_cfg(tmp_path)
    _train_run(tmp_path, cfg)
    events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=0, attempt="9.0")
    t0 = time.monotonic()
    out = scavenge_allocation(cfg, ["node1", "node3"], when="requeue", events=events, timeout_s=12)
    assert time.monotonic() - t0 < 12 + 2 + 2  # its bound, srun's grace after SIGTERM, the record
    assert out["failed_nodes"] == {"node3": "no answer in time"}  # asked once, in the first round's share
    # node1 went on alone: its copy flushed within the time left, or not at all; never half
    folder = Path(cfg.run.dir) / "checkpoints"
    assert [s for s, _ in step_dirs(folder)] == ([5, 4, 2] if out["flushed_step"] == 5 else [4, 2]), out
    assert [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] == []


def test_a_flush_whose_bound_runs_out_after_the_commits_rename_is_reported_flushed(tmp_path, srun, monkeypatch) -> None:
    # Under load the commit's process can pass its share of the bound after it renamed the step into place: the
    # step is whole on disk, so the record says it was flushed (it said None, and a later attempt that trusts the
    # record would not look for it), with the timeout kept as a note.
    cfg = _job_cfg(tmp_path)
    _train_run(tmp_path, cfg)
    commit = scavenge_mod._commit

    def commit_then_time_out(*args, **kwargs):
        commit(*args, **kwargs)
        raise subprocess.TimeoutExpired("python -m checkpoint.scavenge_commit", 1.0)

    monkeypatch.setattr(scavenge_mod, "_commit", commit_then_time_out)
    events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=0, attempt="9.0")
    out = scavenge_allocation(cfg, ["node1"], when="requeue", events=events)
    folder = Path(cfg.run.dir) / "checkpoints"
    assert [s for s, _ in step_dirs(folder)] == [5, 4, 2]
    assert out["flushed_step"] == 5 and "timed out" in out["flush_error"], out


def test_a_node_slurm_says_is_down_is_not_asked(tmp_path, srun) -> None:
    cfg = _job_cfg(tmp_path)
    _train_run(tmp_path, cfg)
    (srun / "sinfo.out").write_text("node1 mix\nnode3 down*\n")
    events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=0, attempt="9.0")
    out = scavenge_allocation(cfg, ["node1", "node3"], when="allocation_end", events=events)
    assert out["failed_nodes"] == {"node3": "not reachable (sinfo: down*)"} and out["flushed_step"] == 5
    assert {json.loads(line)["node"] for line in (srun / "sruns.jsonl").read_text().splitlines()} == {"node1"}


def test_with_the_ram_tier_off_nothing_runs_on_the_nodes(tmp_path, srun) -> None:
    cfg = compose([f"run.dir={tmp_path / 'run'}", "launcher.nodes=1", "launcher.tasks_per_node=1"])
    events = EventLog(tmp_path / "events.jsonl", rank=-1, restart=0, attempt="9.0")
    assert scavenge_allocation(cfg, ["node1"], when="allocation_end", events=events) is None
    assert not (srun / "sruns.jsonl").exists()


@pytest.mark.parametrize("fails", [False, True])
def test_the_decider_scavenges_before_scontrol_requeue_and_a_failure_there_never_stops_it(
    tmp_path: Path, slurm: Path, fails: bool
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    seen: list[list[str]] = []

    def hook() -> None:
        seen.append(_verbs(slurm))
        if fails:
            raise OSError("srun: not found")

    assert conclude(_ctx(run, before_requeue=hook), cause="SIGUSR2", step=12) == exitcodes.REQUEUE
    assert len(seen) == 1 and "scontrol requeue" not in seen[0] and "scontrol requeue" in _verbs(slurm)
    assert json.loads((run / "incidents/9.0/decision.json").read_text())["action"] == "requeue"


@pytest.mark.parametrize(
    ("code", "end"),
    [
        (exitcodes.OK, [("allocation_end", True)]),
        (exitcodes.CONFIG_ERROR, [("allocation_end", True)]),
        (exitcodes.FAILED, [("allocation_end", True)]),
        (exitcodes.DIVERGED, [("allocation_end", False)]),  # a diverged state is never made the newest checkpoint
        (exitcodes.REQUEUE, []),  # scavenged before `scontrol requeue`: after it Slurm starts no step in the job
    ],
)
def test_the_supervisor_scavenges_at_the_start_and_at_every_end_but_a_requeue(
    tmp_path, monkeypatch, code: int, end: list
) -> None:
    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(
        supervise, "scavenge_allocation", lambda cfg, nodes, *, when, events, flush=True: calls.append((when, flush))
    )
    monkeypatch.setattr(supervise, "_attempts", lambda cfg, **kw: code)
    for k, v in {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "node1", "SLURM_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
    try:
        assert supervise.supervise(_job_cfg(tmp_path), logs=("o", "e")) == code
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    assert calls == [("allocation_start", True), *end]


def test_the_torchrun_style_batch_step_scavenges_once_its_agents_ended_but_not_after_a_requeue(
    tmp_path, monkeypatch
) -> None:
    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(
        supervise, "scavenge_allocation", lambda cfg, nodes, *, when, events, flush=True: calls.append((when, flush))
    )
    for k, v in {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "node1", "SLURM_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    cfg = _job_cfg(tmp_path)
    for code in (exitcodes.OK, exitcodes.DIVERGED):
        monkeypatch.setattr(supervise, "read_decision", lambda *a, code=code, **k: {"exit_code": code})
        assert supervise.after_agents(cfg, step_code=code) == code
    monkeypatch.setattr(supervise, "read_decision", lambda *a, **k: {"exit_code": exitcodes.REQUEUE})
    assert supervise.after_agents(cfg, step_code=exitcodes.REQUEUE) == exitcodes.REQUEUE
    assert calls == [("allocation_end", True), ("allocation_end", False)]


@pytest.mark.parametrize("raises", ["decide", "requeue_excluding"])
def test_a_requeue_as_the_last_resort_scavenges_once_before_scontrol_requeue(
    tmp_path: Path, slurm: Path, monkeypatch, raises: str
) -> None:
    # Before: `_last_resort` (the decision path raised) ran `scontrol requeue` without `before_requeue`.
    run = tmp_path / "run"
    run.mkdir()
    quarantine.add_to_quarantine(run, ["node3"], reason="by hand", incident="8.0")  # requeue_excluding, not _job
    seen: list[list[str]] = []

    def bug(*a, **k):
        raise RuntimeError("a bug")

    monkeypatch.setattr(respond, raises, bug)
    ctx = _ctx(run, before_requeue=lambda: seen.append(_verbs(slurm)))
    assert conclude(ctx, cause="SIGUSR2", step=12) == exitcodes.REQUEUE
    # once (requeue_excluding raised after the normal path's scavenge), and before the requeue reached Slurm
    assert len(seen) == 1 and "scontrol requeue" not in seen[0] and "scontrol requeue" in _verbs(slurm), seen
    d = json.loads((run / "incidents/9.0/decision.json").read_text())
    assert d["action"] == "requeue" and (raises != "decide" or "as a last resort" in d["reason"]), d


def _scavenges(monkeypatch, tmp_path: Path, *, job: str = "9") -> list:
    """The supervisor module's scavenges (when, flush) and requeues ("requeue"), in order, in job `job` on node1."""
    calls: list = []
    monkeypatch.setattr(
        supervise, "scavenge_allocation", lambda cfg, nodes, *, when, events, flush=True: calls.append((when, flush))
    )
    monkeypatch.setattr(respond, "slurm_intent", lambda job_id, restart_count: None)
    monkeypatch.setattr(respond, "requeue_job", lambda job_id: calls.append("requeue") or (True, ""))
    for k, v in {"SLURM_JOB_ID": job, "SLURM_JOB_NODELIST": "node1", "SLURM_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "run").mkdir()
    return calls


@pytest.mark.parametrize(
    ("ranks_decided", "calls"),
    [
        (None, [("requeue", True), "requeue"]),  # it decides: a requeue, scavenged before it
        (exitcodes.STOPPED, [("allocation_end", True)]),  # the ranks' stop: the end the dead supervisor would run
        (exitcodes.DIVERGED, [("allocation_end", False)]),
    ],
)
def test_the_guard_scavenges_before_the_requeue_it_decides_and_at_any_other_end_of_the_allocation(
    tmp_path: Path, monkeypatch, ranks_decided: int | None, calls: list
) -> None:
    # Before: the guard's context had no `before_requeue`, and after any other end nobody scavenged.
    seen = _scavenges(monkeypatch, tmp_path)
    cfg = _job_cfg(tmp_path)
    EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=0, attempt="9.0").emit("attempt_start", job_id="9")
    if ranks_decided is not None:
        publish(cfg.run.dir, "9.0", Decision("stop", "by the ranks", ranks_decided, 0, 10, 0))
    monkeypatch.setattr(supervise, "_numbered_steps", lambda: [])
    code = supervise._after_supervisor_death(cfg, pid=7, how="was killed by SIGKILL")
    assert (code, seen) == (ranks_decided or exitcodes.REQUEUE, calls)


@pytest.mark.parametrize("decider", ["died after its claim", "never claimed"])
def test_a_requeue_the_torchrun_style_batch_step_decides_is_scavenged_before_it(
    tmp_path: Path, monkeypatch, decider: str
) -> None:
    # Before: `after_agents`' context had no `before_requeue`: neither `decide_for_lost_decider` nor
    # `decide_for_silent_attempt` scavenged before their `scontrol requeue`.
    seen = _scavenges(monkeypatch, tmp_path)
    cfg = _job_cfg(tmp_path)
    EventLog(Path(cfg.run.dir) / "events.jsonl", rank=-1, restart=0, attempt="9.0").emit("attempt_start", job_id="9")
    if decider == "died after its claim":
        assert policy.claim(cfg.run.dir, "9.0", rank=0)
    assert supervise.after_agents(cfg, step_code=137) == exitcodes.REQUEUE
    assert seen == [("requeue", True), "requeue"]
    assert policy.read_decision(cfg.run.dir, "9.0", wait_s=0)["action"] == "requeue"


@pytest.mark.parametrize(("n", "calls"), [(0, ["requeue"]), (1, [("requeue", True), "requeue"])])
def test_a_requeue_off_a_quarantined_node_after_a_restart_scavenges_the_attempts_before_it(
    tmp_path: Path, monkeypatch, n: int, calls: list
) -> None:
    # Before the first attempt the start's scavenge has just run; after a restart the attempts' RAM steps are there.
    seen = _scavenges(monkeypatch, tmp_path)
    monkeypatch.setattr(supervise, "requeue_excluding", lambda job_id, nodes: seen.append("requeue") or (True, ""))
    cfg = _job_cfg(tmp_path)
    quarantine.add_to_quarantine(cfg.run.dir, ["node1"], reason="by hand", incident="8.0")
    code = supervise._off_quarantine(cfg, job_id="9", restart=0, nodes=["node1"], n=n)
    assert (code, seen) == (exitcodes.REQUEUE, calls)
