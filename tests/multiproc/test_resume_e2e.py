"""End to end through `python -m jobs.train`: SIGKILL + restart is bitwise, a resharded restart stays within fp32 tolerance.

The reference is test_parity's shared pp2_dp_shard2_tp2 run (8 steps, saves at 4 and 8, a held-out evaluation at
4 and 8), trained once per session; the restarts resume from its step_4. Each wait below (RUN_S) is the bound that
fires on a slow day, with its own message; the pytest-timeout marker sits above their sum (the first test may also
pay for the shared run), so it never fires first. Resharding onto one process is tests/multiproc/test_resume.py's
(same checkpoint code)."""

from __future__ import annotations

import os
import shutil
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
from tests.multiproc.test_parity import COMMON, SAVES, STEPS, mesh_run

RUN_S = 240  # one 8-step run of 8 ranks: ~25 s on the loaded 2-core box
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(3 * RUN_S + 60)]

SAVED = 4  # the middle save the restarts resume from (SAVES: every 4 steps)


def _losses(run_dir: Path) -> dict[int, float]:
    import json

    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # a restarted run appends: the last line of a step wins (the held-out evaluation's lines are not steps)
    return {r["step"]: r["loss"] for r in rows if r.get("record") != "eval"}


def _final(run_dir: Path, tmp: Path) -> dict:
    out = tmp / f"{run_dir.name}-final.pt"
    convert(run_dir / f"checkpoints/step_{STEPS}", out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_path, shared_run):
    run_dir = shared_run(mesh_run("pp2_dp_shard2_tp2", data_path), timeout=RUN_S).run_dir  # read-only: shared
    return run_dir, _losses(run_dir), _final(run_dir, tmp_path_factory.mktemp("e2e_ref_pt"))


def test_train_killed_after_step_4_resumes_bitwise(reference, tmp_path, data_path):
    ref_dir, ref_losses, ref_final = reference
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "jobs.train", f"run.dir={run_dir}", *mesh_run("pp2_dp_shard2_tp2", data_path)]
    p = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    manifest = run_dir / f"checkpoints/step_{SAVED}/manifest.json"
    deadline = time.monotonic() + RUN_S
    while not manifest.exists() and p.poll() is None:
        if time.monotonic() > deadline:
            os.killpg(p.pid, signal.SIGKILL)
            raise AssertionError(f"no {manifest} after {RUN_S} s")
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)  # the launcher and every rank, mid-training
    p.wait()
    assert manifest.exists() and not (run_dir / f"checkpoints/step_{STEPS}").exists()

    r = run_train(mesh_run("pp2_dp_shard2_tp2", data_path), run_dir, timeout=RUN_S)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = read_events(run_dir / "events.jsonl", "checkpoint_loaded")
    assert [e["step"] for e in loaded] == [SAVED] and loaded[0]["resharded"] is False
    losses = _losses(run_dir)
    for step in range(SAVED + 1, STEPS + 1):
        assert losses[step] == ref_losses[step], (step, losses[step], ref_losses[step])
    final = _final(run_dir, tmp_path)
    assert_states_bitwise(final, ref_final)


def test_train_resumes_resharded_onto_dp_shard4_tp2_within_fp32_tolerance(reference, tmp_path, data_path):
    mesh = ["mesh.pp=1", "mesh.dp_shard=4", "mesh.tp=2", "launcher.tasks_per_node=8"]
    ref_dir, ref_losses, ref_final = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir / f"checkpoints/step_{SAVED}", run_dir / f"checkpoints/step_{SAVED}")
    r = run_train([*COMMON, *SAVES, *mesh, f"data.path={data_path}"], run_dir, timeout=RUN_S)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = read_events(run_dir / "events.jsonl", "checkpoint_loaded")
    assert [e["step"] for e in loaded] == [SAVED] and loaded[0]["resharded"] is True
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(SAVED + 1, STEPS + 1))
    got = torch.tensor([losses[s] for s in range(SAVED + 1, STEPS + 1)])
    want = torch.tensor([ref_losses[s] for s in range(SAVED + 1, STEPS + 1)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    final = _final(run_dir, tmp_path)
    for k, v in final["model"].items():
        torch.testing.assert_close(v, ref_final["model"][k], rtol=1e-4, atol=1e-5, msg=k)
