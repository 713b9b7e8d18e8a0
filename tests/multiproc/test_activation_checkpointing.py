"""Activation checkpointing changes memory, not the numbers: the default mesh (pp2 * dp_shard2 * tp2,
8 ranks) trains to the same losses with every mode."""

from __future__ import annotations

import pytest

from tests.conftest import run_train

pytestmark = pytest.mark.multiproc

STEPS = 4
COMMON = [f"train.steps={STEPS}", "checkpoint.enabled=false"]


def test_full_and_selective_checkpointing_give_bitwise_the_losses_of_none(data_path: str, tmp_path) -> None:
    losses = {}
    for mode in ("none", "full", "selective"):
        run = run_train([*COMMON, f"data.path={data_path}", f"train.activation_checkpointing={mode}"], tmp_path / mode)
        assert run.returncode == 0, run.stderr[-3000:]
        losses[mode] = run.losses()
    assert len(losses["none"]) == STEPS
    # Measured 2026-12-03: equal to the last bit (recomputation replays the same ops on the same data).
    assert losses["full"] == losses["none"]
    assert losses["selective"] == losses["none"]
    assert losses["none"][-1] < losses["none"][0]
