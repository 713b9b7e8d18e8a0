"""`python -m jobs.report` on written run dirs: tables, plots and the HTML page; with and without telemetry, running or ended."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import h5py
import numpy as np
import pytest

from jobs import report
from jobs.launch import slurm_state
from jobs.telemetry.run_report import collect, queue_waits, read_phases, render_text, write_report
from tests.unit.test_goodput import _two_attempts_one_failure

PNG = b"\x89PNG\r\n\x1a\n"


def _run_dir(tmp_path: Path, *, ended: bool = True) -> Path:
    events, metrics = _two_attempts_one_failure()
    if not ended:
        events = [e for e in events if not (e["attempt"] == "local.0.1" and e["kind"] in ("train_end", "attempt_end"))]
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics) + '{"step": 9, "lo')  # torn
    return run


def _telemetry(run: Path, slow_rank: int = 1) -> None:
    (run / "telemetry").mkdir()
    for r in range(2):
        with h5py.File(run / "telemetry" / f"rank{r}.h5", "w") as f:
            f["step"] = np.arange(1, 5)
            f["forward"] = np.array([0.010, 0.010, 0.012, 0.010]) * (1.5 if r == slow_rank else 1.0)
            f["optimizer"] = np.full(4, 0.002)


def test_report_of_an_ended_run_without_telemetry_has_tables_two_plots_and_the_page(tmp_path: Path) -> None:
    run = _run_dir(tmp_path)
    d = collect(run, now=5000.0, expected=0.9)
    text = render_text(d)
    assert "run " in text and "ended; step 8 of ?" in text
    assert "local.0.1" in text and "dead_rank -> restart x1, completed -> done x1" in text
    assert "goodput: 0.2667 measured (productive 16.0 s / allocated 60.0 s" in text  # no queue wait known
    assert "0.9000 expected" in text
    assert "lost_work                4.0" in text and "failures 1; observed job MTBF 50.0 s; MTTR 27.0 s" in text
    assert "phases: no telemetry/" in text
    written = write_report(d, run / "report")
    assert [p.name for p in written] == ["loss.png", "metrics.png", "goodput.png", "report.html"]
    assert all(p.read_bytes()[:8] == PNG for p in written[:3])
    page = (run / "report" / "report.html").read_text()
    assert '<img src="loss.png"' in page and '<img src="goodput.png"' in page and "goodput: 0.2667" in page


def test_report_of_a_running_run_with_telemetry_has_the_phase_table_and_heatmap(tmp_path: Path) -> None:
    run = _run_dir(tmp_path, ended=False)
    _telemetry(run)
    d = collect(run, now=1070.0)
    assert d.running and d.goodput.end == 1070.0
    assert d.phases == {
        0: pytest.approx({"forward": 0.010, "optimizer": 0.002}),
        1: pytest.approx({"forward": 0.015, "optimizer": 0.002}),
    }
    text = render_text(d)
    assert "running; step 8" in text and "expected: n/a" in text
    assert "   1        15.00         2.00" in text  # rank 1, median ms per step
    assert "max/median         1.20         1.00" in text  # 15 / median(10, 15)
    names = [p.name for p in write_report(d, tmp_path / "out")]
    assert names == ["loss.png", "metrics.png", "goodput.png", "phases.png", "report.html"]
    assert '<img src="phases.png"' in (tmp_path / "out" / "report.html").read_text()


def test_read_phases_skips_a_damaged_file_and_an_absent_folder(tmp_path: Path) -> None:
    assert read_phases(tmp_path / "telemetry") == {}
    _telemetry(tmp_path)
    (tmp_path / "telemetry" / "rank2.h5").write_bytes(b"not hdf5")
    assert sorted(read_phases(tmp_path / "telemetry")) == [0, 1]


def test_queue_wait_comes_from_sacct_submit_to_start(tmp_path: Path, monkeypatch) -> None:
    ts = datetime.fromtimestamp  # sacct prints local time
    recs = [
        {"Submit": ts(990).isoformat(), "Start": ts(1000).isoformat()},
        {"Submit": ts(1030).isoformat(), "Start": ts(1036).isoformat()},
        {"Submit": ts(1070).isoformat(), "Start": "Unknown"},
    ]
    assert queue_waits(recs) == [(990.0, 1000.0), (1030.0, 1036.0)]
    d = collect(_run_dir(tmp_path), now=5000.0, sacct_records=recs)
    # the requeue's 6 s wait is taken out of the 10 s gap between the attempts
    assert d.goodput.seconds["queue_wait"] == pytest.approx(16.0) and d.goodput.seconds["restart_gap"] == pytest.approx(
        4.0
    )
    assert "n/a: sacct not available" not in render_text(d)
    calls = []
    monkeypatch.setattr(slurm_state, "_run", lambda cmd: calls.append(cmd) or "1|COMPLETED|0:0|n1|s|e|0|sub\n")
    assert slurm_state.sacct_attempts("1", fields=(*slurm_state.SACCT_FIELDS, "Submit"))[0]["Submit"] == "sub"
    assert calls[0][calls[0].index("-o") + 1].endswith(",Submit")


def test_report_entry_refuses_a_folder_without_ledger_and_writes_into_out(tmp_path: Path, capsys) -> None:
    assert report.main([str(tmp_path)]) == 2
    run = _run_dir(tmp_path)
    assert report.main([f"run.dir={run}", "report.plan=false", f"report.out={tmp_path / 'o'}"]) == 0
    assert "goodput: 0.2667 measured (" in (out := capsys.readouterr().out) and "expected: n/a" in out
    assert (tmp_path / "o" / "report.html").exists()
