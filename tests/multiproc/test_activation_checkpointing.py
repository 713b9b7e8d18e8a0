"""Activation checkpointing changes memory, not the numbers: the default mesh (pp2 * dp_shard2 * tp2,
8 ranks) trains to the same losses, and evaluates to the same held-out losses, with every mode."""

from __future__ import annotations

import pytest

from tests.conftest import run_train
from tests.multiproc.test_parity import EVAL_STEPS, STEPS, mesh_run

pytestmark = pytest.mark.multiproc


def test_full_and_selective_checkpointing_give_bitwise_the_losses_of_none(data_path: str, tmp_path, shared_run) -> None:
    # none: test_parity's pp2_dp_shard2_tp2 run (8 steps, a held-out evaluation at steps 4 and 8), shared
    common = mesh_run("pp2_dp_shard2_tp2", data_path)
    runs = {"none": shared_run(common)}
    for mode in ("full", "selective"):
        runs[mode] = run_train([*common, f"train.activation_checkpointing={mode}"], tmp_path / mode)
        assert runs[mode].returncode == 0, runs[mode].stderr[-3000:]
    losses = {mode: run.losses() for mode, run in runs.items()}
    evals = {mode: [(e["step"], e["eval_loss"]) for e in run.evals()] for mode, run in runs.items()}
    assert len(losses["none"]) == STEPS and [s for s, _ in evals["none"]] == EVAL_STEPS
    # Measured 2026-12-03: equal to the last bit (recomputation replays the same ops on the same data).
    assert losses["full"] == losses["none"]
    assert losses["selective"] == losses["none"]
    assert evals["full"] == evals["selective"] == evals["none"]  # forward-only under the wrappers: the same ops
    assert losses["none"][-1] < losses["none"][0]
