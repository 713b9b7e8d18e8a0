"""Phase timer, its HDF5 file, the straggler detectors on hand-made numbers, the baseline, TensorBoard scalars."""

from __future__ import annotations

import json
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from jobs.config import compose
from jobs.telemetry.phases import PhaseTimer, SlowPhase, phase_names, slow_phase_from_env
from jobs.telemetry.run_report import read_phases, straggler_table
from jobs.telemetry.stragglers import (
    Slowdown,
    StepTelemetry,
    StragglerDetector,
    baseline_key,
    read_baseline,
    write_baseline,
)
from jobs.validate import validate

NAMES = phase_names(pp=False)  # data, forward, backward, collective, optimizer, checkpoint
F, B, C = NAMES.index("forward"), NAMES.index("backward"), NAMES.index("collective")


def _interval(ranks: int = 4, **slow: tuple[int, float]) -> np.ndarray:
    """Every rank 10 ms data, 100 ms forward, 200 ms backward, 5 ms collective, 20 ms optimizer; `slow`
    multiplies one rank's phase: backward=(2, 1.3)."""
    m = np.tile([0.010, 0.100, 0.200, 0.005, 0.020, 0.0], (ranks, 1))
    for phase, (rank, factor) in slow.items():
        m[rank, NAMES.index(phase)] *= factor
    return m


def _both(m: np.ndarray) -> np.ndarray:
    """A window as the all-reduce carries it: every rank's row on `clock`, then on `own_clock` (alike here)."""
    return np.hstack([m, m])


def test_pp_runs_time_the_schedule_step_as_one_phase() -> None:
    assert NAMES == ("data", "forward", "backward", "collective", "optimizer", "checkpoint")
    assert phase_names(pp=True) == ("data", "pp_step", "collective", "optimizer", "checkpoint")


def test_relative_names_the_slow_rank_and_phase_at_the_kth_consecutive_interval_only() -> None:
    d = StragglerDetector(NAMES, ratio=1.1, intervals=3)
    assert d.observe(_interval(backward=(2, 1.3))) == []
    assert d.observe(_interval(backward=(2, 1.3))) == []
    (hit,) = d.observe(_interval(backward=(2, 1.3)))
    assert (hit.check, hit.phase, hit.ranks) == ("relative", "backward", [2])
    assert hit.ratio == pytest.approx(1.3) and hit.reference_s == pytest.approx(0.2)
    assert d.observe(_interval(backward=(2, 1.3))) == []  # one event per streak


def test_a_streak_broken_by_one_normal_interval_starts_again() -> None:
    d = StragglerDetector(NAMES, ratio=1.1, intervals=3)
    seen = [d.observe(_interval(backward=(1, f))) for f in (1.3, 1.3, 1.0, 1.3, 1.3)]
    assert all(s == [] for s in seen)
    assert [h.ranks for h in d.observe(_interval(backward=(1, 1.3)))] == [[1]]


def test_below_the_ratio_or_the_minimum_difference_nothing_is_named() -> None:
    d = StragglerDetector(NAMES, ratio=1.1, intervals=1, min_diff_s=0.005)
    assert d.observe(_interval(backward=(0, 1.09))) == []  # 218 ms vs 200: under 1.1x
    assert d.observe(_interval(data=(0, 1.4))) == []  # 14 ms vs 10: 1.4x but only 4 ms
    assert d.observe(_interval(collective=(0, 5.0))) == []  # waiting for peers is not judged
    assert [h.phase for h in d.observe(_interval(data=(0, 1.6)))] == ["data"]  # 6 ms


def test_a_peers_wait_in_a_later_phase_is_not_named_only_the_rank_with_the_largest_excess() -> None:
    d = StragglerDetector(NAMES, ratio=1.1, intervals=1)
    m = _interval(ranks=2, backward=(1, 1.3))  # rank 1: +60 ms in backward
    m[0, F] *= 1.2  # rank 0 waited 20 ms of it inside the next microbatch's forward (an FSDP all-gather)
    assert [(h.ranks, h.phase) for h in d.observe(m)] == [([1], "backward")]


def test_pipeline_stages_are_compared_only_with_ranks_of_the_same_stage() -> None:
    m = _interval(ranks=4)
    m[2:, B] *= 1.5  # stage 1 (ranks 2, 3: the output layer and the loss) does more work than stage 0
    assert StragglerDetector(NAMES, intervals=1, groups=[0, 0, 1, 1]).observe(m) == []
    m[3, B] *= 1.3
    assert [(h.ranks, h.phase) for h in StragglerDetector(NAMES, intervals=1, groups=[0, 0, 1, 1]).observe(m)] == [
        ([3], "backward")
    ]


def test_every_rank_slower_than_the_baseline_is_a_slowdown_naming_the_phase_that_grew_never_a_straggler() -> None:
    base = {"data": 0.010, "forward": 0.100, "backward": 0.200, "optimizer": 0.020}
    d = StragglerDetector(NAMES, ratio=1.1, intervals=2, baseline=base)
    slow = _interval()
    slow[:, B] *= 1.3
    assert d.observe(slow, slow) == []
    (hit,) = d.observe(slow, slow)  # not a Detection naming every rank
    assert isinstance(hit, Slowdown) and (hit.phase, round(hit.ratio, 6)) == ("backward", 1.3)
    assert hit.phases == {"data": 1.0, "forward": 1.0, "backward": 1.3, "optimizer": 1.0}
    assert StragglerDetector(NAMES, ratio=1.1, intervals=1, baseline=base).observe(_interval()) == []


def test_baseline_round_trips_atomically_and_its_key_separates_shapes(tmp_path: Path) -> None:
    path = tmp_path / "b" / baseline_key(model="tiny", mesh="dp_shard2", cluster="local", shape={"global_batch": 8})
    assert read_baseline(path) is None
    write_baseline(path, {"forward": 0.1}, clock="cpu")
    assert read_baseline(path) == {"forward": 0.1} and [p.name for p in path.parent.iterdir()] == [path.name]
    other = baseline_key(model="tiny", mesh="dp_shard2", cluster="local", shape={"global_batch": 16})
    assert other != path.name and other.startswith("tiny_dp_shard2_local_")


def test_the_baseline_is_the_median_of_the_last_healthy_runs_so_one_slower_run_does_not_become_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "base.json"
    for fwd in (0.100, 0.102, 0.098):
        write_baseline(path, {"forward": fwd, "backward": 0.2}, run_dir=f"r{fwd}")
    # a run 15% slower that no check judged (fewer than K intervals over the ratio) is recorded, but the
    # reference moves only to the median of the four (0.101), not to 0.115
    assert write_baseline(path, {"forward": 0.115, "backward": 0.2}, run_dir="slow") == pytest.approx(
        {"forward": 0.101, "backward": 0.2}
    )
    assert read_baseline(path) == pytest.approx({"forward": 0.101, "backward": 0.2})
    for _ in range(5):  # only the last BASELINE_RUNS runs count: a lasting change is followed
        write_baseline(path, {"forward": 0.130, "backward": 0.2})
    data = json.loads(path.read_text())
    assert data["phases_s"]["forward"] == pytest.approx(0.130) and len(data["runs"]) == 5


def test_slow_phase_knob_applies_to_its_rank_or_all() -> None:
    env = {"MESHJOB_TEST_SLOW_PHASE": "1:backward:1.3"}
    assert slow_phase_from_env(0, env) is None
    assert slow_phase_from_env(1, env) == SlowPhase(1, "backward", 1.3)
    assert slow_phase_from_env(5, {"MESHJOB_TEST_SLOW_PHASE": "all:forward:2"}) == SlowPhase(None, "forward", 2.0)
    with pytest.raises(ValueError, match="not one of"):
        slow_phase_from_env(0, {"MESHJOB_TEST_SLOW_PHASE": "0:fwd:2"})


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_timer_times_phases_and_the_knob_makes_its_phase_factor_times_as_long(tmp_path: Path) -> None:
    t = PhaseTimer(tmp_path, rank=0, attempt="a", pp=False, slow=SlowPhase(0, "backward", 2.0))
    for step in (1, 2):
        with t.phase("forward"):
            _spin(0.02)
        with t.phase("backward"):
            _spin(0.02)
        t.end_step(step)
    cpu = t.take_interval()  # CPU seconds (what stragglers judge on a CPU rank)
    assert 0.018 < cpu[F] < 0.03 and cpu[B] / cpu[F] == pytest.approx(2.0, rel=0.25)
    assert cpu[NAMES.index("optimizer")] == 0.0 and np.isnan(t.take_interval()).all()


def test_a_rolled_back_steps_phases_do_not_leak_into_the_next_step(tmp_path: Path) -> None:
    t = PhaseTimer(tmp_path, rank=0, attempt="a", pp=False)
    with t.phase("forward"):
        _spin(0.03)
    t.drop_step()  # the training-health check rolled this step back
    with t.phase("forward"):
        _spin(0.01)
    t.end_step(1)
    assert t.take_interval()[F] < 0.02


def test_flushes_append_rows_and_a_restarted_attempt_appends_under_its_own_index(tmp_path: Path) -> None:
    for attempt, steps in (("job.0", (1, 2, 3)), ("job.1", (3, 4))):
        t = PhaseTimer(tmp_path, rank=3, attempt=attempt, pp=False)
        for step in steps:
            with t.phase("data"):
                pass
            t.end_step(step)
            if step % 2 == 0:
                t.flush()
        t.flush()
    with h5py.File(tmp_path / "telemetry" / "rank3.h5", "r") as f:
        assert json.loads(f.attrs["attempts"]) == ["job.0", "job.1"]
        assert f["step"][:].tolist() == [1, 2, 3, 3, 4] and f["attempt"][:].tolist() == [0, 0, 0, 1, 1]
        assert set(f) == {*NAMES, "step", "attempt", "time", "cpu"} and f["cpu"].shape == (5, len(NAMES))
        assert json.loads(f["cpu"].attrs["phases"]) == list(NAMES)
        assert f["data"].chunks is not None and f["data"].maxshape == (None,)
    assert set(read_phases(tmp_path / "telemetry")[3]) == set(NAMES)  # step/attempt/time/cpu are not phases


def test_a_reader_during_a_flush_sees_only_whole_rows(tmp_path: Path) -> None:
    from jobs.telemetry import phases

    t = PhaseTimer(tmp_path, rank=0, attempt="a", pp=False)
    for step in (1, 2, 3):
        t.end_step(step)
    t.flush()
    path = tmp_path / "telemetry" / "rank0.h5"
    with h5py.File(path, "a") as f:  # a flush of 4 rows caught after every phase but before `step`
        for name in f:
            if name != "step":
                f[name].resize(7, axis=0)
                f[name][3:] = 100.0
        f["step"].resize(7, axis=0)  # resized, its fill (-1) not yet overwritten
        assert phases.committed_rows(f) == 3
    assert read_phases(tmp_path / "telemetry")[0]["data"] == 0.0  # not the half-written rows' 100 s

    written = []

    class _Recorder(dict):  # the order in which _append writes datasets
        def create_dataset(self, name, **kw):
            ds = _Dataset(name, written)
            self[name] = ds
            return ds

    class _Dataset:
        def __init__(self, name, log):
            self.name, self.log, self.shape = name, log, (0,)

        def resize(self, n, axis=0):
            self.shape = (n,)

        def __setitem__(self, key, value):
            self.log.append(self.name)

    phases._append(_Recorder(), {"step": [1], "time": [0.0], "attempt": [0], "data": [0.1], "forward": [0.2]})
    assert written[-1] == "step" and sorted(written) == ["attempt", "data", "forward", "step", "time"]


def test_a_phase_another_attempt_did_not_time_is_nan_and_ignored_by_the_report(tmp_path: Path) -> None:
    for attempt, pp in (("a", False), ("b", True)):  # resumed on a pipeline mesh
        t = PhaseTimer(tmp_path, rank=0, attempt=attempt, pp=pp)
        with t.phase("pp_step" if pp else "forward"):
            time.sleep(0.01 if pp else 0.002)
        t.end_step(1)
        t.flush()
    with h5py.File(tmp_path / "telemetry" / "rank0.h5", "r") as f:
        assert np.isnan(f["forward"][1]) and np.isnan(f["pp_step"][0]) and f["pp_step"][1] >= 0.01
        assert f["cpu"].shape == (2, 6) and np.isnan(f["cpu"][1]).all()  # the pp attempt's 5 columns do not fit
        forward, pp_step = float(f["forward"][0]), float(f["pp_step"][1])
    assert read_phases(tmp_path / "telemetry")[0] | {} == pytest.approx(
        {
            "data": 0.0,
            "forward": forward,
            "pp_step": pp_step,
            "collective": 0.0,
            "optimizer": 0.0,
            "checkpoint": 0.0,
            "backward": 0.0,
        }
    )  # the median of the rows that have the phase; NaN rows left out


def test_step_telemetry_gathers_once_per_interval_skips_warm_up_and_reports_on_rank_0(tmp_path: Path) -> None:
    emitted, gathered, quarantined = [], [], []

    def gather(vec):  # 3 ranks; rank 2's backward 1.5x (CPU seconds of this timer are ~0: fake them)
        gathered.append(vec)
        return _both(_interval(ranks=3, backward=(2, 1.5)))

    t = PhaseTimer(tmp_path, rank=0, attempt="a", pp=False)
    st = StepTelemetry(
        t,
        StragglerDetector(NAMES, intervals=2),
        rank=0,
        nodes=["n0", "n0", "n1"],
        gather=gather,
        emit=lambda kind, **f: emitted.append((kind, f)),
        baseline_path=tmp_path / "base.json",
        on_straggler=lambda nodes, d: quarantined.append(nodes),
        window_steps=2,
    )
    for step in range(1, 9):
        st.step_done(step, interval_end=step % 2 == 0)
    assert len(gathered) == 4  # one gather per interval, none per step
    ((kind, ev),) = emitted  # interval 1 is warm-up; intervals 2 and 3 make the streak of 2
    assert (
        kind == "straggler" and ev["step"] == 6 and (ev["ranks"], ev["nodes"], ev["phase"]) == ([2], ["n1"], "backward")
    )
    assert ev["clock"] == "work" and quarantined == [["n1"]]
    assert st.finish(healthy=True, about={}) is False  # a run with a straggler writes no baseline
    assert "relative  backward   2" in straggler_table([{"kind": kind, **ev}])


@pytest.mark.parametrize("rank", [0, 1])
def test_phase_times_ride_in_the_steps_all_reduce_at_window_ends_only_and_only_rank_0_judges(
    tmp_path: Path, rank: int
) -> None:
    def gather(vec):
        raise AssertionError("a collective of its own")

    emitted = []
    t = PhaseTimer(tmp_path, rank=rank, attempt="a", pp=False)
    st = StepTelemetry(
        t,
        StragglerDetector(NAMES, intervals=2),
        rank=rank,
        nodes=["n0", "n1", "n2"],
        gather=gather,
        emit=lambda kind, **f: emitted.append(kind),
        baseline_path=None,
        window_steps=4,
    )
    for step in range(1, 17):
        end = step % 2 == 0  # train.log_every=2: a window is two log intervals
        out = st.outgoing(interval_end=end)
        assert (out is None) == (step % 4 != 0), step
        if out is not None:  # what the trainer's all-reduce returns: every rank's row; ours sits in row `rank`
            assert out.shape == (3 * 2 * len(NAMES),) and not np.delete(out.reshape(3, -1), rank, axis=0).any()
            st.incoming(_both(_interval(ranks=3, backward=(2, 1.5))).ravel())
        st.step_done(step, interval_end=end)
    # rank 0: named once, after windows 2 and 3 (1 is warm-up); rank 1 sends its row and judges nothing
    assert [d.ranks for d in st.found] == ([[2]] if rank == 0 else [])
    assert emitted == (["straggler"] if rank == 0 else [])


def test_a_window_spans_at_least_window_steps_whatever_the_log_interval(tmp_path: Path) -> None:
    """train.log_every=1 (the default) judged every single step: per-step noise named healthy ranks."""
    sent = []
    t = PhaseTimer(tmp_path, rank=0, attempt="a", pp=False)
    st = StepTelemetry(
        t,
        StragglerDetector(NAMES, intervals=3),
        rank=0,
        nodes=["n0", "n1"],
        gather=None,
        emit=lambda kind, **f: None,
        baseline_path=None,
    )
    assert st.window_steps == 20
    for step in range(1, 101):  # log_every=1: every step ends a log interval
        out = st.outgoing(interval_end=True)
        if out is not None:
            sent.append(step)
            st.incoming(_both(_interval(ranks=2)).ravel())
        st.step_done(step, interval_end=True)
    assert sent == [20, 40, 60, 80, 100]
    t2 = PhaseTimer(tmp_path, rank=0, attempt="b", pp=False)
    st2 = StepTelemetry(
        t2, StragglerDetector(NAMES), rank=0, nodes=["n0", "n1"], gather=None, emit=None, baseline_path=None
    )
    ends = []
    for step in range(1, 101):  # log_every=16 in a 100-step run
        if st2.outgoing(interval_end=step % 16 == 0 or step == 100) is not None:
            ends.append(step)
            st2.incoming(_both(_interval(ranks=2)).ravel())
        st2.step_done(step, interval_end=step % 16 == 0 or step == 100)
    assert ends == [32, 64, 96]  # log_every=16: the interval end that completes 20 steps; 97-100 is not judged


def test_a_healthy_run_logging_every_step_names_nobody_though_single_steps_are_noisy(tmp_path: Path) -> None:
    """Two ranks at the defaults (train.log_every=1, ratio 1.1, K=3) whose per-step backward CPU times are what a
    2-core box gives (29-68 ms around 45; neither rank slower on average), through the timers, the window and the
    all-reduce as the trainer drives them. Judged per step, this named a healthy rank."""
    steps = np.random.default_rng(7).uniform(0.029, 0.068, size=(200, 2))  # [steps x ranks] backward seconds
    timers = [PhaseTimer(tmp_path, rank=r, attempt="a", pp=False) for r in (0, 1)]
    emitted = []
    tel = [
        StepTelemetry(
            t,
            StragglerDetector(NAMES),
            rank=r,
            nodes=["n0", "n1"],
            gather=None,
            emit=lambda kind, **f: emitted.append(f),
            baseline_path=None,
        )
        for r, t in enumerate(timers)
    ]
    for i, row in enumerate(steps, start=1):
        outs = [st.outgoing(interval_end=True) for st in tel]
        if outs[0] is not None:
            for st in tel:
                st.incoming(outs[0] + outs[1])  # the trainer's all-reduce
        for st, t, v in zip(tel, timers, row):
            t._cpu["backward"] = v  # what `with timer.phase("backward")` measured in this step
            st.step_done(i, interval_end=True)
    assert emitted == [] and tel[0].found == []


def test_the_vectorised_peer_median_is_every_other_rank_of_the_group_and_fast_at_2048_ranks() -> None:
    import time as _time

    from jobs.telemetry.stragglers import peer_medians

    rng = np.random.default_rng(0)
    for n, groups in ((2, None), (5, None), (6, None), (7, [0, 0, 1, 1, 1, 2, 0])):
        m = rng.random((n, len(NAMES)))
        m[1] = m[0]  # ties
        g = groups or [0] * n
        want = np.array(
            [
                np.median(m[[q for q in range(n) if q != r and g[q] == g[r]]], axis=0)
                if sum(x == g[r] for x in g) > 1
                else np.full(len(NAMES), np.nan)
                for r in range(n)
            ]
        )
        np.testing.assert_allclose(peer_medians(m, groups), want)
    m = rng.uniform(0.1, 0.2, size=(2048, len(NAMES)))
    t0 = _time.process_time()  # CPU time: other processes on a shared box do not count
    StragglerDetector(NAMES, groups=[r // 256 for r in range(2048)]).observe(m)
    assert _time.process_time() - t0 < 0.5  # ~0.03 s; the Python double loop took 1.5 s per interval


def test_flushes_are_throttled_to_min_interval_but_none_is_lost(tmp_path: Path) -> None:
    t = PhaseTimer(tmp_path, rank=0, attempt="a", pp=False)
    for step in (1, 2, 3):
        t.end_step(step)
        t.flush(min_interval_s=3600)  # only the first one writes
    with h5py.File(tmp_path / "telemetry" / "rank0.h5", "r") as f:
        assert list(f["step"][:]) == [1]
    t.flush()  # the end of the attempt: everything
    with h5py.File(tmp_path / "telemetry" / "rank0.h5", "r") as f:
        assert list(f["step"][:]) == [1, 2, 3]


def test_a_healthy_run_writes_the_median_of_its_judged_intervals_as_baseline(tmp_path: Path) -> None:
    t = PhaseTimer(tmp_path, rank=0, attempt="a", pp=False)
    vals = iter([_both(_interval(ranks=2)) * f for f in (9.0, 1.0, 1.2, 1.1)])  # the first (warm-up) is left out
    st = StepTelemetry(
        t,
        StragglerDetector(NAMES),
        rank=0,
        nodes=["n", "n"],
        gather=lambda v: next(vals),
        emit=None,
        baseline_path=tmp_path / "base.json",
        window_steps=1,
    )
    for step in range(1, 5):
        st.step_done(step, interval_end=True)
    assert st.finish(healthy=False, about={}) is False and not (tmp_path / "base.json").exists()
    assert st.finish(healthy=True, about={"steps": 4}) is True
    got = read_baseline(tmp_path / "base.json")
    assert got == pytest.approx({"data": 0.011, "forward": 0.11, "backward": 0.22, "optimizer": 0.022})


def test_straggler_thresholds_that_cannot_work_are_config_errors() -> None:
    with pytest.raises(ValueError, match=r"failure.straggler_ratio\(1.0\) must be > 1"):
        validate(compose(["mesh=single", "launcher.tasks_per_node=1", "failure.straggler_ratio=1.0", "run.dir=x"]))


def test_tensorboard_asked_for_but_not_installed_is_a_config_error_naming_both_fixes(monkeypatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    cfg = compose(["mesh=single", "launcher.tasks_per_node=1", "metrics.tensorboard=true", "run.dir=x"])
    with pytest.raises(ValueError, match=r"pip install tensorboard.*metrics.tensorboard=false"):
        validate(cfg)
    cfg.metrics.tensorboard = False
    validate(cfg)


def test_tensorboard_scalars_read_back_with_event_accumulator(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jobs.telemetry.tensorboard import ScalarLog

    log = ScalarLog(tmp_path)
    for step, loss in ((1, 5.5), (2, 4.25)):
        log.write(
            {
                "step": step,
                "loss": loss,
                "lr": 0.01,
                "tokens_per_s": 900.0,
                "stop": False,
                "restart": 0,
                "attempt": "local.0",
                "time": 1.0e9 + step,
            }
        )
    log.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert set(acc.Tags()["scalars"]) == {"loss", "lr", "tokens_per_s"}
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [(1, 5.5), (2, 4.25)]


class _FakeEvent:
    """A CUDA event on a fake clock: `elapsed_time` in ms, readable only after `synchronize()`."""

    clock_ms = 0.0
    synced: list[_FakeEvent] = []

    def __init__(self, enable_timing: bool) -> None:
        self.at, self.done = None, False

    def record(self) -> None:
        self.at = _FakeEvent.clock_ms

    def synchronize(self) -> None:
        self.done = True
        _FakeEvent.synced.append(self)

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert end.done, "read before synchronize()"
        return end.at - self.at


def test_on_cuda_phases_are_event_pairs_read_only_at_the_log_interval(tmp_path: Path) -> None:
    t = PhaseTimer(tmp_path, rank=0, attempt="a", pp=False, device_type="cuda", events=_FakeEvent)
    for step, ms in ((1, 30.0), (2, 50.0)):
        with t.phase("forward"):
            _FakeEvent.clock_ms += ms
        with t.phase("backward"):
            _FakeEvent.clock_ms += 2 * ms
        t.end_step(step)
    assert _FakeEvent.synced == []  # no synchronize per step
    t.flush()
    assert len(_FakeEvent.synced) == 4
    assert t.take_interval()[[F, B]].tolist() == pytest.approx([0.04, 0.08])  # medians of (30, 50) and (60, 100) ms
    with h5py.File(tmp_path / "telemetry" / "rank0.h5", "r") as f:
        assert f["forward"][:].tolist() == pytest.approx([0.03, 0.05]) and "cpu" not in f
    assert t.clock == "cuda"


def test_exclude_stragglers_puts_the_relative_stragglers_node_on_the_quarantine_list(tmp_path: Path) -> None:
    import torch

    from jobs.events import EventLog
    from jobs.failure.quarantine import quarantined
    from jobs.launch.env import DistEnv
    from jobs.telemetry.rank_telemetry import baseline_path, build_step_telemetry
    from jobs.telemetry.stragglers import Detection

    cfg = compose(
        [
            "mesh=single",
            "launcher.tasks_per_node=1",
            f"run.dir={tmp_path}",
            f"cluster.run_root={tmp_path}",
            "failure.exclude_stragglers=true",
        ]
    )
    env = DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        nodes=1,
        master_addr="x",
        master_port=0,
        hostname="node7",
    )
    st = build_step_telemetry(
        cfg,
        env,
        events=EventLog(tmp_path / "events.jsonl"),
        pp=False,
        mesh="single",
        device=torch.device("cpu"),
        mixed_precision="fp32",
    )
    assert st.baseline_path == baseline_path(cfg, mesh="single", device="cpu", mixed_precision="fp32", clock="work")
    assert st.baseline_path.parent == tmp_path / "baselines"  # ${cluster.run_root}/baselines
    st.on_straggler(["node7"], Detection("relative", "backward", [0], 1.3, 0.13, 0.1))
    (entry,) = quarantined(tmp_path)
    assert entry["node"] == "node7" and "straggler: backward 1.30x" in entry["reason"]
    cfg.failure.exclude_stragglers = False
    assert (
        build_step_telemetry(
            cfg,
            env,
            events=EventLog(tmp_path / "e.jsonl"),
            pp=False,
            mesh="single",
            device=torch.device("cpu"),
            mixed_precision="fp32",
        ).on_straggler
        is None
    )
