"""B10: failure to the first step after recovery, restart inside the allocation / requeue through the queue.

    python scripts/bench/recovery.py [--repeats 1] [--out bench.jsonl]

Needs the local cluster (scripts/slurm/start). Per repeat, two jobs of the same config (2 ranks on 2
nodes, the tiny model, failure=debug) are submitted one after the other: one with the default
`failure.restarts_in_allocation`, one with it set to 0 (so the same failure takes the requeue path,
quarantine and ExcNodeList included). Once each trains, rank 1 is SIGKILLed from outside; the time
from the kill to the `first_step` event of the next attempt is the recovery time. Prints the ratio
(goal <= 0.3) and appends one JSON line. Both paths pay the same detection, checkpoint load and first
step; the requeue also pays Slurm's requeue hold (cred_expire + 1 s: 6 s on the local cluster, 121 s by Slurm's default) and
the scheduler; on a busy cluster the queue wait comes on top of that, so this ratio is the best case
for the requeue.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMON = [
    "launcher=slurm",
    "launcher.nodes=2",
    "launcher.tasks_per_node=1",
    "mesh=single",
    "mesh.dp_shard=2",
    "train.steps=100000",
    "checkpoint.every_steps=25",
    "failure=debug",
]


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _wait(what: str, pred, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise TimeoutError(what)


def recovery_s(extra: list[str]) -> tuple[float, str]:
    """Submits one job, kills rank 1 once it is past step 30, returns (kill -> next first_step, how)."""
    run_dir = REPO / "runs" / f"bench-recovery-{uuid.uuid4().hex[:8]}"
    out = subprocess.run(
        [sys.executable, "-m", "jobs.train", *COMMON, *extra, f"run.dir={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    job = out.split("submitted job ", 1)[1].split(":", 1)[0]
    try:
        _wait(
            "step 30",
            lambda: any(
                e["kind"] == "step" and e.get("step", 0) >= 30 or e["kind"] == "checkpoint_saved" and e["step"] >= 25
                for e in _events(run_dir)
            ),
        )
        pid = json.loads((run_dir / "heartbeats" / f"{job}.0" / "rank1.json").read_text())["pid"]
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        first = _wait(
            "first step after recovery",
            lambda: [e for e in _events(run_dir) if e["kind"] == "first_step" and e["attempt"] != f"{job}.0"],
        )
        how = next(e["action"] for e in _events(run_dir) if e["kind"] == "decision")
        return first[0]["time"] - killed, how
    finally:
        subprocess.run(["scancel", job], capture_output=True)
        time.sleep(3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for _ in range(args.repeats):
        restart, how_a = recovery_s([])
        requeue, how_b = recovery_s(["failure.restarts_in_allocation=0"])
        assert (how_a, how_b) == ("restart", "requeue"), (how_a, how_b)
        rows.append(
            {"restart_s": round(restart, 2), "requeue_s": round(requeue, 2), "ratio": round(restart / requeue, 3)}
        )
        print(f"restart inside the allocation {restart:.1f} s, requeue {requeue:.1f} s: ratio {restart / requeue:.3f}")
    result = {
        "bench": "B10 recovery",
        "time": time.time(),
        "rows": rows,
        "median_ratio": statistics.median(r["ratio"] for r in rows),
    }
    print(f"B10 restart/requeue median {result['median_ratio']:.3f} (goal <= 0.3)")
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
