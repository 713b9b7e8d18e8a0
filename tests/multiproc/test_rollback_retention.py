"""A rollback with checkpoint.keep small, then a stop-signal save and a requeue: the abandoned timeline's
checkpoints are moved aside at the rollback, retention keeps the rollback target, and the rerun resumes from
the stop's checkpoint and finishes (checkpoint/retention.py, CheckpointManager.load_latest(before_step=))."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import exitcodes
from jobs.failure.spike import CORRUPT_VAR
from jobs.telemetry.phases import SLOW_PHASE_VAR
from tests.conftest import REPO, run_train

pytestmark = pytest.mark.multiproc

# Data steps 29 and 30 get random targets: steps 30 and 31 spike (patience 2), step_30 is saved after the first
# spiking step, and the rollback goes back to step_20 (keep=2: step_10 is gone by then). The forward phase is
# slowed (x8) so that the stop signal sent on the rollback record lands well before step 30 is reached again.
COMMON = [
    "train.steps=36",
    "mesh=single",
    "mesh.dp_shard=2",
    "launcher.tasks_per_node=2",
    "checkpoint.every_steps=10",
    "checkpoint.keep=2",
    "train.log_every=1",
    "failure.spike_window=5",
    "failure.spike_factor=1.4",
    "failure.spike_mad_k=0",
    "failure.spike_patience=2",
    "failure.spike_skip_steps=2",
]
ENV = {CORRUPT_VAR: "29,30", SLOW_PHASE_VAR: "all:forward:8"}


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def _stop_on_rollback(run_dir: Path, data_path: str) -> tuple[int, str]:
    """Runs the first attempt and sends SIGUSR2 to the launcher as soon as the rollback is in the ledger."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.train", f"run.dir={run_dir}", *COMMON, f"data.path={data_path}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **ENV},
    )
    try:
        deadline = time.monotonic() + 240
        while not any(e["kind"] == "rollback" for e in _events(run_dir)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGUSR2)  # the launcher forwards it to every rank
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, err


@pytest.mark.slow  # 26-50 s: two attempts of 2 ranks, the steps slowed on purpose
def test_a_stop_save_after_a_rollback_keeps_the_target_and_the_requeue_resumes_and_finishes(
    tmp_path: Path, data_path: str
):
    run_dir = tmp_path / "run"
    rc, err = _stop_on_rollback(run_dir, data_path)
    assert rc == exitcodes.REQUEUE, err[-3000:]
    rerun = run_train([*COMMON, f"data.path={data_path}"], run_dir, env={CORRUPT_VAR: "29,30"})
    assert rerun.returncode == exitcodes.OK, rerun.stderr[-3000:]
    events = _events(run_dir)
    [rollback] = [e["record"] for e in events if e["kind"] == "rollback"]
    assert (rollback["first_step"], rollback["step"], rollback["target_step"]) == (30, 31, 20)
    stop_step = next(e["step"] for e in events if e["kind"] == "stop_requested")
    assert 20 < stop_step < 30, stop_step  # the stop's save is below the abandoned step_30
    # step_30 of the abandoned timeline was moved aside at the rollback, under this attempt's name, and listed.
    assert [(e["step"], Path(e["path"]).name) for e in events if e["kind"] == "checkpoint_abandoned"] == [
        (30, "step_30.local.0")
    ]
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "abandoned/step_30.local.0/manifest.json").exists()
    assert not [
        e for e in events if e["kind"] == "checkpoint_deleted" and e["step"] == 20 and e["attempt"] == "local.0"
    ]

    loaded = [e["step"] for e in events if e["kind"] == "checkpoint_loaded" and e["attempt"] == "local.1"]
    assert loaded == [stop_step]
    assert [e["record"]["rollback"] for e in events if e["kind"] == "rollback"] == [1]  # not detected again
    final = {m["step"]: m["data_step"] for m in rerun.metrics()}
    assert sorted(s for s in final if s > stop_step) == list(range(stop_step + 1, 37))
    # Data steps 29..30 skipped: step s reads data step s - 1 up to step 29, s + 1 from step 30 on.
    redone = range(stop_step + 1, 37)
    assert [final[s] for s in redone] == [s - 1 if s < 30 else s + 1 for s in redone]
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_30", "step_36"]  # keep=2 of the current timeline
