"""B7: requeue-to-running latency of a meshjob job / that of an empty job requeued on the same cluster.

    python scripts/bench/requeue_latency.py [--repeats 3] [--out bench.jsonl]

Needs the local cluster (scripts/slurm/start). Each repeat requeues, with an administrator's
`scontrol requeue` (SIGTERM to every process, then SIGKILL after KillWait), first an empty job
(`sleep`) and then a running 2-rank meshjob job, and times from the requeue until Slurm reports the
job RUNNING again with one more restart. Our job must save at the step boundary and get out of
the way as fast as a job with nothing to do (goal <= 1.2). Also reported: requeue to the first
step trained after resume. Prints the ratios and appends one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOB = [
    "launcher=slurm",
    "launcher.nodes=2",
    "launcher.tasks_per_node=1",
    "mesh=single",
    "mesh.dp_shard=2",
    "train.steps=100000",
    "checkpoint.every_steps=50",
    "train.log_every=10",
]


def _state(job: str) -> tuple[str, int]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True).stdout
    f = dict(kv.split("=", 1) for kv in out.split() if "=" in kv)
    return f.get("JobState", "?"), int(f.get("Restarts", 0))


def _wait(job: str, *, state: str, restarts: int, timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s, r = _state(job)
        if s == state and r >= restarts:
            return time.time()
        time.sleep(0.05)
    raise RuntimeError(f"job {job} not {state} with {restarts} restarts after {timeout} s: {_state(job)}")


def _requeue_latency(job: str) -> float:
    _, restarts = _state(job)
    t0 = time.time()
    subprocess.run(["scontrol", "requeue", job], check=True)
    return _wait(job, state="RUNNING", restarts=restarts + 1) - t0


def empty_job() -> float:
    job = subprocess.run(
        ["sbatch", "--parsable", "-N", "2", "-o", "/dev/null", "--wrap", "srun sleep 600"],
        capture_output=True,
        text=True,
        check=True,
        cwd="/tmp",
    ).stdout.strip()
    try:
        _wait(job, state="RUNNING", restarts=0)
        time.sleep(2)
        return _requeue_latency(job)
    finally:
        subprocess.run(["scancel", job])


def meshjob_job(run_dir: Path) -> tuple[float, float]:
    out = subprocess.run(
        [sys.executable, "-m", "jobs.train", *JOB, f"run.dir={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    job = out.split("submitted job ", 1)[1].split(":", 1)[0]
    metrics = run_dir / "metrics.jsonl"
    try:
        while not metrics.exists() or not metrics.read_text().strip():
            time.sleep(0.2)
        t0 = time.time()
        running = _requeue_latency(job)
        while not any(json.loads(l).get("restart") == 1 for l in metrics.read_text().splitlines()):
            time.sleep(0.1)
        first = min(
            json.loads(l)["time"]
            for l in (run_dir / "events.jsonl").read_text().splitlines()
            if json.loads(l)["kind"] == "first_step" and json.loads(l)["restart"] == 1
        )
        return running, first - t0
    finally:
        subprocess.run(["scancel", job])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="b7-", dir=REPO / "runs") as tmp:
        for i in range(a.repeats):
            base = empty_job()
            ours, first_step = meshjob_job(Path(tmp) / f"run-{uuid.uuid4().hex[:6]}")
            rows.append({"empty_s": base, "meshjob_s": ours, "ratio": ours / base, "to_first_step_s": first_step})
            print(
                f"B7 run {i}: requeue->RUNNING meshjob {ours:.2f} s / empty {base:.2f} s = {ours / base:.3f}; "
                f"requeue->first step after resume {first_step:.2f} s",
                flush=True,
            )
    ratios = [r["ratio"] for r in rows]
    print(
        f"B7 requeue-to-running ratio: {' '.join(f'{r:.3f}' for r in ratios)} "
        f"(median {statistics.median(ratios):.3f}; goal <= 1.2)"
    )
    rec = {"bench": "B7", "runs": rows}
    print(json.dumps(rec))
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
