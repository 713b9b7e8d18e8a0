"""`python -m jobs.train model=tiny_moe mesh.ep=2` trains, and a run stopped at a checkpoint resumes bit for bit
(experts sharded over ep, the router biases in the checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from checkpoint.convert import convert
from jobs.events import read_events
from tests.conftest import assert_states_bitwise, run_train

RUN_S = 240  # one 6-step run of 2 ranks: ~15 s on the loaded 2-core box
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(3 * RUN_S + 60)]

# min_lr_ratio=1: a constant LR after warmup, so a 3-step run continued to 6 steps trains as one 6-step run.
EP2 = ["model=tiny_moe", "mesh=single", "mesh.dp_shard=2", "mesh.ep=2", "launcher.tasks_per_node=2",
       "optim.min_lr_ratio=1.0", "checkpoint.every_steps=3", "model.moe_bias_rate=0.01"]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _final(run_dir: Path, tmp: Path) -> dict:
    out = tmp / f"{run_dir.name}-final.pt"
    convert(run_dir / "checkpoints/step_6", out)
    return torch.load(out, weights_only=False)


def test_ep2_run_resumed_from_step_3_equals_the_uninterrupted_run_bitwise(tmp_path: Path, data_path: str) -> None:
    ref = run_train([*EP2, "train.steps=6", f"data.path={data_path}"], tmp_path / "ref", timeout=RUN_S)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "(ep2 within dp_shard)" in ref.stdout + ref.stderr
    ref_losses = _losses(tmp_path / "ref")
    assert ref_losses[6] < ref_losses[1]

    run_dir = tmp_path / "run"
    first = run_train([*EP2, "train.steps=3", f"data.path={data_path}"], run_dir, timeout=RUN_S)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_train([*EP2, "train.steps=6", f"data.path={data_path}"], run_dir, timeout=RUN_S)
    assert again.returncode == 0, again.stderr[-3000:]
    loaded = read_events(run_dir / "events.jsonl", "checkpoint_loaded")
    assert [e["step"] for e in loaded] == [3] and loaded[0]["resharded"] is False
    losses = _losses(run_dir)
    assert [losses[s] for s in range(1, 7)] == [ref_losses[s] for s in range(1, 7)]

    final, ref_final = _final(run_dir, tmp_path), _final(tmp_path / "ref", tmp_path / "ref")
    assert_states_bitwise(final, ref_final)
    bias = final["model"]["layers.1.feed_forward.router.expert_bias"]
    assert bias.abs().sum() > 0  # the balancing moved it, and the resumed run carried it on exactly
    assert final["model"]["layers.1.feed_forward.experts.w1"].shape == (8, 64, 32)  # every expert, from both ep ranks
