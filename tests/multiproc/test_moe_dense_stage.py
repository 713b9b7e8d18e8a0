"""An MoE model whose first pipeline stage holds only dense blocks (DeepSeek-V3's own split) starts, checkpoints to
both tiers and resumes: every rank builds every process group in one order, whatever its stage holds.

It used to hang at start: the dense stage's ranks skipped building the MoE stage group (torch names groups by a
per-process counter), so the checkpoint manager's and the RAM tier's groups got other names there than on the MoE
stage's ranks, and every rank waited in build until killed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from checkpoint.config import memory_root
from jobs.events import read_events
from jobs.launch.rundir import run_id
from tests.conftest import run_train

RUN_S = 240  # a 4-rank run of 2 steps: ~30 s on the loaded 2-core box; a hang is cut by failure=debug's timeouts
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(2 * RUN_S + 60)]

# 4 blocks over pp2: blocks 0, 1 (dense) on stage 0, blocks 2, 3 (MoE, ep2 within dp_shard2) on stage 1.
DENSE_STAGE = [
    "model=tiny_moe",
    "model.n_dense_layers=2",
    "mesh=single",
    "mesh.pp=2",
    "mesh.dp_shard=2",
    "mesh.ep=2",
    "launcher.tasks_per_node=4",
    "failure=debug",
    "checkpoint.every_steps=2",
    "checkpoint.memory_every_steps=1",
    "train.log_every=1",
]


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_moe_model_with_a_dense_only_first_stage_checkpoints_and_resumes(tmp_path: Path, data_path: str) -> None:
    run_dir = tmp_path / "run"
    try:
        first = run_train([*DENSE_STAGE, "train.steps=2", f"data.path={data_path}"], run_dir, timeout=RUN_S)
        assert first.returncode == 0, first.stderr[-3000:]
        assert (run_dir / "checkpoints/step_2").is_dir()
        saved = read_events(run_dir / "events.jsonl", "checkpoint_saved")
        assert {e["step"] for e in saved} >= {1, 2}  # the RAM tier at step 1, both tiers at step 2
        again = run_train([*DENSE_STAGE, "train.steps=4", f"data.path={data_path}"], run_dir, timeout=RUN_S)
        assert again.returncode == 0, again.stderr[-3000:]
        loaded = read_events(run_dir / "events.jsonl", "checkpoint_loaded")
        assert [e["step"] for e in loaded] == [2]
        metrics = _metrics(run_dir)
        assert [m["step"] for m in metrics] == [1, 2, 3, 4]
        # Rank 0 (the dense stage) writes the MoE stage's balance too: blocks 2 and 3, gathered over the stages.
        for m in metrics:
            assert sorted(k for k in m if k.startswith("moe_load_imbalance/")) == [
                "moe_load_imbalance/2",
                "moe_load_imbalance/3",
            ]
            assert all(1.0 <= m[f"moe_load_imbalance/{b}"] <= 4.0 for b in (2, 3)), m
    finally:
        shutil.rmtree(memory_root("/dev/shm", run_id(run_dir)), ignore_errors=True)
