"""A stop notice that arrives during a failure or an in-allocation restart is not lost: a pending
stop turns the decider's restart into a requeue, and the supervisor starts no step after a stop signal or inside
the time-limit warning's lead before EndTime, requeueing instead."""

from __future__ import annotations

import os
import signal
import stat
import sys
import time
from pathlib import Path

from jobs import exitcodes
from jobs.events import read_events
from jobs.failure.incident import Incident
from jobs.failure.respond import conclude
from jobs.launch import supervise
from tests.unit.test_requeue_path import _ctx, _job, slurm  # noqa: F401 - slurm: the stand-in fixture
from tests.unit.test_supervisor_decides import _cfg, run_dir  # noqa: F401 - run_dir: a fixture


def _dead(node: str) -> Incident:
    return Incident("dead_rank", "9.0", 0, "rank 1 died", [{"rank": 1, "node": node, "state": "dead"}])


def test_a_stop_that_arrived_during_the_failure_turns_the_restart_into_a_requeue(tmp_path: Path, slurm: Path) -> None:
    # Before: the decider restarted the ranks; the new step started without the flag and the time limit ended the
    # job TIMEOUT, never requeued.
    _job(slurm, answering=["node2"])
    ctx = _ctx(tmp_path, supervised=True)
    assert conclude(ctx, cause="dead_rank", step=12, incident=_dead("node2")) == exitcodes.REQUEUE
    assert read_events(tmp_path / "events.jsonl", "decision")[-1]["action"] == "restart"  # no stop: a restart
    ctx = _ctx(tmp_path / "b", supervised=True)
    ctx.pending_stop = lambda: "SIGUSR2"
    assert conclude(ctx, cause="dead_rank", step=12, incident=_dead("node2")) == exitcodes.REQUEUE
    (d,) = read_events(tmp_path / "b" / "events.jsonl", "decision")
    assert d["action"] == "requeue" and d["reason"].startswith(
        "dead_rank, and SIGUSR2 arrived: no restart inside the allocation; SIGUSR2: requeue 1 of"
    ), d
    assert _job(slurm)["restarts"] == 1


# The ranks' step: its decider decides "restart"; `signal` (if any) reaches the supervisor meanwhile.
_SRUN = """#!{python}
import json, os, signal, sys
d = os.environ["FAKE_SLURM"]
os.makedirs(os.path.join(d, "steps"), exist_ok=True)
n = len(os.listdir(os.path.join(d, "steps")))
open(os.path.join(d, "steps", str(n)), "w").close()
if n == 0:
    run = os.environ["RUN"]
    os.makedirs(run + "/incidents/9.0", exist_ok=True)
    json.dump({{"action": "restart", "reason": "x", "exit_code": 75}}, open(run + "/incidents/9.0/decision.json", "w"))
    if {signal}:
        os.kill(os.getppid(), {signal})
    sys.exit(75)
sys.exit(0)
"""


def _steps(slurm: Path) -> int:
    return len(os.listdir(slurm / "steps"))


def _setup(run_dir: Path, slurm: Path, monkeypatch, *, signal: int) -> None:
    (slurm / "srun").write_text(_SRUN.format(python=sys.executable, signal=signal))
    (slurm / "srun").chmod((slurm / "srun").stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("RUN", str(run_dir))
    run_dir.mkdir(parents=True)


def test_a_stop_signal_to_the_supervisor_during_a_restart_requeues_the_job(
    run_dir: Path,  # noqa: F811 - the fixture imported above
    slurm: Path,  # noqa: F811
    monkeypatch,
) -> None:
    # Before: the supervisor returned the restart decision's 75 and nobody requeued: the job ended there.
    import signal

    _setup(run_dir, slurm, monkeypatch, signal=int(signal.SIGUSR2))
    assert supervise.supervise(_cfg(run_dir), logs=("o", "e")) == exitcodes.REQUEUE
    assert _steps(slurm) == 1 and _job(slurm)["restarts"] == 1
    (d,) = read_events(run_dir / "events.jsonl", "decision")
    assert (d["attempt"], d["cause"], d["action"]) == ("9.0.1", "SIGUSR2", "requeue"), d


def test_the_supervisor_starts_no_step_inside_the_time_limit_warnings_lead(
    run_dir: Path,  # noqa: F811
    slurm: Path,  # noqa: F811
    monkeypatch,
) -> None:
    # Before: the ranks were started again 30 s before the time limit, after its warning had gone to nobody.
    _setup(run_dir, slurm, monkeypatch, signal=0)
    _job(slurm, end=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 30)))
    cfg = _cfg(run_dir, "launcher.signal_delay_s=120")
    assert supervise.supervise(cfg, logs=("o", "e")) == exitcodes.REQUEUE
    assert _steps(slurm) == 1 and _job(slurm)["restarts"] == 1
    (d,) = read_events(run_dir / "events.jsonl", "decision")
    assert (d["attempt"], d["cause"], d["action"]) == ("9.0.1", "walltime", "requeue"), d


def test_far_from_the_time_limit_the_supervisor_restarts_the_ranks(
    run_dir: Path,  # noqa: F811
    slurm: Path,  # noqa: F811
    monkeypatch,
) -> None:
    _setup(run_dir, slurm, monkeypatch, signal=0)
    _job(slurm, end=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 3600)))
    assert supervise.supervise(_cfg(run_dir, "launcher.signal_delay_s=120"), logs=("o", "e")) == exitcodes.OK
    assert _steps(slurm) == 2 and _job(slurm)["restarts"] == 0


def test_ranks_torchrun_restarts_inside_the_warnings_lead_take_the_warning_as_arrived(
    tmp_path: Path,
    slurm: Path,  # noqa: F811
) -> None:
    # Before: USR2 sent while torchrun restarted the ranks reached no process that handles it (the agent ignores
    # it, new ranks inherit that): the restarted ranks trained into the time limit, TIMEOUT, never requeued.
    from jobs.config import compose
    from jobs.failure.signals import StopSignals
    from jobs.launch import slurm as slurm_launch
    from jobs.launch.env import DistEnv

    cfg = compose(["launcher=slurm", f"run.dir={tmp_path}", "launcher.signal_delay_s=120"])
    _job(slurm, end=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 60)))

    def env(rank: int, restart_in_allocation: int) -> DistEnv:
        return DistEnv(
            rank=rank,
            local_rank=rank,
            world_size=2,
            local_world_size=2,
            node_rank=0,
            nodes=1,
            master_addr="a",
            master_port=1,
            restart_in_allocation=restart_in_allocation,
            job_id="9",
        )

    stops = {(r, n): StopSignals() for r in (0, 1) for n in (0, 1)}
    for (r, n), stop in stops.items():
        slurm_launch._missed_warning(cfg, env(r, n), stop)
    assert {k: s.name for k, s in stops.items()} == {(0, 0): None, (1, 0): None, (0, 1): "SIGUSR2", (1, 1): None}
    _job(slurm, end=time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 3600)))
    far = StopSignals()
    slurm_launch._missed_warning(cfg, env(0, 1), far)
    assert far.name is None


def test_the_local_launcher_does_not_restart_the_ranks_after_a_stop_signal(tmp_path: Path, monkeypatch) -> None:
    # Before: Ctrl-C (or USR2) while a rank died and the decider restarted: the launcher started the ranks again.
    from jobs.config import compose
    from jobs.failure import policy
    from jobs.failure.policy import Decision
    from jobs.failure.respond import AttemptContext
    from jobs.launch import local

    cfg = compose([f"run.dir={tmp_path}", "launcher.tasks_per_node=2"])
    starts: list[int] = []

    def launch_once(cfg, events, *, restart, restart_in_allocation, early):
        starts.append(restart_in_allocation)
        ctx = AttemptContext(
            run_dir=cfg.run.dir,
            attempt="local.0",
            rank=-1,
            world_size=2,
            job_id=None,
            restart_count=0,
            cfg=cfg.failure,
            events=events,
            supervised=True,
        )
        if restart_in_allocation:  # (before the fix) the restarted ranks finish
            ctx.attempt = "local.0.1"
            return exitcodes.OK, ctx
        policy.publish(tmp_path, "local.0", Decision("restart", "dead_rank: restart 1", 75, 0, 10, 0))
        ctx.pending_stop = lambda: "SIGUSR2"  # as `_supervise` sets it once a signal reached the launcher
        return exitcodes.RANK_DIED, ctx

    monkeypatch.setattr(local, "_launch_once", launch_once)
    assert local.launch(cfg) == exitcodes.REQUEUE and starts == [0]


def test_under_torchrun_the_agents_sigterm_to_its_surviving_workers_is_no_stop_notice() -> None:
    # A torchrun agent stops its surviving workers with SIGTERM when one dies, before it restarts them: taken for a
    # stop notice, that turned every torchrun restart into a requeue (the torchrun chaos case: `dead_rank, and
    # SIGTERM arrived`). Slurm's notice (USR2) still counts there, and SIGTERM counts everywhere else.
    from jobs.failure.signals import StopSignals
    from jobs.launch.rank import stop_notice

    def arrived(signum: int | None) -> StopSignals:
        stop = StopSignals()
        if signum is not None:
            stop.note(signum)
        return stop

    assert stop_notice(arrived(signal.SIGTERM), torchrun=True) is None
    assert stop_notice(arrived(signal.SIGUSR2), torchrun=True) == "SIGUSR2"
    assert stop_notice(arrived(signal.SIGTERM), torchrun=False) == "SIGTERM"
    assert stop_notice(arrived(None), torchrun=False) is None


def test_the_rank_environment_says_when_its_ranks_are_torchruns_workers() -> None:
    from jobs.launch.env import DistEnv

    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"}
    assert DistEnv.from_environ({**base, "TORCHELASTIC_RUN_ID": "9"}).torchrun
    assert not DistEnv.from_environ(base).torchrun
