"""The report's figures read back from matplotlib (axes, series, markers), not from the PNG: what they show, and
that they stay readable at 20 attempts and 2,048 ranks; TensorBoard drops the steps a restart trains again."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pytest
from matplotlib.image import AxesImage

from jobs.failure.ledger import attempts
from jobs.telemetry import plots
from jobs.telemetry.goodput import measure_goodput
from jobs.telemetry.run_report import phase_table

ATTEMPTS = 20


def _ev(t: float, kind: str, attempt: str, **fields) -> dict:
    return {"time": t, "kind": kind, "rank": 0, "attempt": attempt, **fields}


def _twenty_attempts() -> tuple[list[dict], list[dict], list[dict]]:
    """Attempt i starts at 100 i, resumes from step 5 i, trains 10 steps of 1 s from 100 i + 10 (logged every 5,
    with trained_steps), saves step 5 i + 5; all but the last die (dead_rank) with a decision at 100 i + 40."""
    events, metrics, evals = [], [], []
    for i in range(ATTEMPTS):
        a, t0, s0 = f"local.{i}", 100.0 * i, 5 * i
        events += [
            _ev(t0, "attempt_start", a),
            _ev(t0 + 10, "train_start", a, step=s0),
            _ev(t0 + 15.5, "checkpoint_saved", a, step=s0 + 5, blocking_s=0.5, total_s=0.5),
        ]
        steps = [[s0 + j, t0 + 10 + j + (0.5 if j > 5 else 0.0), 1.0] for j in range(1, 11)]
        for chunk in (steps[:5], steps[5:]):
            metrics.append(
                {
                    "step": chunk[-1][0],
                    "loss": 5.0 - 0.01 * chunk[-1][0],
                    "tokens_per_s": 1000.0 + i,
                    "tflops_per_rank": 0.5,
                    "step_time_s": 1.0,
                    "peak_mem_bytes": 2**30,
                    "attempt": a,
                    "time": chunk[-1][1],
                    "trained_steps": chunk,
                }
            )
        evals.append({"record": "eval", "step": s0 + 10, "eval_loss": 4.0 - 0.01 * i, "attempt": a, "time": t0 + 21})
        if i < ATTEMPTS - 1:
            events += [
                _ev(t0 + 39, "failure", a, cls="dead_rank", suspects=[]),
                _ev(t0 + 40, "decision", a),
                _ev(t0 + 41, "attempt_end", a, cause="dead_rank", action="restart", step=s0 + 10),
            ]
        else:
            events.append(_ev(t0 + 22, "attempt_end", a, cause="completed", action="done", step=s0 + 10))
    return events, metrics, evals


def _series(ax) -> dict[str, np.ndarray]:
    return {line.get_label(): np.asarray(line.get_xydata()) for line in ax.get_lines()}


def test_the_goodput_timeline_marks_every_attempt_failure_and_decision_at_twenty_attempts() -> None:
    events, metrics, _ = _twenty_attempts()
    g = measure_goodput(events, metrics, now=5000.0, expected=0.5)
    fig = plots.goodput_figure(g, events)
    top, bottom = fig.axes
    starts = next(c for c in top.collections if c.get_label() == "attempt start")
    assert len(starts.get_segments()) == ATTEMPTS
    marks = _series(top)
    x = lambda t: (t - g.start) / 60.0  # noqa: E731  (minutes: the run is under 3 h)
    assert marks["failure"][:, 0] == pytest.approx([x(100 * i + 39) for i in range(ATTEMPTS - 1)])
    assert marks["decision"][:, 0] == pytest.approx([x(100 * i + 40) for i in range(ATTEMPTS - 1)])
    assert len(top.texts) == ATTEMPTS and [t.get_text() for t in top.texts[:3]] == ["0", "1", "2"]
    legend = [t.get_text() for t in top.get_legend().get_texts()]
    assert len(legend) <= len(g.seconds) + 3 and "failure" in legend and "decision" in legend
    measured = _series(bottom)[f"measured (now {g.goodput:.3f})"]
    assert measured[-1, 1] == pytest.approx(g.goodput) and _series(bottom)["expected 0.500"][0, 1] == 0.5
    plt.close(fig)


def test_the_loss_figure_shows_eval_loss_and_every_restart_with_a_short_legend_at_twenty_attempts() -> None:
    events, metrics, evals = _twenty_attempts()
    fig = plots.loss_figure(metrics, attempts(events), events, evals)
    (ax,) = fig.axes
    lines = _series(ax)
    assert lines["eval loss (held-out)"][:, 1] == pytest.approx([e["eval_loss"] for e in evals])
    resumed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert [ln.get_xdata()[0] for ln in resumed] == [5 * i for i in range(1, ATTEMPTS)]
    assert len(ax.get_legend().get_texts()) <= 4  # no entry per attempt: eval, resumed, checkpoints
    assert "20 attempts" in ax.get_title()
    plt.close(fig)


def test_the_metrics_figure_plots_tok_s_tflops_every_steps_time_and_peak_memory() -> None:
    events, metrics, _ = _twenty_attempts()
    fig = plots.metrics_figure(metrics, attempts(events))
    tok, flops, step, mem = fig.axes
    assert _series(tok)["tokens_per_s"][:, 1] == pytest.approx([m["tokens_per_s"] for m in metrics])
    assert "TFLOP/s per rank" in flops.get_ylabel()  # no GPU peak in these rows: no MFU
    per_step = _series(step)["step_time_s"]
    assert len(per_step) == 10 * ATTEMPTS  # one point per trained step, not per logged row
    assert _series(mem)["peak_mem_bytes"][:, 1] == pytest.approx([1.0] * len(metrics))  # GiB
    plt.close(fig)


def test_phases_of_2048_ranks_are_percentiles_with_the_slowest_rank_named_not_a_heatmap() -> None:
    rng = np.random.default_rng(0)
    phases = {r: {"forward": 0.010 + 1e-4 * rng.random(), "backward": 0.020 + 1e-4 * rng.random()} for r in range(2048)}
    phases[1234]["backward"] = 0.040
    fig = plots.phase_figure(phases)
    (ax,) = fig.axes
    assert not any(isinstance(im, AxesImage) for im in ax.get_images())
    assert fig.get_size_inches()[1] < 8
    lines = _series(ax)
    assert lines["slowest rank"][:, 1] == pytest.approx([max(p["forward"] for p in phases.values()) * 1e3, 40.0])
    assert lines["median over ranks"][1, 1] == pytest.approx(20.05, abs=0.06)
    assert "rank 1234" in [t.get_text() for t in ax.texts]
    plt.close(fig)
    text = phase_table(phases)
    assert len(text.splitlines()) == 7 and "2048 ranks aggregated" in text
    assert text.splitlines()[5].split()[-1] == "1234"  # backward's slowest rank


def test_heatmap_values_are_written_in_a_colour_that_reads_on_their_cell() -> None:
    phases = {0: {"forward": 0.010}, 1: {"forward": 0.002}}
    fig = plots.phase_figure(phases)
    ax = fig.axes[0]
    assert isinstance(ax.get_images()[0], AxesImage)
    colours = {t.get_text(): t.get_color() for t in ax.texts}
    assert colours == {"10.0": "black", "2.0": "white"}  # the bright (yellow) cell gets dark text
    plt.close(fig)


def test_tensorboard_keeps_one_value_per_step_after_a_restart(tmp_path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from jobs.telemetry.tensorboard import ScalarLog

    first = ScalarLog(tmp_path, purge_step=1)
    for step in range(1, 11):  # the first attempt logs steps 1-10, then dies; its checkpoint was step 5
        first.write({"step": step, "loss": 10.0 - step, "time": 1000.0 + step})
    first.close()
    again = ScalarLog(tmp_path, purge_step=6)  # the trainer sets the step resumed from + 1
    for step in range(6, 9):
        again.write({"step": step, "loss": 100.0 + step, "time": 2000.0 + step})
    again.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    got = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert got == [(s, 10.0 - s) for s in range(1, 6)] + [(s, 100.0 + s) for s in range(6, 9)]
