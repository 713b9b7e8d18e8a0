"""Behaviour a mutation pass found unpinned by the unit tier, each test named after what it pins:
the collective timeout applied to every group, the spike median, the watchdog limit, the auto interval's
boundary and its restart cost, the commit order, a straggler's peers."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

import checkpoint.commit as commit_mod
import jobs.trainer as trainer_mod
from checkpoint import CheckpointConfig, CheckpointManager
from checkpoint.manifest import MANIFEST, read_manifest, write_manifest
from jobs.config import FailureConfig
from jobs.failure import watchdog as watchdog_mod
from jobs.failure.spike import new_detector, observe
from jobs.failure.timeouts import set_pg_timeouts
from jobs.telemetry.stragglers import StragglerDetector

# ------------------------------------------------------------------ failure.collective_timeout_s


def _pg_timeout_s(pg) -> float:
    return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_set_pg_timeouts_sets_every_group_of_this_rank_including_new_ones(tmp_path: Path) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        sub = dist.new_group(backend="gloo")  # a new group gets gloo's default (30 min), not the world's 60 s
        assert _pg_timeout_s(sub) == 1800.0
        assert set_pg_timeouts(7.0) == 2
        assert (_pg_timeout_s(dist.group.WORLD), _pg_timeout_s(sub)) == (7.0, 7.0)
    finally:
        dist.destroy_process_group()


def test_the_trainer_marks_only_the_attempts_first_step_as_first() -> None:
    # what Resilience.progress then does with it (failure.collective_timeout_s after the first step only):
    # tests/unit/test_resilience.py::test_collective_timeout_s_applies_after_the_first_step_only_and_checkpoint_groups_keep_theirs
    calls: list[tuple[int, bool]] = []
    emitted: list[tuple] = []
    stub = SimpleNamespace(
        resilience=SimpleNamespace(progress=lambda step, *, first: calls.append((step, first))),
        events=SimpleNamespace(emit=lambda kind, **f: emitted.append((kind, f))),
        _interval_end=lambda step: False,
        heldout=SimpleNamespace(due=lambda step: False),
        trained_steps=[],
    )
    times: list[float] = []
    trainer_mod.Trainer._after_step(stub, 1, {"step_time_s": 0.5}, times)
    trainer_mod.Trainer._after_step(stub, 2, {"step_time_s": 0.4}, times)
    assert calls == [(1, True), (2, False)]
    assert emitted == [("first_step", {"step": 1, "step_time_s": 0.5})] and times == [0.5, 0.4]


# ------------------------------------------------------------------ the spike window's median


def test_a_spike_is_judged_against_the_windows_median_not_its_mean() -> None:
    cfg = FailureConfig(spike_factor=2.0, spike_window=5, spike_patience=1)
    det = new_detector()
    for step, loss in enumerate([1.0, 1.0, 1.0, 1.0, 1.9]):  # 1.9 < 2 x 1.0: healthy, enters the window
        assert observe(det, step=step, loss=loss, grad_norm=1.0, cfg=cfg) is None
    # median 1.0 -> 2.2 > 2 x 1.0 is a spike; the mean (1.18) would have let it pass (2.2 < 2.36)
    spike = observe(det, step=5, loss=2.2, grad_norm=1.0, cfg=cfg)
    assert spike is not None and (spike.cls, spike.median, spike.first) == ("loss_spike", 1.0, 5)


# ------------------------------------------------------------------ the watchdog limit


class _Clock:
    """A fake clock for the watchdog module: its `wait` advances time by one heartbeat."""

    def __init__(self) -> None:
        self.t = 1000.0

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return self.t


def test_the_watchdog_fires_at_the_first_heartbeat_past_its_limit_exactly(tmp_path: Path, monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(watchdog_mod, "time", clock)
    fired: list[float] = []
    wd = watchdog_mod.Watchdog(
        run_dir=str(tmp_path),
        attempt="local.0",
        rank=0,
        node="n0",
        heartbeat_s=1.0,
        init_timeout_s=5.0,
        hang_timeout_s=10.0,
        on_hang=fired.append,
    )
    wd.progress(1)  # the limit is now the hang timeout, 10 s

    class _Done:
        waits = 0

        def wait(self, seconds: float) -> bool:
            clock.t += seconds
            self.waits += 1
            return self.waits > 30

    wd._done = _Done()
    wd._run()  # 30 heartbeats of fake time, in this thread
    # checks at idle 1, 2, ..., 10 (not past the limit), 11: fired once, there (at 1.4x it would be 15)
    assert fired == [11.0] and wd.fired_after_s == 11.0


# ------------------------------------------------------------------ the auto interval and checkpoint.restart_s


def _model():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _saved_with_interval(folder: Path, *, delta_s: float, step_time_s: float) -> None:
    """A committed step_10 whose manifest carries the interval inputs (delta_s, step_time_s) given."""
    model, opt = _model()
    ck = CheckpointManager(folder, cfg=CheckpointConfig(every_steps=10, async_mode="none"))
    ck.load_latest(model_parts=[model], optimizers=[opt])
    ck.save(10)
    ck.close()
    d = folder / "step_10"
    body = read_manifest(d, step=10)
    body["interval"] = {"delta_s": delta_s, "step_time_s": step_time_s}
    write_manifest(d, body)


def test_the_auto_interval_saves_exactly_when_its_steps_have_passed_with_restart_s_in_its_goodput(tmp_path) -> None:
    _saved_with_interval(tmp_path, delta_s=2.0, step_time_s=1.0)
    model, opt = _model()
    ck = CheckpointManager(
        tmp_path,
        cfg=CheckpointConfig(interval="auto", async_mode="none", restart_s=600.0),
        mtbf_s=3600.0,
        total_steps=10_000,
    )
    assert ck.load_latest(model_parts=[model], optimizers=[opt]) == 10
    # Daly 2006 eq. 37: tau = sqrt(2 x 2 x 3600) (1 + sqrt(x)/3 + x/9) - 2 with x = 2/7200: 118.670 s -> 119 steps
    # of 1 s; eq. 20 with R = 600 s: T_w = M e^(R/M) (e^((tau+delta)/M) - 1) / tau = 1.22163 -> goodput 0.81858
    # (R = 0 would give 0.96704).
    plan = ck.last_plan
    assert plan["interval_steps"] == 119 and plan["interval_s"] == pytest.approx(118.67037, abs=1e-4)
    assert plan["restart_s"] == 600.0 and plan["goodput"] == pytest.approx(0.81858, abs=1e-5)
    assert next(s for s in range(11, 200) if ck.due(s)) == 10 + 119  # due 119 steps past the save, not 120
    ck.close()


# ------------------------------------------------------------------ the commit order


def test_the_manifest_is_written_inside_the_temporary_folder_before_the_rename_commits_it(tmp_path, monkeypatch):
    """Whatever instant a save dies at, no step_<N> exists without its manifest: the rename is the commit."""
    seen: list[tuple] = []
    real_write, real_rename = commit_mod.write_manifest, os.rename

    def write(step_dir, body):
        seen.append(("manifest", Path(step_dir).name, (tmp_path / "step_1").exists()))
        real_write(step_dir, body)

    def rename(src, dst):
        if Path(src).parent == tmp_path:
            seen.append(("rename", Path(src).name, Path(dst).name, (Path(src) / MANIFEST).exists()))
        real_rename(src, dst)

    monkeypatch.setattr(commit_mod, "write_manifest", write)
    monkeypatch.setattr(commit_mod.os, "rename", rename)
    model, opt = _model()
    ck = CheckpointManager(tmp_path, cfg=CheckpointConfig(every_steps=1, async_mode="none"))
    ck.load_latest(model_parts=[model], optimizers=[opt])
    ck.save(1)
    ck.close()
    tmp = f"step_1.{ck.attempt}.tmp"  # this attempt's temporary folder (checkpoint/manager.py)
    assert seen == [("manifest", tmp, False), ("rename", tmp, "step_1", True)]


# ------------------------------------------------------------------ a straggler's peers


def test_a_rank_is_compared_with_its_peers_only_never_with_itself() -> None:
    # Two ranks: rank 1's peers' median is rank 0's 1.0 s, so 1.6 s is 1.6x (> 1.5). Counting rank 1
    # among its own peers would make the reference 1.3 s and the ratio 1.23: never named.
    det = StragglerDetector(names=("forward",), ratio=1.5, intervals=1, min_diff_s=0.0)
    (d,) = det.observe(np.array([[1.0], [1.6]]))
    assert (d.check, d.ranks, d.reference_s, d.ratio) == ("relative", [1], 1.0, pytest.approx(1.6))
