"""The test seam's fixed-stall form (MESHJOB_TEST_SLOW_PHASE="<rank|all>:<phase>:+<seconds>"): a floor on a phase's time,
optionally in one run of the job only ("...:<restart>")."""

from __future__ import annotations

import time

import pytest

from jobs.telemetry.phases import PhaseTimer, SlowPhase, slow_phase_from_env


def test_the_plus_form_is_a_fixed_stall_for_its_rank_or_all() -> None:
    assert slow_phase_from_env(3, {"MESHJOB_TEST_SLOW_PHASE": "all:optimizer:+0.7"}) == SlowPhase(None, "optimizer", 1.0, 0.7)
    assert slow_phase_from_env(0, {"MESHJOB_TEST_SLOW_PHASE": "1:optimizer:+0.7"}) is None


def test_a_restart_field_limits_the_slowdown_to_that_run_of_the_job() -> None:
    # the chaos time-limit case stalls the run that Slurm's warning must end, not the requeued one
    env = {"MESHJOB_TEST_SLOW_PHASE": "all:optimizer:+0.7:0"}
    assert slow_phase_from_env(1, env) == slow_phase_from_env(1, env, restart_count=0) == SlowPhase(None, "optimizer", 1.0, 0.7)
    assert slow_phase_from_env(1, env, restart_count=1) is None
    assert slow_phase_from_env(0, {"MESHJOB_TEST_SLOW_PHASE": "0:backward:2:1"}, restart_count=1) == SlowPhase(0, "backward", 2.0)
    assert slow_phase_from_env(0, {"MESHJOB_TEST_SLOW_PHASE": "0:backward:2:1"}, restart_count=2) is None
    with pytest.raises(ValueError, match=r"\[:<restart>\]"):
        slow_phase_from_env(0, {"MESHJOB_TEST_SLOW_PHASE": "all:optimizer:+0.7:0:1"})


def test_a_stalled_phase_lasts_at_least_the_stall_whatever_its_work(tmp_path) -> None:
    timer = PhaseTimer(tmp_path, rank=0, attempt="0", pp=False, slow=SlowPhase(None, "optimizer", 1.0, 0.2))
    t0 = time.perf_counter()
    with timer.phase("optimizer"):
        pass
    with timer.phase("forward"):  # another phase is not stalled
        pass
    assert time.perf_counter() - t0 >= 0.2
    assert timer._row["optimizer"] >= 0.2 and timer._row["forward"] < 0.1


def test_a_ranks_timer_gets_the_slowdown_of_its_own_run_only(tmp_path, monkeypatch) -> None:
    import dataclasses

    import torch

    from jobs.config import compose
    from jobs.events import EventLog
    from jobs.launch.env import DistEnv
    from jobs.telemetry.rank_telemetry import build_step_telemetry

    monkeypatch.setenv("MESHJOB_TEST_SLOW_PHASE", "all:optimizer:+0.7:1")
    cfg = compose(["mesh=single", "launcher.tasks_per_node=1", f"run.dir={tmp_path}", f"cluster.run_root={tmp_path}"])
    first = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, nodes=1, master_addr="x",
                    master_port=0, hostname="node1")
    slow = {}
    for env in (first, dataclasses.replace(first, restart_count=1)):
        st = build_step_telemetry(cfg, env, events=EventLog(tmp_path / "events.jsonl"), pp=False, mesh="single",
                                  device=torch.device("cpu"), mixed_precision="fp32")
        slow[env.restart_count] = st.timer.slow
    assert slow == {0: None, 1: SlowPhase(None, "optimizer", 1.0, 0.7)}
