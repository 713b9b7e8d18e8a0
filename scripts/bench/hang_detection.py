"""B9: hang detection latency / failure.hang_timeout_s, and false alarms in a healthy run, in one script.

    python scripts/bench/hang_detection.py [--hang-timeout 10] [--repeats 3] [--healthy-minutes 10]
                                           [--ranks 2] [--out bench.jsonl]

Detection: `python -m jobs.train` on local ranks; once training runs, one rank is SIGSTOPped from
outside and the time until `incidents/<attempt>/incident.json` names it is measured, `--repeats`
times; the ratio is latency / hang_timeout (goal <= 1.1). False alarms: the same config trained
without any fault for `--healthy-minutes` (checkpoints every 50 steps included); every incident or
`failure` event in its ledger is a false alarm (goal 0). Prints both and appends one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _start(run_dir: Path, ranks: int, hang_timeout: float, steps: int) -> subprocess.Popen:
    args = [
        sys.executable,
        "-m",
        "jobs.train",
        f"run.dir={run_dir}",
        "mesh=single",
        f"mesh.dp_shard={ranks}",
        f"launcher.tasks_per_node={ranks}",
        f"train.steps={steps}",
        "train.log_every=10",
        f"failure.hang_timeout_s={hang_timeout}",
        f"failure.heartbeat_s={min(1.0, hang_timeout / 10)}",
        "checkpoint.every_steps=50",
    ]
    return subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_training(run_dir: Path, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{run_dir}: training never started (exit {proc.poll()})")
        time.sleep(0.2)


def detection_latency(root: Path, *, ranks: int, hang_timeout: float) -> float:
    run_dir = root / f"hang-{time.monotonic_ns()}"
    proc = _start(run_dir, ranks, hang_timeout, steps=100000)
    try:
        _wait_training(run_dir, proc)
        time.sleep(2)
        pid = json.loads((run_dir / "heartbeats/local.0/rank1.json").read_text())["pid"]
        os.kill(pid, signal.SIGSTOP)
        t0 = time.time()
        incident = run_dir / "incidents/local.0/incident.json"
        while not incident.exists():
            if time.time() - t0 > 5 * hang_timeout:
                raise RuntimeError(f"no incident after {5 * hang_timeout} s")
            time.sleep(0.05)
        inc = json.loads(incident.read_text())
        assert inc["cls"] == "hung_rank" and inc["suspects"][0]["pid"] == pid, inc
        os.kill(pid, signal.SIGCONT)
        return inc["time"] - t0
    finally:
        proc.kill() if proc.poll() is None else None
        proc.wait()


def false_alarms(root: Path, *, ranks: int, hang_timeout: float, minutes: float) -> tuple[int, int]:
    """(incidents + failure events, steps trained) of a healthy run stopped after `minutes`."""
    run_dir = root / "healthy"
    proc = _start(run_dir, ranks, hang_timeout, steps=10**7)
    _wait_training(run_dir, proc)
    time.sleep(minutes * 60)
    os.kill(proc.pid, signal.SIGUSR2)  # save and stop (exit 75); not an incident
    proc.wait(timeout=120)
    ledger = [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]
    alarms = len(list((run_dir / "incidents").glob("*/incident.json"))) if (run_dir / "incidents").exists() else 0
    alarms += sum(1 for e in ledger if e["kind"] == "failure")
    steps = max(json.loads(l)["step"] for l in (run_dir / "metrics.jsonl").read_text().splitlines())
    return alarms, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hang-timeout", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--healthy-minutes", type=float, default=10.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="b9-") as tmp:
        lat = [detection_latency(Path(tmp), ranks=a.ranks, hang_timeout=a.hang_timeout) for _ in range(a.repeats)]
        ratios = [x / a.hang_timeout for x in lat]
        print(
            f"B9 detection latency / hang_timeout ({a.hang_timeout:.0f} s): "
            + " ".join(f"{r:.3f}" for r in ratios)
            + f" (median {statistics.median(ratios):.3f}; goal <= 1.1)"
        )
        alarms, steps = (
            false_alarms(Path(tmp), ranks=a.ranks, hang_timeout=a.hang_timeout, minutes=a.healthy_minutes)
            if a.healthy_minutes > 0
            else (None, 0)
        )
    if alarms is not None:
        print(f"B9 false alarms in a healthy {a.healthy_minutes:g}-minute run ({steps} steps): {alarms} (goal 0)")
    rec = {
        "bench": "B9",
        "hang_timeout_s": a.hang_timeout,
        "latency_s": lat,
        "ratios": ratios,
        "false_alarms": alarms,
        "healthy_minutes": a.healthy_minutes,
        "healthy_steps": steps,
    }
    print(json.dumps(rec))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
