"""A real trainer (`python -m jobs.train`, local launcher, 2 ranks) killed from outside while its async
checkpoint write is in flight: nothing of that save loads, the restart resumes from the save before it, and
every step's loss and the final state are bitwise an uninterrupted run's. (tests/multiproc/test_checkpoint.py
places such kills inside a harness; this is the trainer's own save path, thread-async, unpatched.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint.convert import convert
from jobs.events import read_events
from tests.conftest import REPO, assert_states_bitwise, run_train
from tests.multiproc._references import DP2_RUN, DP2_STEPS

RUN_S = 180  # one 24-step run of 2 ranks: ~25 s on the loaded 2-core box
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(3 * RUN_S + 60)]

STEPS = DP2_STEPS
RUN = DP2_RUN  # two ranks, 24 steps, a thread-async save every 4 steps; its uninterrupted run is shared


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r.get("record") != "eval"}  # the newest line of a step wins


def _final(run_dir: Path, tmp: Path) -> dict:
    out = tmp / f"{run_dir.parent.name}-final.pt"
    convert(run_dir / f"checkpoints/step_{STEPS}", out)
    return torch.load(out, weights_only=False)


def _step_of(name: str) -> int:
    """N of a temporary folder `step_<N>.<attempt>.tmp` (checkpoint/manager.py: one per attempt)."""
    return int(name[len("step_") :].split(".", 1)[0])


def _in_flight(ckpts: Path, n: int) -> bool:
    """A save of step N was begun (its temporary folder exists) and not committed (no step_<N>)."""
    return any(p.is_dir() for p in ckpts.glob(f"step_{n}.*.tmp")) and not (ckpts / f"step_{n}").exists()


def _stop_during_a_write(p: subprocess.Popen, ckpts: Path) -> int:
    """SIGSTOPs the launcher and its ranks (one process group) at an instant when a save after the first is in
    flight (step_<N>.<attempt>.tmp there, step_<N> not yet committed) and returns N; a save that committed before the
    stop landed is let go (SIGCONT) and the next one tried."""
    deadline = time.monotonic() + RUN_S
    while time.monotonic() < deadline:
        assert p.poll() is None, "the run ended before a save could be caught in flight"
        tmps = [e.name for e in os.scandir(ckpts)] if ckpts.is_dir() else []
        steps = [_step_of(n) for n in tmps if n.startswith("step_") and n.endswith(".tmp")]
        if steps and max(steps) > 4:
            os.killpg(p.pid, signal.SIGSTOP)
            n = max(steps)
            if _in_flight(ckpts, n):
                return n
            os.killpg(p.pid, signal.SIGCONT)  # committed in between: the next save
        time.sleep(0.001)
    raise AssertionError(f"no save caught in flight under {ckpts} within {RUN_S} s")


def test_a_trainer_killed_during_its_async_checkpoint_write_resumes_from_the_previous_save_bitwise(
    tmp_path, data_path, shared_run
) -> None:
    ref_dir = shared_run([*RUN, f"data.path={data_path}"], timeout=RUN_S).run_dir
    run_dir = tmp_path / "killed" / "run"
    p = subprocess.Popen(
        [sys.executable, "-m", "jobs.train", f"run.dir={run_dir}", *RUN, f"data.path={data_path}"],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        killed = _stop_during_a_write(p, run_dir / "checkpoints")
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the launcher and every rank, stopped mid-save
        p.wait()
    ck = run_dir / "checkpoints"
    assert _in_flight(ck, killed)
    committed = [e["step"] for e in read_events(run_dir / "events.jsonl", "checkpoint_saved")]
    assert committed and max(committed) < killed, (committed, killed)

    r = run_train([*RUN, f"data.path={data_path}"], run_dir, timeout=RUN_S)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = read_events(run_dir / "events.jsonl", "checkpoint_loaded")
    assert [e["step"] for e in loaded] == [max(committed)], loaded  # the save before the killed one
    removed = read_events(run_dir / "events.jsonl", "checkpoint_tmp_removed")
    assert [_step_of(Path(e["path"]).name) for e in removed] == [killed], removed  # the killed attempt's folder
    got, want = _losses(run_dir), _losses(ref_dir)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [(s, got[s], want[s]) for s in got if got[s] != want[s]] == []
    final, ref_final = _final(run_dir, tmp_path), _final(ref_dir, tmp_path)
    assert_states_bitwise(final, ref_final)
