"""Stragglers on real 2-rank runs through `python -m jobs.train`: one rank slowed 2x in backward is named
(relative), every rank slowed is a `slowdown` against a healthy run's baseline and no straggler, and an
uninjected run of the same length names nobody.

CPU time on this 2-core box is noisy, so the checks judge windows of at least WINDOW_STEPS (20) steps, here
one log interval each: measured on 2026-12-03 (three runs of 64 steps each, 2 ranks, backward's CPU time per
step; per-interval medians):
  - per-step noise is large (29-68 ms around a median of 45) but common to both ranks (they slow down
    in the same steps), so the peer ratio of a 16-step interval's medians stays small: healthy at most
    1.09 (1.33 with 4-step intervals), the rank slowed 1.3x at least 1.25 (median 1.32). Here
    the healthy and all-slow runs judge at straggler_ratio 1.2 with log_every=20 (16 before the window
    WINDOW_STEPS of jobs/telemetry/stragglers.py).
  - the two ranks' CPU speeds also drift apart for whole windows: on 2026-12-06, six runs of 140 steps
    with rank 1's backward slowed 1.3x read per-window peer ratios of 1.12-1.53 (its forward, not slowed,
    0.88-1.17 in the same windows), and CI named nobody in 6 judged windows at straggler_ratio 1.15 (it
    had once broken the streak of K at 1.2 with 4). Slowed 1.5x, three more runs read 1.12-1.88: in one,
    rank 1's forward and optimizer ran 23% and 33% faster than its peer's for a whole window (each rank's
    CPU time per op moves with the core it runs on), and the streak broke. A slowdown under 1.5x is within
    this box's noise between two ranks (on a GPU the event clock has no such drift); the relative test
    slows rank 1 2x and judges at 1.2, so a window drops under the threshold only where rank 1's own CPU
    is 40% faster than its peer's (seen at most 25%).
  - between runs the whole machine's speed moves: three healthy runs back to back measured 55.9, 46.6
    and 43.5 ms (forward moved with it), so an all-rank 1.3x slowdown measured only 1.09-1.33x against
    the healthy run just before it. The absolute test therefore slows every rank 2x (1.6x or more
    against any of those baselines); on a GPU, event times are steady and the check needs no such
    margin. The baseline is the median of several healthy runs for the same reason (stragglers.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from jobs.events import read_events
from jobs.telemetry.phases import SLOW_PHASE_VAR
from jobs.telemetry.run_report import read_phases
from tests.conftest import run_train

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

LOG_EVERY, K, STEPS = 20, 3, 100  # 5 intervals (= windows: log_every is WINDOW_STEPS): 1 warm-up + 4 judged
RUN = [
    "mesh=single",
    "launcher.tasks_per_node=2",
    "mesh.dp_shard=2",
    f"train.log_every={LOG_EVERY}",
    f"failure.straggler_intervals={K}",
    "checkpoint.enabled=false",
]
# The slowed run: rank 1's backward 2x, 7 intervals (6 judged) at ratio 1.2 (see the module docstring: at
# 1.3x and 1.15, and at 1.5x and 1.2, one window whose peer ratio dipped under the threshold broke the streak).
SLOW_FACTOR, SLOW_STEPS, SLOW_RATIO = 2.0, 140, 1.2


def _train(
    tmp: Path, name: str, data_path: str, root: Path, slow: str | None = None, *, steps: int = STEPS, ratio: float = 1.2
) -> list[dict]:
    env = {SLOW_PHASE_VAR: slow} if slow else {}
    run = [
        *RUN,
        f"train.steps={steps}",
        f"failure.straggler_ratio={ratio}",
        f"data.path={data_path}",
        f"cluster.run_root={root}",
    ]
    r = run_train(run, tmp / name, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return read_events(tmp / name / "events.jsonl", "straggler")


def _cpu_medians(run_dir: Path, phase: str) -> list[float]:
    """Each rank's median CPU seconds per step in `phase`, from its telemetry file's `cpu` dataset: the spin that
    MESHJOB_TEST_SLOW_PHASE injects is CPU time, which the load of a shared box moves far less than wall time."""
    out = []
    for r in range(2):
        with h5py.File(run_dir / "telemetry" / f"rank{r}.h5", "r", locking=False) as f:
            cols = json.loads(f["cpu"].attrs["phases"])
            out.append(float(np.median(f["cpu"][:, cols.index(phase)])))
    return out


@pytest.fixture(scope="module")
def healthy(tmp_path_factory, data_path) -> tuple[Path, list[dict]]:
    """An uninjected run; it writes the baseline under its cluster.run_root."""
    tmp = tmp_path_factory.mktemp("stragglers")
    return tmp, _train(tmp, "healthy", data_path, tmp / "root")


def test_an_uninjected_run_names_no_straggler_and_writes_the_baseline(healthy) -> None:
    tmp, found = healthy
    assert found == []
    (baseline,) = (tmp / "root" / "baselines").glob("tiny_dp_shard2_local_*.json")
    phases = json.loads(baseline.read_text())["phases_s"]
    assert set(phases) == {"data", "forward", "backward", "optimizer"}
    assert phases["backward"] > 0.005 and json.loads(baseline.read_text())["intervals"] == STEPS // LOG_EVERY - 1


def test_a_rank_slowed_2x_in_backward_is_named_with_its_phase_within_k_intervals(tmp_path, data_path) -> None:
    found = _train(
        tmp_path,
        "slow_rank",
        data_path,
        tmp_path / "fresh_root",
        slow=f"1:backward:{SLOW_FACTOR}",
        steps=SLOW_STEPS,
        ratio=SLOW_RATIO,
    )
    rel = [e for e in found if e["check"] == "relative"]
    assert rel, found
    first = rel[0]
    assert (first["ranks"], first["phase"]) == ([1], "backward") and first["nodes"]
    # Named after K consecutive slow intervals (the unit tests pin "exactly at the K-th"): at the earliest
    # at step (1 + K) * LOG_EVERY, at the latest at the run's end (slack for intervals that noise breaks).
    assert (
        first["intervals"] == K
        and (1 + K) * LOG_EVERY <= first["step"] <= SLOW_STEPS
        and first["step"] % LOG_EVERY == 0
    )
    # injected 2x: the peer ratio is 2 x the ranks' own drift (0.75-1.25 on 2026-12-06, once 1.34 on
    # 2026-12-04), so up to 2.7; 3.5 or more would be a knob that spins the wrong factor (its factor is pinned
    # in tests/unit/test_stragglers.py). No lower bound on the event's ratio: the detector emits only above
    # SLOW_RATIO, so one would be true by construction.
    assert first["ratio"] < 3.5, first
    # The slowdown as the ranks' own telemetry recorded it over the whole run (median seconds per step),
    # independent of the detector: rank 1's backward is slower than its peer's beyond the noise.
    phases = read_phases(tmp_path / "slow_rank" / "telemetry")
    assert 1.3 < phases[1]["backward"] / phases[0]["backward"] < 3.5, phases
    assert all(e["ranks"] == [1] for e in rel), rel  # rank 0 waits in `collective`, which is not judged
    assert not read_events(tmp_path / "slow_rank" / "events.jsonl", "slowdown")  # a fresh baseline root


def test_every_rank_slowed_2x_is_a_slowdown_against_the_baseline_and_no_straggler(healthy, data_path) -> None:
    tmp, _ = healthy
    found = _train(tmp, "all_slow", data_path, tmp / "root", slow="all:backward:2")
    assert found == []  # no rank is to blame: neither a relative nor an individual straggler, nor one naming all
    slowdowns = read_events(tmp / "all_slow" / "events.jsonl", "slowdown")
    backward = [e for e in slowdowns if e["phase"] == "backward"]
    assert backward and backward[0]["cause"].startswith("backward grew"), slowdowns
    # injected 2x: measured 2.0-2.7 against the healthy run before it, and once 1.33 (2026-12-03: the box ran
    # the slowed run 1.5x faster than the healthy one; a bound of 1.5 failed there): not 3.5x. Its lower bound
    # (straggler_ratio 1.2) is the detector's own condition, so it is asserted on the telemetry instead: every
    # rank's recorded backward CPU time against the healthy run's, which no peer comparison could see. Wall time
    # failed this in two CI runs (the healthy run's backward wall time under load as long as the slowed one's).
    assert backward[0]["ratio"] < 3.5 and backward[0]["clock"] == "work", backward
    slow, base = _cpu_medians(tmp / "all_slow", "backward"), _cpu_medians(tmp / "healthy", "backward")
    assert all(s > 1.2 * b for s, b in zip(slow, base)), (slow, base)
    assert backward[0]["step"] <= STEPS
    # A run with a slowdown does not replace the baseline it was judged against.
    (baseline,) = (tmp / "root" / "baselines").glob("*.json")
    assert json.loads(baseline.read_text())["run_dir"] == str(tmp / "healthy")
