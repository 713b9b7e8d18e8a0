"""Stragglers: a rank judged by its own history (the individual check), stops counted by their
mean, the GPU clock choice run on CPU through PhaseTimer's `events` seam, and a whole job slower than its baseline
reported as a `slowdown`, never as a straggler naming every rank. Synthetic timings throughout."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from jobs.telemetry.phases import PhaseTimer, phase_names
from jobs.telemetry.run_report import straggler_table
from jobs.telemetry.stragglers import HISTORY_WINDOWS, TOTAL, Detection, StepTelemetry, StragglerDetector

NAMES = phase_names(pp=False)  # data, forward, backward, collective, optimizer, checkpoint
P = len(NAMES)
D, F, B, O = (NAMES.index(n) for n in ("data", "forward", "backward", "optimizer"))


def _window(ranks: int = 4, scale: float = 1.0) -> np.ndarray:
    """Every rank 10 ms data, 100 ms forward, 200 ms backward, 5 ms collective, 20 ms optimizer."""
    return np.tile([0.010, 0.100, 0.200, 0.005, 0.020, 0.0], (ranks, 1)) * scale


def _stalled(rank: int, factor: float, ranks: int = 4) -> np.ndarray:
    """Host times with `rank`'s every phase `factor` times as long (a host stall spreads over its phases)."""
    h = _window(ranks)
    h[rank] *= factor
    return h


def test_a_rank_stalled_on_its_host_is_named_by_its_own_history_though_its_device_times_match_its_peers() -> None:
    """On a GPU the event clock grows alike on the stopped rank and on its peers waiting in NCCL (the peer check sees
    nothing), and the kernel clock does not grow at all; the stopped rank's host time grows against its own past."""
    d = StragglerDetector(NAMES, ratio=1.1, intervals=3)
    device = _window()  # alike on every rank, window after window
    for _ in range(HISTORY_WINDOWS):  # its own history first: nothing is judged without it
        assert d.observe(device, _window()) == []
    assert d.observe(device, _stalled(3, 1.3)) == []
    assert d.observe(device, _stalled(3, 1.3)) == []
    found = d.observe(device, _stalled(3, 1.3))  # each phase over the thresholds (data's 3 ms is not)
    assert [(x.check, x.ranks, x.phase) for x in found] == [
        ("individual", [3], "forward"),
        ("individual", [3], "backward"),
        ("individual", [3], "optimizer"),
    ]
    assert found[1] == Detection("individual", "backward", [3], pytest.approx(1.3), pytest.approx(0.26), 0.2)
    assert d.observe(device, _stalled(3, 1.3)) == []  # one event per streak


def test_the_individual_check_names_nobody_when_every_rank_grows_alike_or_a_rank_always_did_more() -> None:
    d = StragglerDetector(NAMES, ratio=1.1, intervals=1)
    uneven = _stalled(2, 1.5)  # rank 2 always 1.5x: more work (an MoE rank's busy experts), not a stop
    for _ in range(HISTORY_WINDOWS):
        d.observe(_window(), uneven)
    assert [x for x in d.observe(_window(), uneven) if x.check == "individual"] == []
    assert [x for x in d.observe(_window(), uneven * 1.5) if x.check == "individual"] == []  # the machine slowed
    # a peer that only waits for the others grows in its synchronising phases alike with them: not named either
    waits = uneven.copy()
    waits[:, F] *= 1.4
    assert [x for x in d.observe(_window(), waits) if x.check == "individual"] == []


def test_a_window_judged_slow_does_not_become_the_ranks_own_reference() -> None:
    """Ten slow windows in a row: had they entered the rank's history, its median would be the slow time and the
    next slow streak would go unseen."""
    d = StragglerDetector(NAMES, ratio=1.1, intervals=3)
    for _ in range(HISTORY_WINDOWS):
        d.observe(_window(), _window())
    first = [x for _ in range(10) for x in d.observe(_window(), _stalled(1, 1.5))]
    assert {(x.check, x.phase) for x in first} == {("individual", n) for n in ("forward", "backward", "optimizer")}
    assert all(x.ranks == [1] for x in first) and len(first) == 3
    assert d.observe(_window(), _window()) == []  # back to normal: the streak ends
    again = [x for _ in range(3) for x in d.observe(_window(), _stalled(1, 1.5))]
    assert [(x.phase, x.ranks, x.reference_s) for x in again if x.phase == "backward"] == [("backward", [1], 0.2)]


def test_stops_longer_than_a_step_count_by_their_mean_so_a_rank_stopped_a_third_of_the_time_is_named(
    tmp_path: Path,
) -> None:
    """A 300 ms stop in every third step of a 30 ms backward: the median of (CPU + stopped) per step is the CPU
    time alone (the stops land in fewer than half the steps), which named nobody in a 4-rank run with one rank
    stopped 30% of the time; CPU time's median plus the stops' mean is what the rank lost."""
    timers = [PhaseTimer(tmp_path, rank=r, attempt="a", pp=False) for r in range(4)]
    for step in range(1, 21):
        for r, t in enumerate(timers):
            t._cpu["backward"] = 0.030  # what `with timer.phase("backward")` measured
            t._desched["backward"] = 0.3 if r == 3 and step % 3 == 0 else 0.0  # the watcher's stopped seconds
            t.end_step(step)
    windows = np.array([t.take_window() for t in timers])  # [ranks x (clock, own_clock)]
    assert windows[3, B] == pytest.approx(0.030 + 6 * 0.3 / 20) and windows[0, B] == pytest.approx(0.030)
    assert windows[3, P + B] == windows[3, B] and timers[3].own_clock == "work"
    d = StragglerDetector(NAMES, ratio=1.1, intervals=1)
    (hit,) = d.observe(windows[:, :P], windows[:, P:])
    assert (hit.check, hit.ranks, hit.phase) == ("relative", [3], "backward")


class _KernelEvent:
    """A CUDA event on a device that spends 10 ms per phase whatever its host does (a host stall does not lengthen
    kernels): `elapsed_time` in ms, readable after `synchronize()`."""

    def __init__(self, enable_timing: bool) -> None:
        self.done = False

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        self.done = True

    def elapsed_time(self, end: _KernelEvent) -> float:
        assert end.done
        return 10.0


def test_a_cuda_timer_gives_the_peer_check_device_time_and_the_individual_check_host_time(tmp_path: Path) -> None:
    """The GPU clock choice through the one seam (`events`): a 200 ms host stall in one of four steps is not in the
    device time the peer check compares, and is in the host time the individual check compares."""
    t = PhaseTimer(tmp_path, rank=0, attempt="a", pp=False, device_type="cuda", events=_KernelEvent)
    for step in range(1, 5):
        with t.phase("forward"):
            if step == 2:
                time.sleep(0.2)  # the process was stopped or descheduled here
        t.end_step(step)
    w = t.take_window()
    assert w[F] == pytest.approx(0.010) and (t.clock, t.own_clock) == ("cuda", "host")
    assert 0.05 <= w[P + F] < 0.15  # the mean host seconds per step: 200 ms over 4 steps, plus the host's overhead
    assert np.isnan(t.take_window()).all()  # taken: nothing left


def test_every_rank_slower_than_the_baseline_is_one_slowdown_event_with_its_cause_and_no_straggler(
    tmp_path: Path,
) -> None:
    emitted = []
    slow = _window(ranks=3)
    slow[:, B] *= 2.0
    vals = iter([np.hstack([m, m]) for m in (_window(ranks=3), slow, slow, slow)])  # the first is warm-up
    base = {"data": 0.010, "forward": 0.100, "backward": 0.200, "optimizer": 0.020}
    st = StepTelemetry(
        PhaseTimer(tmp_path, rank=0, attempt="a", pp=False),
        StragglerDetector(NAMES, ratio=1.1, intervals=3, baseline=base),
        rank=0,
        nodes=["n0", "n0", "n1"],
        gather=lambda v: next(vals),
        emit=lambda kind, **f: emitted.append((kind, f)),
        baseline_path=tmp_path / "base.json",
        window_steps=1,
    )
    for step in range(1, 5):
        st.step_done(step, interval_end=True)
    ((kind, ev),) = emitted
    assert kind == "slowdown" and (ev["phase"], ev["ratio"], ev["step"], ev["clock"]) == ("backward", 2.0, 4, "work")
    assert ev["phases"] == {"data": 1.0, "forward": 1.0, "backward": 2.0, "optimizer": 1.0}
    assert ev["cause"].startswith("backward grew 2.00x") and "ranks" not in ev
    assert st.finish(healthy=True, about={}) is False  # a slow run does not become the baseline
    assert straggler_table([{"kind": kind, "attempt": "local.0", **ev}]).splitlines() == [
        "stragglers: none found",
        "slowdown at step 4 (local.0): " + ev["cause"],
    ]


def test_a_rank_whose_stops_land_in_another_phase_each_window_is_named_by_its_step_total_once() -> None:
    """A few 300 ms stops per window land in whichever phase the rank was in: forward in one window, backward in
    the next, optimizer in the third. No one phase is slow K windows in a row; their sum (TOTAL) is."""
    d = StragglerDetector(NAMES, ratio=1.1, intervals=3)
    found = []
    for phase in ("forward", "backward", "optimizer", "forward"):
        m = _window()
        m[3, NAMES.index(phase)] += 0.06  # 4 stops of 300 ms in a window of 20 steps
        found += d.observe(m)
    assert [(x.check, x.ranks, x.phase) for x in found] == [("relative", [3], TOTAL)]
    assert found[0].seconds == pytest.approx(0.33 + 0.06) and found[0].reference_s == pytest.approx(0.33)
    d = StragglerDetector(NAMES, ratio=1.1, intervals=3)  # slow in one phase throughout: named by it, not twice
    slow = _window()
    slow[2, B] += 0.06
    assert [(x.ranks, x.phase) for _ in range(4) for x in d.observe(slow)] == [([2], "backward")]
