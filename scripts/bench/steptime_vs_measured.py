"""The planner's predicted step time against the real trainer on this machine: calibrate a `local`
profile (a `jobs.planner.calibrate` run on the same 4 ranks), predict the step of the tiny model and
of a larger CPU model on four meshes (FSDP, TP, PP 1F1B, PP interleaved), run the trainer on each
right after, and compare with the median measured step (steps 2-13, the slowest rank's).
Bound: predicted / measured within 0.75-1.25; exit 1 outside it after the rounds below.

    python scripts/bench/steptime_vs_measured.py [--model tiny|larger|both] [--samples 3]

A benchmark, not a test: its verdict is a wall-clock comparison on a shared box. It ran in CI until
2026-12-06, when on the CI runner (2 cores, after the chaos tier) tiny's two PP meshes read 0.69-0.77 in
all three rounds while fsdp4 read 0.29, 0.47 and 0.92 from one round to the next: what it measures there
is the runner's load as much as the model. Run it on a quiet machine and put its figures in the note.

Calibration and measurement run back to back in one run because this machine is shared: its
speed changes from minute to minute, and a profile measured earlier would not describe it. One
calibration and one measurement per mesh are single samples of a noisy box, in both directions: in
ten runs of both models on 2026-12-04 (one sample a side) a larger-model tp2_fsdp2 measured 0.771 s
where the other nine measured 0.795-1.085 s against predictions of 0.876-1.044 s (ratio 1.31), and a
calibration that ran fast predicted tiny pp2_interleaved_fsdp2 at 0.081 s against 0.112 and 0.111 s
measured twice (0.73). So each side is an estimate from up to SAMPLES samples: when a mesh's ratio is
out of bounds, the bench calibrates once more (a new prediction for every mesh) and measures the meshes
out of bounds once more, and each side is the median of its samples (of two: their mean; of three: the
middle one, which drops one outlier on either side). A model that predicts too little or too much fails
all three rounds.

Ten runs of both models with one sample a side (2026-12-04, idle 2-core box; fsdp4, tp2_fsdp2,
pp2_1f1b_fsdp2, pp2_interleaved_fsdp2): median ratio 1.01, 90% of the 80 ratios in 0.83-1.21, all in
0.73-1.31; 3 of the 20 model runs had one mesh out of bounds (1.31, 1.26, 0.73). Before the FSDP2 host
time was calibrated in context and at the mesh's tp degree: 0.57-0.83. With the rounds, ten
runs of both models (2026-12-04): all 20 model runs passed, 3 of them in a second round (tiny fsdp4
1.29 -> 1.08 when a slow calibration had lifted all four tiny predictions to 1.19-1.29; tiny fsdp4 1.27
-> 1.14; larger tp2_fsdp2 1.30 -> 1.13), none needed a third; 142-229 s for both models. With the
prediction scaled by 1.4 on purpose (tiny), it failed after three rounds: tp2_fsdp2 1.35,
pp2_interleaved_fsdp2 1.41 (fsdp4 1.21 and pp2_1f1b 1.15 passed: the box's noise lets a model err by
~1.25-1.4x on one mesh before this check sees it, not less).

What it does not prove: the calibration runs on the very models and shapes it then predicts (the same
4 ranks, the same machine, minutes apart), so it shows the model reproduces this box's step from this box's own
figures; it does not show the model extrapolates to a shape, model size or mesh it was not calibrated on,
nor to another machine. The GPU predictions rest on datasheet and cited figures instead
(tests/unit/test_steptime.py: Llama 3 405B within 5% of the published 41% MFU)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402
from _fork import gather_forked_ranks  # noqa: E402 - scripts/bench is on sys.path

from jobs.config import compose  # noqa: E402
from jobs.data import ensure_dataset  # noqa: E402
from jobs.events import EventLog  # noqa: E402
from jobs.launch.env import DistEnv  # noqa: E402
from jobs.planner.calibrate import calibrate  # noqa: E402
from jobs.planner.gate import build_plan  # noqa: E402
from jobs.trainer import Trainer  # noqa: E402
from jobs.validate import validate  # noqa: E402

MODELS = {
    "tiny": ["model=tiny"],
    "larger": ["model=tiny", "model.dim=256", "model.ffn_dim=768", "model.vocab_size=1024", "train.seq_len=128"],
}
COMMON = [
    "launcher.tasks_per_node=4",
    "train.global_batch=8",
    "train.micro_batch=2",
    "checkpoint.enabled=false",
    "calibrate.seconds=1.0",
]
MESHES = {
    "fsdp4": ["mesh.pp=1", "mesh.dp_shard=4", "mesh.tp=1"],
    "tp2_fsdp2": ["mesh.pp=1", "mesh.dp_shard=2", "mesh.tp=2"],
    "pp2_1f1b_fsdp2": ["mesh.pp=2", "mesh.dp_shard=2", "mesh.tp=1", "mesh.pp_schedule=1f1b"],
    "pp2_interleaved_fsdp2": [
        "mesh.pp=2",
        "mesh.dp_shard=2",
        "mesh.tp=1",
        "mesh.pp_schedule=interleaved_1f1b",
        "mesh.pp_stages_per_rank=2",
    ],
}
BOUNDS = (0.75, 1.25)
STEPS = 14
RANKS = 4


def _step_times(rank: int, overrides: list[str]) -> list[float]:
    # One intra-op thread per rank (2 cores shared by 4 ranks), set before any op: the parent ran the calibration's
    # ops with a thread pool, and a fork's first parallel region then waits forever on that pool's lock (futex).
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    cfg = compose(overrides)
    events = EventLog(Path(cfg.run.dir) / f"events{rank}.jsonl", rank=rank)
    tr = Trainer(cfg, validate(cfg), DistEnv.from_environ(), events=events)
    times = [tr.train_step(s)["step_time_s"] for s in range(STEPS)]
    tr.close()
    return times


def _measured(overrides: list[str]) -> float:
    """The median step (steps 2 on, the slowest rank's) of a fresh 4-rank trainer."""
    res = gather_forked_ranks(RANKS, lambda rank, _started: _step_times(rank, overrides), timeout_s=300)
    return statistics.median(max(r[i] for r in res) for i in range(2, STEPS))


def _predicted(overrides: list[str], figures: dict) -> dict:
    planned = compose(overrides)
    for key, value in figures.items():
        setattr(planned.cluster, key, value)
    return build_plan(planned, measure=False).step


def compare(model: str, tmp: Path, samples: int) -> dict[str, float]:
    """Each mesh's ratio predicted / measured (medians over up to `samples` rounds); prints every round."""
    base = [*MODELS[model], *COMMON, f"data.path={tmp / 'tokens.h5'}"]
    cfg = compose(base)
    ensure_dataset(cfg.data, vocab_size=cfg.model.vocab_size, sample_len=cfg.model.max_seq_len + 1)
    runs = {name: [*base, *mesh] for name, mesh in MESHES.items()}
    predicted: dict[str, list[dict]] = {name: [] for name in runs}  # one step per calibration
    measured: dict[str, list[float]] = {name: [] for name in runs}  # one median step per trainer run

    def ratio(name: str) -> float:
        return statistics.median(s["step_s"] for s in predicted[name]) / statistics.median(measured[name])

    out = list(runs)  # the meshes to measure (again) in this round
    for sample in range(samples):
        figures = calibrate(cfg, command=f"steptime_vs_measured {model} (sample {sample + 1})")
        for name, overrides in runs.items():
            predicted[name].append(_predicted([*overrides, f"run.dir={tmp / name}"], figures))  # no ledger there
        for name in out:
            measured[name].append(_measured([*runs[name], f"run.dir={tmp / name}_{sample}"]))
        out = [n for n in runs if not BOUNDS[0] <= ratio(n) <= BOUNDS[1]]
        print(f"{model} sample {sample + 1}: { {n: round(ratio(n), 2) for n in runs} }", flush=True)
        if not out:
            break
    for name, steps in predicted.items():
        s = steps[0]
        print(
            f"{model} {name}: predicted {[round(p['step_s'], 3) for p in steps]} s (the first: compute "
            f"{s['compute_s']:.3f}, host {s['host_s']:.3f}, exposed comm {s['comm_exposed_s']:.3f}, bubble "
            f"{s['bubble_s']:.3f}, dp tail {s['dp_exposed_s']:.3f}, optimizer {s['optimizer_s']:.3f}) measured "
            f"{[round(m, 3) for m in measured[name]]} s ratio of the medians {ratio(name):.2f}"
        )
    return {name: ratio(name) for name in runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=[*MODELS, "both"], default="both")
    ap.add_argument("--samples", type=int, default=3, help="rounds at most, each side (default 3)")
    args = ap.parse_args()
    ratios = {}
    for model in MODELS if args.model == "both" else [args.model]:
        with tempfile.TemporaryDirectory(prefix="steptime_vs_measured_") as tmp:
            ratios[model] = compare(model, Path(tmp), args.samples)
    bad = {m: {n: round(r, 2) for n, r in rs.items() if not BOUNDS[0] <= r <= BOUNDS[1]} for m, rs in ratios.items()}
    print(json.dumps({"ratios": ratios, "bounds": BOUNDS, "outside": {m: b for m, b in bad.items() if b}}))
    return 1 if any(bad.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
