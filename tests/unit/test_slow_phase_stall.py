"""The test seam's fixed-stall form (MESHJOB_TEST_SLOW_PHASE="<rank|all>:<phase>:+<seconds>"): a floor on a phase's time."""

from __future__ import annotations

import time

from jobs.telemetry.phases import PhaseTimer, SlowPhase, slow_phase_from_env


def test_the_plus_form_is_a_fixed_stall_for_its_rank_or_all() -> None:
    assert slow_phase_from_env(3, {"MESHJOB_TEST_SLOW_PHASE": "all:optimizer:+0.7"}) == SlowPhase(None, "optimizer", 1.0, 0.7)
    assert slow_phase_from_env(0, {"MESHJOB_TEST_SLOW_PHASE": "1:optimizer:+0.7"}) is None


def test_a_stalled_phase_lasts_at_least_the_stall_whatever_its_work(tmp_path) -> None:
    timer = PhaseTimer(tmp_path, rank=0, attempt="0", pp=False, slow=SlowPhase(None, "optimizer", 1.0, 0.2))
    t0 = time.perf_counter()
    with timer.phase("optimizer"):
        pass
    with timer.phase("forward"):  # another phase is not stalled
        pass
    assert time.perf_counter() - t0 >= 0.2
    assert timer._row["optimizer"] >= 0.2 and timer._row["forward"] < 0.1
