"""The spike detector judges a loss against the window without its trend: a 2x jump on a
falling curve is caught, a healthy noisy falling curve raises no alarm, and a spike_patience that retention
cannot serve is refused before submit."""

from __future__ import annotations

import math
import random

import pytest

from jobs.config import FailureConfig, compose
from jobs.failure.spike import new_detector, observe, trend
from jobs.validate import validate


def _spikes(losses: list[float], cfg: FailureConfig) -> list[int]:
    det, out = new_detector(), []
    for i, loss in enumerate(losses):
        if observe(det, step=i, loss=loss, grad_norm=1.0, cfg=cfg) is not None:
            out.append(i)
            det["streak"].clear()
    return out


def test_a_2x_jump_on_a_falling_curve_is_caught_at_the_defaults() -> None:
    # The case: 6 -> 3.5 over 60 steps, then 7.06 (2 x the curve's level). The window's median (4.5)
    # lagged and its MAD (0.52) held the trend: the bar was max(1.5 x 4.5, 4.5 + 8 x 0.52) = 8.7.
    falling = [6 - 2.5 * i / 60 for i in range(61)]
    assert _spikes([*falling, 7.06], FailureConfig()) == [61]
    level, noise = trend(falling[-50:])
    assert level == pytest.approx(3.5 - 2.5 / 60, abs=1e-9) and noise == pytest.approx(0.0, abs=1e-9)
    rng = random.Random(5)  # and with noise (sd 0.03) on it
    noisy = [x + rng.gauss(0, 0.03) for x in falling]
    assert _spikes([*noisy, 7.06], FailureConfig()) == [61]
    assert _spikes([*falling, 3.6], FailureConfig()) == []  # the curve going on is no spike


def test_a_noisy_600_step_falling_curve_raises_no_alarm() -> None:
    for seed, (top, tau, sd) in enumerate([(3.0, 200, 0.05), (4.0, 150, 0.15), (6.0, 60, 0.3)]):
        rng = random.Random(seed)
        curve = [2 + top * math.exp(-i / tau) + rng.gauss(0, sd) for i in range(600)]
        assert _spikes(curve, FailureConfig()) == [], (top, tau, sd)


def test_a_flat_window_keeps_its_median_and_mad() -> None:
    assert trend([4.0, 5.0, 3.0, 4.0, 5.0, 3.0, 4.0]) == (4.0, 1.0)


def test_a_spike_patience_longer_than_retention_keeps_is_refused_with_the_fix() -> None:
    base = ["mesh=single", "launcher.tasks_per_node=1", "checkpoint.every_steps=10", "checkpoint.keep=2"]
    validate(compose([*base, "failure.spike_patience=10"]))
    with pytest.raises(ValueError, match=r"failure.spike_patience\(25\) > \(checkpoint.keep\(2\) - 1\) x "):
        validate(compose([*base, "failure.spike_patience=25"]))
    with pytest.raises(ValueError, match=r"set failure.spike_patience=10 \(or less\) or checkpoint.keep=4"):
        validate(compose([*base, "failure.spike_patience=25"]))
    validate(compose([*base, "failure.spike_patience=25", "checkpoint.keep=4"]))
