"""failure.max_rollbacks counts the rollbacks of the last failure.rollback_window_steps steps (jobs/failure/spike.py)."""

from __future__ import annotations

import pytest

from checkpoint import TrainState
from jobs.config import FailureConfig
from jobs.failure.spike import LossDiverged, check_config
from tests.unit.test_spike import _Fake, _health, _spike_at


def _ckpt(step: int) -> dict:
    return {"step": step, "tokens_seen": 0, "loss_tail": [], "health": {"detector": {"history": [1.0], "streak": []}}}


def test_spikes_further_apart_than_the_window_never_spend_the_budget_and_close_ones_do(tmp_path):
    # max_rollbacks=1 per 10 steps: spikes at steps 8, 19 and 30 (11 apart) each roll back; one at 35 stops.
    h = _health(tmp_path, spike_window=1, spike_factor=2.0, max_rollbacks=1, rollback_window_steps=10)
    st = TrainState()
    fake = _Fake(h, st, {5: _ckpt(5), 16: _ckpt(16), 27: _ckpt(27), 33: _ckpt(33)})
    st.health["detector"] = {"history": [1.0], "streak": []}
    assert _spike_at(h, fake, [9.0], start=7) and st.step == 5
    assert _spike_at(h, fake, [9.0], start=18) and st.step == 16
    assert _spike_at(h, fake, [9.0], start=29) and st.step == 27
    assert [r["step"] for r in h.records] == [8, 19, 30]
    with pytest.raises(LossDiverged) as e:
        _spike_at(h, fake, [9.0], start=34)
    assert "failure.max_rollbacks(1) rollbacks are spent" in str(e.value)
    assert "failure.rollback_window_steps(10)" in str(e.value)


def test_a_zero_window_counts_every_rollback_of_the_run(tmp_path):
    h = _health(tmp_path, spike_window=1, spike_factor=2.0, max_rollbacks=1, rollback_window_steps=0)
    st = TrainState()
    fake = _Fake(h, st, {5: _ckpt(5), 900: _ckpt(900)})
    st.health["detector"] = {"history": [1.0], "streak": []}
    assert _spike_at(h, fake, [9.0], start=7)
    with pytest.raises(LossDiverged):
        _spike_at(h, fake, [9.0], start=950)


def test_a_negative_window_is_a_config_error_naming_the_override():
    with pytest.raises(ValueError, match=r"failure.rollback_window_steps\(-1\)"):
        check_config(FailureConfig(rollback_window_steps=-1))
