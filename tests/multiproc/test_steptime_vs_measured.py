"""The planner's predicted step time against the real trainer on this machine: calibrate a `local`
profile (a short `jobs.planner.calibrate` run on the same 4 ranks), predict the step of the tiny
model and of a larger CPU model on four meshes (FSDP, TP, PP 1F1B, PP interleaved), run the trainer
on each right after, and compare with the median measured step (steps 2-7, the slowest rank's).

Calibration and measurement run back to back in one test because this machine is shared: its
speed changes from minute to minute, and a profile measured earlier would not describe it.
Bound: predicted / measured within 0.75-1.25 (issue 13 item 3).

Measured on 2026-12-03 on the shared 2-core box under a load average of 5-15 from other jobs
(predicted / measured, fsdp4, tp2_fsdp2, pp2_1f1b_fsdp2, pp2_interleaved_fsdp2):
  tiny   1.09 0.86 1.61 1.05 | 0.50 0.55 0.82 0.44 | 0.46 0.30 0.98 0.52
  larger 0.74 0.67 1.21 0.88 | 0.94 0.63 0.56 0.44
The same mesh's measured step moved by 2x between runs (pp2_1f1b tiny: 0.100 to 0.247 s) and the
calibrated rate by 3x: on that box this test fails; it is meant for an idle CI machine, where it
has not been seen to pass yet. 128-183 s.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import pytest

from jobs.config import compose
from jobs.data import ensure_dataset
from jobs.events import EventLog
from jobs.launch.env import DistEnv
from jobs.planner.calibrate import calibrate
from jobs.planner.gate import build_plan
from jobs.trainer import Trainer
from jobs.validate import validate
from tests.multiproc._ranks import run_ranks

pytestmark = [
    pytest.mark.multiproc, pytest.mark.slow,
    # Not yet true, so not in the default run (it would fail CI): on an idle 2-core machine (2026-12-03,
    # load < 2) the model predicted 0.61-0.89 of the measured step (tiny 0.81 0.89 0.81 0.71, larger
    # 0.61 0.78 0.73 0.79); with the calibrated host time of FSDP2 units and pipeline actions 0.70-0.95
    # (tiny 0.70 0.72 0.77 0.79, larger - 0.74 0.85 0.95), still under: the trainer's own per-step Python
    # and DTensor's per-op cost beyond the tp rate are not in it, and the same mesh's measured step moved
    # 1.45x between runs (tiny fsdp4 0.118 and 0.171 s). Issue 13 item 3 stays open; MESHJOB_STEPTIME_CHECK=1 runs it.
    pytest.mark.skipif(os.environ.get("MESHJOB_STEPTIME_CHECK") != "1",
                       reason="step-time model not yet within 25% on CPU (issue 13 item 3); MESHJOB_STEPTIME_CHECK=1 runs it"),
]

MODELS = {
    "tiny": ["model=tiny"],
    "larger": ["model=tiny", "model.dim=256", "model.ffn_dim=768", "model.vocab_size=1024", "train.seq_len=128"],
}
COMMON = ["launcher.tasks_per_node=4", "train.global_batch=8", "train.micro_batch=2", "checkpoint.enabled=false",
          "calibrate.seconds=0.3"]
MESHES = {
    "fsdp4": ["mesh.pp=1", "mesh.dp_shard=4", "mesh.tp=1"],
    "tp2_fsdp2": ["mesh.pp=1", "mesh.dp_shard=2", "mesh.tp=2"],
    "pp2_1f1b_fsdp2": ["mesh.pp=2", "mesh.dp_shard=2", "mesh.tp=1", "mesh.pp_schedule=1f1b"],
    "pp2_interleaved_fsdp2": ["mesh.pp=2", "mesh.dp_shard=2", "mesh.tp=1", "mesh.pp_schedule=interleaved_1f1b",
                              "mesh.pp_stages_per_rank=2"],
}
BOUNDS = (0.75, 1.25)
STEPS = 10


def _step_times(rank: int, world: int, overrides: list[str]) -> list[float]:
    cfg = compose(overrides)
    events = EventLog(Path(cfg.run.dir) / f"events{rank}.jsonl", rank=rank)
    tr = Trainer(cfg, validate(cfg), DistEnv.from_environ(), events=events)
    times = [tr.train_step(s)["step_time_s"] for s in range(STEPS)]
    tr.close()
    return times


@pytest.mark.parametrize("model", list(MODELS))
def test_predicted_step_time_is_within_25_percent_of_the_measured_one(model: str, tmp_path) -> None:
    base = [*MODELS[model], *COMMON, f"data.path={tmp_path / 'tokens.h5'}"]
    cfg = compose(base)
    ensure_dataset(cfg.data, vocab_size=cfg.model.vocab_size, sample_len=cfg.model.max_seq_len + 1)
    figures = calibrate(cfg, command=f"test_steptime_vs_measured {model}")
    ratios = {}
    for name, mesh in MESHES.items():
        overrides = [*base, *mesh, f"run.dir={tmp_path / name}"]
        planned = compose(overrides)
        for key, value in figures.items():
            setattr(planned.cluster, key, value)
        step = build_plan(planned, measure=False).step
        res = run_ranks(_step_times, 4, overrides, timeout=300).results
        measured = statistics.median(max(res[r][i] for r in res) for i in range(2, STEPS))
        ratios[name] = step["step_s"] / measured
        print(f"{model} {name}: predicted {step['step_s']:.3f} s (compute {step['compute_s']:.3f}, host {step['host_s']:.3f}, exposed comm "
              f"{step['comm_exposed_s']:.3f}, bubble {step['bubble_s']:.3f}, dp tail {step['dp_exposed_s']:.3f}, "
              f"optimizer {step['optimizer_s']:.3f}) "
              f"measured {measured:.3f} s ratio {ratios[name]:.2f}")
    bad = {k: round(v, 2) for k, v in ratios.items() if not BOUNDS[0] <= v <= BOUNDS[1]}
    assert not bad, f"predicted / measured outside {BOUNDS}: {bad} (all: {ratios})"
