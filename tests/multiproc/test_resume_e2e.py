"""End to end through `python -m jobs.train`: SIGKILL + restart is bitwise, a resharded restart stays within fp32 tolerance.

Each wait below (RUN_S) is the bound that fires on a slow day, with its own message; the pytest-timeout
marker sits above their sum (the first test also pays for the module's reference run), so it never
fires first. Resharding onto one process is tests/multiproc/test_resume.py's (same checkpoint code)."""

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

RUN_S = 240  # one 12-step run of 8 ranks: ~60 s on the loaded 2-core box
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(3 * RUN_S + 60)]

STEPS = 12
COMMON = [f"train.steps={STEPS}", "checkpoint.every_steps=6"]
PP2_DP2_TP2 = ["mesh.pp=2", "mesh.dp_shard=2", "mesh.tp=2", "launcher.tasks_per_node=8"]


def _losses(run_dir: Path) -> dict[int, float]:
    import json

    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}  # a restarted run appends: the last line of a step wins


def _final(run_dir: Path, tmp: Path) -> dict:
    out = tmp / f"{run_dir.name}-final.pt"
    convert(run_dir / f"checkpoints/step_{STEPS}", out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_path):
    run_dir = tmp_path_factory.mktemp("e2e_ref")
    r = run_train([*COMMON, *PP2_DP2_TP2, f"data.path={data_path}"], run_dir, timeout=RUN_S)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir, _losses(run_dir), _final(run_dir, tmp_path_factory.mktemp("e2e_ref_pt"))


def test_train_killed_after_step_6_resumes_bitwise(reference, tmp_path, data_path):
    ref_dir, ref_losses, ref_final = reference
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "jobs.train", f"run.dir={run_dir}", *COMMON, *PP2_DP2_TP2, f"data.path={data_path}"]
    p = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    manifest = run_dir / "checkpoints/step_6/manifest.json"
    deadline = time.monotonic() + RUN_S
    while not manifest.exists() and p.poll() is None:
        if time.monotonic() > deadline:
            os.killpg(p.pid, signal.SIGKILL)
            raise AssertionError(f"no {manifest} after {RUN_S} s")
        time.sleep(0.05)
    os.killpg(p.pid, signal.SIGKILL)  # the launcher and every rank, mid-training
    p.wait()
    assert manifest.exists() and not (run_dir / f"checkpoints/step_{STEPS}").exists()

    r = run_train([*COMMON, *PP2_DP2_TP2, f"data.path={data_path}"], run_dir, timeout=RUN_S)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = read_events(run_dir / "events.jsonl", "checkpoint_loaded")
    assert [e["step"] for e in loaded] == [6] and loaded[0]["resharded"] is False
    losses = _losses(run_dir)
    for step in range(7, STEPS + 1):
        assert losses[step] == ref_losses[step], (step, losses[step], ref_losses[step])
    final = _final(run_dir, tmp_path)
    assert_states_bitwise(final, ref_final)


def test_train_resumes_resharded_onto_dp_shard4_tp2_within_fp32_tolerance(reference, tmp_path, data_path):
    mesh = ["mesh.pp=1", "mesh.dp_shard=4", "mesh.tp=2", "launcher.tasks_per_node=8"]
    ref_dir, ref_losses, ref_final = reference
    run_dir = tmp_path / "run"
    shutil.copytree(ref_dir / "checkpoints/step_6", run_dir / "checkpoints/step_6")
    r = run_train([*COMMON, *mesh, f"data.path={data_path}"], run_dir, timeout=RUN_S)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded = read_events(run_dir / "events.jsonl", "checkpoint_loaded")
    assert [e["step"] for e in loaded] == [6] and loaded[0]["resharded"] is True
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(7, STEPS + 1))
    got = torch.tensor([losses[s] for s in range(7, STEPS + 1)])
    want = torch.tensor([ref_losses[s] for s in range(7, STEPS + 1)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    final = _final(run_dir, tmp_path)
    for k, v in final["model"].items():
        torch.testing.assert_close(v, ref_final["model"][k], rtol=1e-4, atol=1e-5, msg=k)
