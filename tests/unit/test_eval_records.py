"""The {"record": "eval"} lines of metrics.jsonl: when they are written, and that every reader keeps them apart
from the step lines (goodput does not count them as trained steps; the report shows the held-out loss)."""

from __future__ import annotations

import json

import pytest

from jobs.config import compose
from jobs.evaluate import eval_due
from jobs.telemetry.goodput import measure_goodput
from jobs.telemetry.run_report import collect, render_text
from jobs.validate import validate
from tests.unit.test_goodput import _two_attempts_one_failure


def _eval(step: int, t: float, attempt: str, loss: float = 3.0) -> dict:
    return {
        "record": "eval",
        "step": step,
        "eval_loss": loss,
        "eval_ppl": 20.09,
        "eval_batches": 4,
        "eval_time_s": 0.5,
        "attempt": attempt,
        "time": t,
    }


def test_an_evaluation_is_due_every_eval_every_steps_and_at_the_last() -> None:
    assert [s for s in range(1, 13) if eval_due(s, every=5, steps=12)] == [5, 10, 12]
    assert not any(eval_due(s, every=0, steps=12) for s in range(1, 13))  # 0 = off


def test_eval_with_the_zero_bubble_schedule_is_refused_with_the_fix() -> None:
    cfg = compose(
        ["mesh.pp_schedule=zbv_zero_bubble", "mesh.dp_shard=1", "launcher.tasks_per_node=4", "train.eval_every=5"]
    )
    with pytest.raises(ValueError, match="train.eval_every with mesh.pp_schedule=zbv_zero_bubble.*train.eval_every=0"):
        validate(cfg)
    cfg.train.eval_every = 0
    validate(cfg)  # without evaluation the schedule is fine


def test_goodput_counts_no_evaluation_line_as_a_trained_step() -> None:
    events, metrics = _two_attempts_one_failure()
    # train.log_every=2 with train.eval_every=5: step 5 has no step line, but an eval line; the step line
    # of step 6 stands for steps 5 and 6.
    logged = [m for m in metrics if not (m["attempt"] == "local.0" and m["step"] == 5)]
    with_evals = logged[:4] + [_eval(5, 1021.5, "local.0")] + logged[4:] + [_eval(8, 1058.4, "local.0.1")]
    a = measure_goodput(events, logged, now=2000.0)
    b = measure_goodput(events, with_evals, now=2000.0)
    assert (b.steps_productive, b.steps_lost) == (a.steps_productive, a.steps_lost) == (8, 2)
    assert b.seconds == pytest.approx(a.seconds)  # step 5 stays 2 s of (lost) work, not a 0 s step


def test_the_report_keeps_evaluations_apart_and_shows_the_last_heldout_loss(tmp_path) -> None:
    events, metrics = _two_attempts_one_failure()
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    rows = metrics + [_eval(8, 1058.4, "local.0.1", loss=2.5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in rows))
    d = collect(run, now=2000.0)
    assert [m["step"] for m in d.metrics][-1] == 8 and all("record" not in m for m in d.metrics)
    assert [e["eval_loss"] for e in d.evals] == [2.5]
    assert "held-out loss 2.5000 (ppl 20.09) at step 8" in render_text(d)
