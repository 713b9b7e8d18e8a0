"""B8: goodput of a long run with failures injected at a chosen MTBF / the Young-Daly prediction.

    python scripts/bench/goodput.py [--minutes 15] [--mtbf-s 120] [--seed 0] [--out bench.jsonl]

Needs the local cluster (scripts/slurm/start). One job (2 ranks on 2 nodes, the tiny model,
failure=debug with unbounded restarts) runs `checkpoint.interval=auto` with `failure.mtbf_job_hours`
set to the chosen MTBF, so the job picks its Daly interval itself from its measured save cost. From
outside, at exponentially distributed times of mean MTBF, a random live rank is SIGKILLed. The job
is sized to take about `--minutes` without failures.

Measured, from rank 0's metrics rows (wall-clock `time` per step): W, from the start of the first step
to the end of the last; the failure-free wall time per step p (mean over consecutive rows of one
attempt away from saves: the step and the loop around it); the useful work T_s = steps * p; goodput =
T_s / W. Predicted: Daly's expected wall time (checkpoint.interval.expected_wall_time, exponential
failures) for T_s with the interval the job used (its saves' spacing times p), the save cost delta
measured in the same run (median extra wall time of the step with a save and of the one after it, so
the blocking part and what the overlapped write takes from training), the restart cost R measured in
the same run (median kill -> start of the next attempt's first step), and the MTBF: both the chosen
one and the one realized (W / failures), since a 15-minute run sees few failures and their count
alone moves goodput by several percent. Prints measured / predicted for both (goal >= 0.98; above 1 is
better than predicted) and appends one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from checkpoint.interval import expected_wall_time  # noqa: E402

COMMON = [
    "launcher=slurm",
    "launcher.nodes=2",
    "launcher.tasks_per_node=1",
    "mesh=single",
    "mesh.dp_shard=2",
    "failure=debug",
    "failure.restarts_in_allocation=1000000",
    "failure.max_attempts_without_progress=1000",
    "checkpoint.interval=auto",
    "checkpoint.keep=2",
    "cluster.time_min=120",
    "train.log_every=1",
]


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []


def _metrics(run_dir: Path) -> list[dict]:
    """Rank 0's step lines ({"record": "eval"} lines, held-out evaluations, are not steps)."""
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    return [r for r in rows if r.get("record") != "eval"]


def _live_rank_pid(run_dir: Path, rng: random.Random) -> tuple[str, int] | None:
    """(attempt, pid) of a random rank of the newest attempt that is training, or None."""
    starts = [e for e in _events(run_dir) if e["kind"] == "attempt_start"]
    if not starts:
        return None
    attempt = starts[-1]["attempt"]
    beats = sorted((run_dir / "heartbeats" / attempt).glob("rank*.json"))
    if not beats:
        return None
    beat = json.loads(rng.choice(beats).read_text())
    return (attempt, beat["pid"]) if beat.get("phase") == "train" else None


def run(minutes: float, mtbf_s: float, seed: int, step_s: float) -> dict:
    rng = random.Random(seed)
    steps = int(minutes * 60 / step_s)
    run_dir = REPO / "runs" / f"bench-goodput-{uuid.uuid4().hex[:8]}"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.train",
            *COMMON,
            f"train.steps={steps}",
            f"failure.mtbf_job_hours={mtbf_s / 3600}",
            f"run.dir={run_dir}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    job = out.split("submitted job ", 1)[1].split(":", 1)[0]
    kills: list[tuple[float, str]] = []
    try:
        next_kill = None
        while not any(e["kind"] == "train_end" for e in _events(run_dir)):
            state = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout
            if not state.strip():
                raise RuntimeError(f"job {job} ended without train_end: {run_dir}")
            if next_kill is None and any(e["kind"] == "first_step" for e in _events(run_dir)):
                next_kill = time.time() + rng.expovariate(1 / mtbf_s)
            if next_kill is not None and time.time() >= next_kill:
                target = _live_rank_pid(run_dir, rng)
                if target is not None:
                    try:
                        os.kill(target[1], signal.SIGKILL)
                        kills.append((time.time(), target[0]))
                    except ProcessLookupError:
                        pass
                    next_kill = time.time() + rng.expovariate(1 / mtbf_s)
            time.sleep(0.05)
    finally:
        time.sleep(5)
        subprocess.run(["scancel", job], capture_output=True)
        (run_dir / "injected_kills.json").write_text(
            json.dumps({"mtbf_s": mtbf_s, "steps": steps, "job": job, "kills": kills})
        )
    return analyse(run_dir)


def analyse(run_dir: Path) -> dict:
    """The figures of a finished run; kills from `injected_kills.json`, or, for a run from before that
    file, from its failure events (the kill is then the detection, ~0.1-1 s later)."""
    path = run_dir / "injected_kills.json"
    if path.exists():
        inj = json.loads(path.read_text())
        job, kills, mtbf_s, steps = inj["job"], [tuple(k) for k in inj["kills"]], inj["mtbf_s"], inj["steps"]
    else:
        ev = _events(run_dir)
        kills = [(e["time"], e["attempt"]) for e in ev if e["kind"] == "failure"]
        job = ev[0]["job_id"]
        steps, mtbf_s = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["step"], 120.0
    return _analyse(run_dir, job, kills, mtbf_s, steps)


def _analyse(run_dir: Path, job: str, kills: list[tuple[float, str]], mtbf_s: float, steps: int) -> dict:
    rows = _metrics(run_dir)  # rank 0, one per step, in order; a step re-run after a failure appears again
    ev = _events(run_dir)
    saves = {e["step"] for e in ev if e["kind"] == "checkpoint_saved"}
    # Wall time per step from consecutive rows of one attempt: the step, the loop around it, and at a
    # save step the save's blocking part; the step after a save also pays what the overlapped write costs.
    pairs = [(a, b) for a, b in zip(rows, rows[1:]) if b["step"] == a["step"] + 1 and b["attempt"] == a["attempt"]]
    plain = [b["time"] - a["time"] for a, b in pairs if a["step"] not in saves and a["step"] - 1 not in saves]
    per_step = statistics.fmean(plain)  # the mean, not the median: T_s is a sum (step times are skewed)
    extra = {a["step"]: b["time"] - a["time"] - per_step for a, b in pairs}
    costs = [max(extra.get(s, 0.0), 0.0) + max(extra.get(s + 1, 0.0), 0.0) for s in saves if s in extra]
    delta = max(statistics.median(costs), 1e-4) if costs else 1e-4
    ordered = sorted(saves)
    gaps = [b - a for a, b in zip(ordered, ordered[1:])]
    tau = statistics.median(gaps) * per_step if gaps else steps * per_step
    start = rows[0]["time"] - rows[0]["step_time_s"]
    wall = max(r["time"] for r in rows if r["step"] == steps) - start
    firsts = {}
    for r in rows:
        firsts.setdefault(r["attempt"], r)
    restarts = []
    for t, attempt in kills:
        nxt = sorted((r["time"] - r["step_time_s"] for a, r in firsts.items() if a != attempt and r["time"] > t))
        if nxt:
            restarts.append(nxt[0] - t)
    restart = statistics.median(restarts) if restarts else 0.0
    solve = steps * per_step
    failures = len({a for _, a in kills})
    realized = wall / failures if failures else float("inf")
    pred = {
        m: expected_wall_time(solve, tau=tau, delta=delta, mtbf=m, restart=restart)
        for m in (mtbf_s, realized)
        if m != float("inf")
    }
    return {
        "bench": "B8 goodput",
        "run_dir": str(run_dir),
        "job": job,
        "steps": steps,
        "wall_s": round(wall, 1),
        "per_step_s": round(per_step, 4),
        "median_step_s": round(statistics.median(plain), 4),
        "solve_s": round(solve, 1),
        "goodput": round(solve / wall, 4),
        "failures": failures,
        "mtbf_s": mtbf_s,
        "realized_mtbf_s": round(realized, 1),
        "tau_s": round(tau, 2),
        "saves": len(saves),
        "delta_s": round(delta, 4),
        "restart_s": round(restart, 2),
        "predicted_goodput": {str(round(m, 1)): round(solve / w, 4) for m, w in pred.items()},
        "ratio": {str(round(m, 1)): round(w / wall, 4) for m, w in pred.items()},
        "decisions": sorted({e["action"] for e in ev if e["kind"] == "decision"}),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--mtbf-s", type=float, default=120.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--step-s", type=float, default=0.17, help="failure-free step time, to size the run")
    ap.add_argument("--out", default=None)
    ap.add_argument("--analyse", metavar="RUN_DIR", help="recompute the figures of a finished run, submit nothing")
    args = ap.parse_args()
    result = analyse(Path(args.analyse)) if args.analyse else run(args.minutes, args.mtbf_s, args.seed, args.step_s)
    print(json.dumps(result, indent=1))
    r = result["ratio"]
    print(
        f"B8 goodput {result['goodput']:.3f} over {result['wall_s'] / 60:.1f} min, {result['failures']} failures; "
        f"measured / Daly-predicted: {' , '.join(f'{v:.3f} at MTBF {k} s' for k, v in r.items())} (goal >= 0.98)"
    )
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
