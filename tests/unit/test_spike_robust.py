"""Spike detection with a robust statistic at the defaults: loss > max(spike_factor x baseline, baseline +
spike_mad_k x MAD), both of the window without its trend (jobs/failure/spike.py)."""

from __future__ import annotations

import math
import random

from jobs.config import FailureConfig
from jobs.failure.spike import new_detector, observe


def _spikes(losses: list[float], cfg: FailureConfig) -> list[int]:
    det, out = new_detector(), []
    for i, loss in enumerate(losses):
        if observe(det, step=i, loss=loss, grad_norm=1.0, cfg=cfg) is not None:
            out.append(i)
            det["streak"].clear()
    return out


def test_an_opt_style_jump_from_2_1_to_3_9_is_caught_at_the_defaults():
    # OPT-175B's logbook: a loss near 2.1 jumping to ~3.9 (x 1.86). The old default (3 x median) missed it.
    rng = random.Random(0)
    healthy = [2.1 + rng.gauss(0, 0.02) for _ in range(80)]
    assert _spikes(healthy + [3.9], FailureConfig()) == [80]
    assert _spikes(healthy + [2.3], FailureConfig()) == []  # +0.2 on a quiet curve is within 1.5 x the median


def test_a_noisy_early_curve_raises_no_spike_at_the_defaults():
    # A fast-falling, noisy start (10 -> 2.5, noise sd 0.4, occasional bumps +1.5): no rollback.
    rng = random.Random(1)
    curve = [2.5 + 7.5 * math.exp(-i / 60) + rng.gauss(0, 0.4) + (1.5 if i % 37 == 0 else 0.0) for i in range(600)]
    assert _spikes(curve, FailureConfig()) == []
    # the 1.5 x baseline ratio alone: false alarms (9 with the baseline that follows the curve; 6 with the median)
    assert len(_spikes(curve, FailureConfig(spike_mad_k=0.0))) == 9


def test_a_noisy_window_widens_the_bar_where_the_ratio_alone_would_fire():
    rng = random.Random(2)
    noisy = [4.0 + rng.uniform(-1.5, 1.5) for _ in range(50)]
    jump = [8.5]  # above 1.5 x the median of ~4, but within median + 8 x MAD (MAD ~0.75)
    assert _spikes(noisy + jump, FailureConfig()) == []
    assert _spikes(noisy + jump, FailureConfig(spike_mad_k=0.0)) == [50]
    assert _spikes(noisy + [20.0], FailureConfig()) == [50]
