"""The grad-norm check's warm-up, as the loss check's (armed once failure.spike_window healthy steps were
seen), and realistic curves at the defaults (jobs/failure/spike.py)."""

from __future__ import annotations

import math
import random

from jobs.config import FailureConfig
from jobs.failure.spike import new_detector, observe, suspicious


def _spikes(losses: list[float], norms: list[float], cfg: FailureConfig) -> list[int]:
    det, out = new_detector(), []
    for i, (loss, g) in enumerate(zip(losses, norms)):
        if observe(det, step=i, loss=loss, grad_norm=g, cfg=cfg) is not None:
            out.append(i)
            det["streak"].clear()  # as after a rollback
    return out


def _early_curve(n: int, seed: int) -> tuple[list[float], list[float]]:
    """A pre-training start: the loss falls 10 -> ~2.1 with noise; the grad norm starts near 40 (initialisation,
    LR warm-up) and settles near 1 after ~30 steps, with noise."""
    rng = random.Random(seed)
    losses = [2.1 + 7.9 * math.exp(-i / 40) + rng.gauss(0, 0.05 + 0.3 * math.exp(-i / 60)) for i in range(n)]
    norms = [1.0 + 40.0 * math.exp(-i / 8) + abs(rng.gauss(0, 0.3)) for i in range(n)]
    return losses, norms


def test_high_early_grad_norms_raise_no_spike_and_a_later_one_is_caught():
    # failure.spike_grad_norm=5, tuned on the settled curve. Before the warm-up, the first 19 steps here were
    # spikes (and with no checkpoint before the first, a LossDiverged: the run stopped for good).
    cfg = FailureConfig(spike_grad_norm=5.0)
    losses, norms = _early_curve(400, seed=3)
    assert sum(g > 5.0 for g in norms[:50]) >= 10 and max(norms[200:]) < 5.0
    assert _spikes(losses, norms, cfg) == []
    assert _spikes(losses + [2.1], norms + [9.0], cfg) == [400]  # armed: the same threshold now catches it
    assert _spikes(losses + [2.1], norms + [9.0], FailureConfig()) == []  # 0 = off


def test_the_warm_up_is_spike_window_healthy_steps_for_both_checks():
    cfg = FailureConfig(spike_grad_norm=5.0, spike_window=4, spike_mad_k=0.0)
    flat = [3.0] * 4
    assert _spikes(flat[:3] + [3.0], [1.0, 1.0, 1.0, 50.0], cfg) == []  # 3 healthy steps seen: not armed
    assert _spikes(flat + [3.0], [1.0] * 4 + [50.0], cfg) == [4]
    assert _spikes(flat[:3] + [30.0], [1.0] * 4, cfg) == []  # the loss check: the same warm-up
    assert _spikes(flat + [30.0], [1.0] * 5, cfg) == [4]


def test_during_the_warm_up_a_high_grad_norm_still_asks_for_the_sdc_rerun_but_is_not_counted():
    # jobs/failure/sdc.py re-runs a suspicious step before its optimizer step: a flipped exponent bit (grad
    # norm ~1e36) at step 3 is found by the re-run whatever the warm-up; the same values again are the data's.
    cfg = FailureConfig(spike_grad_norm=1000.0)
    det = new_detector()
    for i in range(3):
        assert observe(det, step=i, loss=5.0, grad_norm=2.0, cfg=cfg) is None
    assert suspicious(det, loss=5.0, grad_norm=1e36, cfg=cfg)
    assert not suspicious(det, loss=5.0, grad_norm=999.0, cfg=cfg)
    assert observe(det, step=3, loss=5.0, grad_norm=1e36, cfg=cfg) is None and det["streak"] == []
    assert len(det["history"]) == 4


def test_an_opt_style_jump_after_a_realistic_start_is_caught_at_the_defaults_and_the_start_raises_none():
    # OPT-175B's logbook: a loss near 2.1 jumping to ~3.9, here after the fast-falling, noisy start above.
    for seed in range(5):
        losses, norms = _early_curve(400, seed=seed)
        assert _spikes(losses, norms, FailureConfig()) == [], seed
        assert _spikes(losses + [3.9], norms + [1.2], FailureConfig()) == [400], seed
        assert _spikes(losses + [2.6], norms + [1.2], FailureConfig()) == [], seed  # +0.5: within 1.5 x median
