"""`python -m jobs.report` on a real 2-rank local run dir, while it runs and after rank 1 was killed -9 and the
ranks restarted in place; the rank's phase file is readable during the run and intact up to its last flush."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest

from jobs import exitcodes, report
from jobs.telemetry.phases import committed_rows
from jobs.telemetry.run_report import collect
from tests.conftest import REPO, wait_for_step

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

LOG_EVERY, STEPS = 2, 120


def _wait_for_attempt(run_dir: Path, attempt: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until the restarted attempt has trained a step (its first_step event)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        events = (run_dir / "events.jsonl").read_text().splitlines()
        if any('"first_step"' in l and f'"attempt": "{attempt}"' in l for l in events):
            return
        time.sleep(0.1)
    raise AssertionError(f"attempt {attempt} trained no step in {timeout} s")


def _rows(path: Path) -> dict[str, list]:
    """The rank file's step, attempt and backward columns, read while its writer may be flushing."""
    for _ in range(20):
        try:
            with h5py.File(path, "r", locking=False) as f:
                n = committed_rows(f)  # (the writer may be mid-flush: a read here once got 8 backward rows and 6 steps)
                return {k: f[k][:n].tolist() for k in ("step", "attempt", "backward")} | {
                    "attempts": json.loads(f.attrs["attempts"])
                }
        except (OSError, KeyError):  # opened between its create and its first write, or mid-flush
            time.sleep(0.05)
    raise AssertionError(f"{path} unreadable for a second while the run went on")


def test_report_of_a_real_run_with_a_restart_renders_tables_plots_and_html(
    tmp_path: Path, data_path: str, capsys
) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jobs.train",
            f"run.dir={run_dir}",
            f"train.steps={STEPS}",
            "checkpoint.every_steps=5",
            "mesh=single",
            "launcher.tasks_per_node=2",
            "mesh.dp_shard=2",
            f"train.log_every={LOG_EVERY}",
            "metrics.flush_every_s=0",
            f"data.path={data_path}",
            f"cluster.run_root={tmp_path}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for_step(run_dir, 8, proc, timeout=300)
        live = _rows(run_dir / "telemetry/rank1.h5")  # the run goes on while we read
        assert len(live["step"]) >= 6 and live["step"] == list(range(1, len(live["step"]) + 1))
        # Kill first (a 20-step run once ended while the live report rendered, CI), then report on the
        # restarted attempt while it trains.
        os.kill(json.loads((run_dir / "heartbeats/local.0/rank1.json").read_text())["pid"], signal.SIGKILL)
        _wait_for_attempt(run_dir, "local.0.1", proc)
        assert (
            report.main([f"run.dir={run_dir}", "report.plan=false", f"report.out={tmp_path / 'live'}"]) == exitcodes.OK
        )
        assert ": running; step " in capsys.readouterr().out
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == exitcodes.OK, err[-3000:]
    assert (tmp_path / "live" / "report.html").exists()

    after = _rows(run_dir / "telemetry/rank1.h5")
    assert after["attempts"] == ["local.0", "local.0.1"]
    first = [s for s, a in zip(after["step"], after["attempt"]) if a == 0]
    again = [s for s, a in zip(after["step"], after["attempt"]) if a == 1]
    # Intact up to the last flush before the kill: every row read live is there unchanged, and the
    # killed attempt's rows end on a flush boundary (a log interval), not mid-interval.
    assert first[: len(live["step"])] == live["step"] and after["backward"][: len(live["step"])] == live["backward"]
    # (not "at least step 8": rank 0 logs step 8 before rank 1 flushes it, and the kill can land in between, CI)
    assert first == list(range(1, len(first) + 1)) and len(first) % LOG_EVERY == 0 and len(first) >= len(live["step"])
    assert again == list(range(again[0], STEPS + 1)) and (again[0] - 1) % 5 == 0  # resumed from a checkpoint

    assert report.main([str(run_dir)]) == exitcodes.OK
    text = capsys.readouterr().out
    assert f": ended; step {STEPS} of {STEPS}" in text and "dead_rank -> restart x1, completed -> done x1" in text
    assert "expected (jobs.plan's costs, start-up and restarts included)" in text
    assert "phases (median ms per step):" in text
    # Whether CPU noise at log_every=2 names a straggler is tests/multiproc/test_stragglers.py's matter; the
    # report must show what the ledger holds: "none found", or a row for each straggler event.
    found = [
        e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["kind"] == "straggler"
    ]
    section = text.split("\nstragglers: ", 1)[1].split("\n\n", 1)[0]
    rows = section.splitlines()[2:]
    assert (
        section == "none found"
        if not found
        else (rows and len(rows) == len(found) and all(e["phase"] in r for e, r in zip(found, rows)))
    ), (section, found)
    header = next(line for line in text.splitlines() if line.strip().startswith("rank ") and "forward" in line)
    assert header.split() == ["rank", "data", "forward", "backward", "collective", "optimizer", "checkpoint"]
    g = collect(run_dir).goodput
    # killed after step 8, resumed from the newest checkpoint: at least the flushed steps past it were redone
    assert g.steps_productive == STEPS and g.steps_lost >= len(first) - (again[0] - 1) >= 0
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    kept = [j for m in lines if m["attempt"] == "local.0.1" for j, _, _ in m["trained_steps"]]
    assert kept == list(range(again[0], STEPS + 1))  # every step accounted one by one (goodput's trained_steps)
    per_step = next(
        e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines()) if e["kind"] == "train_start"
    )["tokens_per_step"]
    for m in lines:  # tok/s is the interval's average: its tokens over its steps' summed time
        assert m["tokens_per_s"] == pytest.approx(
            per_step * len(m["trained_steps"]) / sum(dt for _, _, dt in m["trained_steps"]), rel=1e-3
        )
    assert g.failures == 1 and g.mttr_s > 0 and 0 < g.goodput < 1
    assert sum(g.seconds.values()) == pytest.approx(g.wall_s)
    assert sorted(p.name for p in (run_dir / "report").iterdir()) == [
        "goodput.png",
        "loss.png",
        "metrics.png",
        "phases.png",
        "report.html",
    ]
