"""Training health at unit level: the spike detector on hand-made loss sequences, the step -> data step map,
the rollback record and the resume that repeats it (jobs/failure/spike.py)."""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch

from checkpoint import TrainState
from jobs.config import FailureConfig
from jobs.events import EventLog
from jobs.failure.spike import (
    LossDiverged,
    TrainingHealth,
    check_config,
    data_step,
    new_detector,
    observe,
    parse_corrupt,
    skip_entries,
)

NAN, INF = float("nan"), float("inf")


def _feed(
    losses: list[float],
    cfg: FailureConfig,
    grad_norms: list[float] | None = None,
    det: dict | None = None,
    start: int = 0,
) -> list[tuple[int, str, int, int]]:
    """(step, cls, first, last) of every spike the detector confirms along the sequence."""
    det = new_detector() if det is None else det
    out = []
    for i, loss in enumerate(losses):
        g = 1.0 if grad_norms is None else grad_norms[i]
        s = observe(det, step=start + i, loss=loss, grad_norm=g, cfg=cfg)
        if s is not None:
            out.append((start + i, s.cls, s.first, s.last))
            det["streak"].clear()  # as after a rollback: the next step starts a new streak
    return out


def test_a_loss_above_factor_times_the_running_median_is_a_spike_once_the_window_is_full():
    cfg = FailureConfig(spike_factor=2.0, spike_window=3, spike_mad_k=0.0)  # the ratio alone
    assert _feed([10.0, 1.0, 30.0], cfg) == []  # not armed: fewer than spike_window losses seen
    assert _feed([4.0, 4.0, 4.0, 8.0], cfg) == []  # 8 is not > 2 x 4
    assert _feed([4.0, 4.0, 4.0, 8.01], cfg) == [(3, "loss_spike", 3, 3)]
    assert _feed([5.0, 3.0, 4.0, 8.5, 9.0], cfg) == [(3, "loss_spike", 3, 3), (4, "loss_spike", 4, 4)]
    assert _feed([4.0] * 3, FailureConfig(spike_factor=0.0, spike_window=3)) == []
    assert _feed([4.0, 4.0, 4.0, 100.0], FailureConfig(spike_factor=0.0, spike_window=3)) == []  # 0 = off


def test_patience_needs_consecutive_spiking_steps_and_a_broken_streak_stays_out_of_the_median():
    cfg = FailureConfig(spike_factor=2.0, spike_window=3, spike_patience=2)
    # 9 at step 3 is suspicious, step 4 is healthy (streak broken), steps 5 and 6 confirm: first 5, last 6.
    # Had the 9 entered the window, the median of (4, 9, 4) would still be 4; (9, 4, 9) would be 9 and hide it.
    assert _feed([4.0, 4.0, 4.0, 9.0, 4.0, 9.0, 9.0], cfg) == [(6, "loss_spike", 5, 6)]
    det = new_detector()
    _feed([4.0, 4.0, 4.0, 9.0, 4.0, 9.0], cfg, det=det)
    assert det["history"] == [4.0, 4.0, 4.0] and det["streak"] == [[5, 9.0, 1.0]]


def test_a_non_finite_loss_or_grad_norm_is_a_spike_at_once_even_before_the_window_fills():
    cfg = FailureConfig(spike_factor=2.0, spike_window=50, spike_patience=3)
    assert _feed([5.0, NAN], cfg) == [(1, "non_finite_loss", 1, 1)]
    assert _feed([5.0, INF], cfg) == [(1, "non_finite_loss", 1, 1)]
    assert _feed([5.0, -INF], cfg) == [(1, "non_finite_loss", 1, 1)]
    assert _feed([5.0, 5.0], cfg, grad_norms=[1.0, NAN]) == [(1, "non_finite_loss", 1, 1)]
    # NaN in the middle of a loss-spike streak: the spike began where the streak did.
    cfg3 = FailureConfig(spike_factor=2.0, spike_window=2, spike_patience=3)
    assert _feed([1.0, 1.0, 5.0, NAN], cfg3) == [(3, "non_finite_loss", 2, 3)]


def test_a_grad_norm_above_spike_grad_norm_is_a_spike_and_zero_turns_it_off():
    losses, norms = [4.0] * 5, [1.0, 1.0, 1.0, 1.0, 7.5]
    assert _feed(losses, FailureConfig(spike_grad_norm=5.0, spike_window=3), grad_norms=norms) == [
        (4, "loss_spike", 4, 4)
    ]
    assert _feed(losses, FailureConfig(spike_grad_norm=0.0, spike_window=3), grad_norms=norms) == []


def test_the_detector_state_survives_a_checkpoint_round_trip_mid_streak():
    # A checkpoint saved between two spiking steps (patience 2) resumes the streak: the same spike, same steps.
    cfg = FailureConfig(spike_factor=2.0, spike_window=3, spike_patience=2)
    seq = [4.0, 4.0, 4.0, 9.0, 9.0]
    whole = _feed(seq, cfg)
    st = TrainState()
    st.health["detector"] = new_detector()
    assert _feed(seq[:4], cfg, det=st.health["detector"]) == []
    again = TrainState()
    again.load_state_dict(pickle.loads(pickle.dumps(st.state_dict())))
    assert whole == [(4, "loss_spike", 3, 4)] == _feed(seq[4:], cfg, det=again.health["detector"], start=4)


def test_every_rank_decides_alike_on_the_same_all_reduced_numbers_nan_included():
    # Ranks hold bitwise-equal floats after the all-reduce; the decision is a pure function of them, and a
    # NaN (which is unequal to itself) never reaches a comparison that could differ.
    cfg = FailureConfig(spike_factor=1.5, spike_window=4, spike_patience=2)
    seq = [5.0, 4.5, 4.4, 4.6, 7.1, 4.3, 7.2, NAN, 4.2, 4.1, 4.0, 3.9, 6.5, 6.6]
    a, b = new_detector(), new_detector()
    assert (
        _feed(seq, cfg, det=a)
        == _feed(list(seq), cfg, det=b)
        == [(7, "non_finite_loss", 6, 7), (13, "loss_spike", 12, 13)]
    )
    assert pickle.dumps(a) == pickle.dumps(b)


def test_the_data_step_map_shifts_every_step_from_the_skip_on_and_a_later_rollback_replaces_the_timeline():
    recs = [{"from_step": 32, "data_step": 34}, {"from_step": 49, "data_step": 53}]
    e = skip_entries(recs)
    assert [data_step(i, e) for i in (0, 31, 32, 33, 48, 49, 59)] == [0, 31, 34, 35, 50, 53, 63]
    # A second rollback to a checkpoint before the first skip's step: that skip's timeline is redone under the new one.
    e2 = skip_entries([{"from_step": 45, "data_step": 47}, {"from_step": 41, "data_step": 50}])
    assert e2 == [(41, 50)] and [data_step(i, e2) for i in (40, 41, 45)] == [40, 50, 54]
    assert data_step(7, []) == 7


def test_the_corrupt_knob_parses_data_steps_and_kinds():
    assert parse_corrupt("12, nan:20,tokens:3") == {12: "tokens", 20: "nan", 3: "tokens"}
    assert parse_corrupt("") == {}
    with pytest.raises(ValueError, match="MESHJOB_TEST_CORRUPT_DATA_STEP"):
        parse_corrupt("inf:4")


@pytest.mark.parametrize(
    "override,match",
    [
        (dict(spike_factor=0.5), "failure.spike_factor"),
        (dict(spike_window=0), "failure.spike_window"),
        (dict(spike_lr_scale=0.0), "failure.spike_lr_scale"),
        (dict(max_rollbacks=-1), "failure.max_rollbacks"),
    ],
)
def test_bad_spike_keys_are_config_errors_naming_the_override(override, match):
    with pytest.raises(ValueError, match=match.replace(".", r"\.")):
        check_config(FailureConfig(**override))


class _Fake:
    """A model with a LambdaLR whose multiplier reads the health's LR scale (as the trainer's does), and a
    load() that records what it was asked and restores a saved state."""

    def __init__(self, health: TrainingHealth, st: TrainState, ckpts: dict[int, dict]) -> None:
        self.param = torch.nn.Parameter(torch.zeros(2))
        self.opt = torch.optim.AdamW([self.param], lr=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (s + 1) * health.lr_scale)
        self.st, self.ckpts, self.asked = st, ckpts, []

    def load(self, before_step: int | None = None) -> int:
        self.asked.append(before_step)
        ok = [s for s in self.ckpts if before_step is None or s < before_step]
        if not ok:
            return 0
        self.st.load_state_dict(pickle.loads(pickle.dumps(self.ckpts[max(ok)])))
        return max(ok)


def _health(tmp_path: Path, **cfg) -> TrainingHealth:
    ev = EventLog(tmp_path / "events.jsonl", attempt="local.0")
    return TrainingHealth(
        FailureConfig(**cfg),
        rank=0,
        run_dir=str(tmp_path),
        attempt="local.0",
        emit=ev.emit,
        events_path=ev.path,
        vocab_size=16,
    )


def _spike_at(h: TrainingHealth, fake: _Fake, losses: list[float], start: int) -> bool:
    rolled = False
    for i, loss in enumerate(losses):
        fake.st.step = start + i
        rolled = h.after_step(fake.st, {"loss": loss, "grad_norm": 1.0}, load=fake.load, schedulers=[fake.sched])
        if rolled:
            break
    return rolled


def test_a_rollback_records_the_skip_scales_the_lr_and_writes_event_and_incident(tmp_path: Path):
    h = _health(tmp_path, spike_factor=2.0, spike_window=2, spike_patience=2, spike_skip_steps=3, spike_lr_scale=0.5)
    st = TrainState()
    ckpts = {
        10: {
            "step": 10,
            "tokens_seen": 0,
            "loss_tail": [],
            "health": {"detector": {"history": [1.0, 1.0], "streak": []}},
        },
        20: {"step": 20, "tokens_seen": 0, "loss_tail": [], "health": {}},
    }
    fake = _Fake(h, st, ckpts)
    st.health["detector"] = {"history": [1.0, 1.0], "streak": []}
    lr_before = fake.opt.param_groups[0]["lr"]
    # train_step(19) and (20) spike, i.e. logged steps 20 and 21: checkpoint 20 holds the first spiking update
    # (saved inside the window), so the target is 10; the skip covers 3 data steps, 18..20
    assert _spike_at(h, fake, [1.0, 5.0, 5.0], start=18)
    assert fake.asked == [20] and st.step == 10  # a checkpoint of a step < 20, the first spiking (logged) step
    (rec,) = h.records
    assert {
        k: rec[k]
        for k in (
            "rollback",
            "cls",
            "first_step",
            "step",
            "target_step",
            "from_step",
            "data_step",
            "skipped_data_steps",
        )
    } == {
        "rollback": 1,
        "cls": "loss_spike",
        "first_step": 20,
        "step": 21,
        "target_step": 10,
        "from_step": 18,
        "data_step": 21,
        "skipped_data_steps": [18, 19, 20],
    }
    assert st.health["rollbacks"] == h.records and h.data_step(17) == 17 and h.data_step(18) == 21
    assert h.lr_scale == 0.5 and fake.opt.param_groups[0]["lr"] == lr_before * 0.5
    inc = (tmp_path / "incidents/local.0/rollback-1.json").read_text()
    assert '"cls": "loss_spike"' in inc and '"target_step": 10' in inc
    kinds = [l for l in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert ['"loss_spike"' in kinds[0], '"rollback"' in kinds[1]] == [True, True]


def test_past_max_rollbacks_or_without_a_checkpoint_the_run_stops_with_a_summary(tmp_path: Path):
    h = _health(tmp_path / "a", spike_window=1, spike_factor=2.0, max_rollbacks=1)
    st = TrainState()
    ckpt = {"step": 5, "tokens_seen": 0, "loss_tail": [], "health": {"detector": {"history": [1.0], "streak": []}}}
    fake = _Fake(h, st, {5: ckpt})
    st.health["detector"] = {"history": [1.0], "streak": []}
    assert _spike_at(h, fake, [9.0], start=7)
    with pytest.raises(LossDiverged) as e:
        _spike_at(h, fake, [1.0, NAN], start=5)
    assert e.value.cls == "non_finite_loss" and "failure.max_rollbacks(1)" in str(e.value)
    assert "#1 loss_spike at step 8 -> step 5, data steps 5..7 skipped" in str(e.value)
    h2 = _health(tmp_path / "b")
    fake2 = _Fake(h2, TrainState(), {})
    with pytest.raises(LossDiverged, match="no committed checkpoint before step 3"):
        _spike_at(h2, fake2, [1.0, 1.0, math.inf], start=0)


def test_resume_repeats_the_skip_from_events_or_from_the_checkpoint_and_replaces_a_spike_window_checkpoint(
    tmp_path: Path,
):
    rec = {
        "rollback": 1,
        "cls": "loss_spike",
        "first_step": 20,
        "step": 21,
        "target_step": 10,
        "from_step": 18,
        "data_step": 21,
        "skipped_data_steps": [18, 19, 20],
        "lr_scale": 0.5,
    }
    plain = {"step": 10, "tokens_seen": 0, "loss_tail": [], "health": {}}
    window = {"step": 20, "tokens_seen": 0, "loss_tail": [], "health": {}}  # saved inside the spike window
    after = {"step": 30, "tokens_seen": 0, "loss_tail": [], "health": {"rollbacks": [rec]}}
    cases = [
        ("events only, checkpoint = target", plain, True, None),
        ("checkpoint only (events lost)", after, False, None),
        ("events only, checkpoint in the spike window", window, True, 11),
    ]
    for i, (name, sd, in_events, reload) in enumerate(cases):
        h = _health(tmp_path / str(i))
        if in_events:
            h._emit_fn("rollback", record=rec)
        st = TrainState()
        st.load_state_dict(sd)
        fake = _Fake(h, st, {10: plain, 20: window})
        h.resume(st, load=fake.load, schedulers=[fake.sched], agree=lambda x: x)
        assert fake.asked == ([reload] if reload else []), name
        assert h.records == [rec] and st.health["rollbacks"] == [rec], name
        assert (h.data_step(17), h.data_step(18), h.lr_scale) == (17, 21, 0.5), name
        assert fake.opt.param_groups[0]["lr"] == 0.1 / (fake.sched.last_epoch + 1) * 0.5, name


def test_a_diverged_run_is_a_stop_with_its_own_exit_code_not_a_requeue():
    from jobs import exitcodes
    from jobs.failure.policy import decide

    for cls in ("loss_spike", "non_finite_loss"):
        d = decide([], cause=cls, cfg=FailureConfig(), restart_count=0)
        assert (d.action, d.exit_code) == ("stop", exitcodes.DIVERGED) and exitcodes.DIVERGED == 77
    assert decide([], cause="rank_crashed", cfg=FailureConfig(), restart_count=0).exit_code != exitcodes.DIVERGED
