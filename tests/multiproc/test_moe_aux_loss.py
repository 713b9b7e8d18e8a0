"""The sequence-wise balance loss means the same alpha on every mesh: `python -m jobs.train` with alpha = 10 takes
the same first step (its gradient norm) with 1 or 4 microbatches and on 1 or 2 data-parallel ranks.

It used to weigh the balance loss by the number of microbatches without pipeline parallel: its backward injected
gradient 1 per microbatch while the main loss was divided by the microbatches, so alpha grew with the accumulation
steps and changed on a resume onto another dp."""

from __future__ import annotations

import pytest

from tests.conftest import run_train

RUN_S = 180
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(5 * RUN_S)]

ONE_STEP = [
    "model=tiny_moe",
    "mesh=single",
    "train.steps=1",
    "train.global_batch=4",
    "checkpoint.enabled=false",
    "model.moe_bias_rate=0.0",
]
# (ranks, micro_batch): 1 rank x 1 microbatch, 1 rank x 4 microbatches, 2 dp ranks x 2 microbatches each
LAYOUTS = {"micro1": (1, 4), "micro4": (1, 1), "dp2_micro2": (2, 1)}


def _step(overrides: list[str], run_dir, data_path: str) -> dict:
    run = run_train([*ONE_STEP, *overrides, f"data.path={data_path}"], run_dir, timeout=RUN_S)
    assert run.returncode == 0, run.stderr[-3000:]
    (m,) = run.metrics()
    return m


def test_balance_loss_weight_does_not_change_with_microbatches_or_data_parallel(tmp_path, data_path: str) -> None:
    steps = {}
    for name, (ranks, micro) in LAYOUTS.items():
        layout = [f"mesh.dp_shard={ranks}", f"launcher.tasks_per_node={ranks}", f"train.micro_batch={micro}"]
        steps[name] = _step([*layout, "model.moe_aux_loss_coef=10.0"], tmp_path / name, data_path)
    off = _step(
        ["launcher.tasks_per_node=1", "train.micro_batch=4", "model.moe_aux_loss_coef=0.0"], tmp_path / "off", data_path
    )
    norms = {name: m["grad_norm"] for name, m in steps.items()}
    assert abs(norms["micro1"] - off["grad_norm"]) > 0.01 * off["grad_norm"]  # alpha = 10 moves it: the test can fail
    for name, m in steps.items():
        assert m["grad_norm"] == pytest.approx(norms["micro1"], rel=1e-5), (name, norms)
        # The logged balance (metrics.jsonl, per MoE block 1-3): the same loss on every layout, counted once.
        for block in (1, 2, 3):
            assert m[f"moe_aux_loss/{block}"] == pytest.approx(steps["micro1"][f"moe_aux_loss/{block}"], rel=1e-5)
            assert m[f"moe_aux_loss/{block}"] > 0 and m[f"moe_load_imbalance/{block}"] >= 1.0
            assert m[f"moe_bias_spread/{block}"] == 0.0  # model.moe_bias_rate=0
    assert off["moe_aux_loss/1"] == 0.0
