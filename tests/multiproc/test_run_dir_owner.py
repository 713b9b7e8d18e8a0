"""Through `python -m jobs.train` locally: a second job pointed at a live run directory is refused before it
forks a rank; once the first has ended, a start that changes what the run is is refused naming the keys, and
a resume on another mesh is accepted."""

from __future__ import annotations

import signal

import pytest

from jobs.events import read_events
from tests.conftest import run_train, wait_for_step
from tests.multiproc.test_failure_local import _start

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

DP2 = ["mesh=single", "mesh.dp_shard=2", "launcher.tasks_per_node=2"]
TP2 = ["mesh=single", "mesh.tp=2", "launcher.tasks_per_node=2"]


def test_second_local_job_with_another_mesh_is_refused_while_the_first_trains_in_the_run_dir(tmp_path, data_path):
    run_dir = tmp_path / "run"
    first = _start(run_dir, ["train.steps=100000", f"data.path={data_path}", *DP2])
    try:
        wait_for_step(run_dir, 1, first)
        second = run_train(["train.steps=100000", f"data.path={data_path}", *TP2], run_dir, timeout=120)
        assert first.poll() is None  # the first one trains on, untouched
    finally:
        first.send_signal(signal.SIGINT)  # save at the next step and end (exit 75)
        first.communicate(timeout=120)
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"run.dir={run_dir} is in use by another live job" in second.stderr
    assert f"local launch by pid {first.pid} on" in second.stderr and "rank 0 of attempt local.0" in second.stderr
    # refused before it forked a rank: the ledger knows one launch only, and its mesh
    assert {e["attempt"] for e in read_events(run_dir / "events.jsonl", "attempt_start")} == {"local.0"}
    assert {e["mesh"] for e in read_events(run_dir / "events.jsonl", "train_start")} == {"dp_shard2"}

    # Once it has ended: a start that changes what the run is, is refused naming what changed ...
    other = run_train(
        ["train.steps=100000", f"data.path={data_path}", *DP2, "optim.lr=0.001", "train.seed=5"], run_dir, timeout=120
    )
    assert other.returncode == 2, other.stderr[-2000:]
    assert "optim.lr (0.01 -> 0.001), train.seed (0 -> 5)" in other.stderr
    assert {e["attempt"] for e in read_events(run_dir / "events.jsonl", "attempt_start")} == {"local.0"}

    # ... and a resume that changes only what a resume may change (the mesh, the steps) is accepted and reshards.
    saved = max(e["step"] for e in read_events(run_dir / "events.jsonl", "checkpoint_saved"))
    resumed = run_train([f"train.steps={saved + 1}", f"data.path={data_path}", *TP2], run_dir, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    loaded = read_events(run_dir / "events.jsonl", "checkpoint_loaded")
    assert [(e["step"], e["resharded"]) for e in loaded] == [(saved, True)]
