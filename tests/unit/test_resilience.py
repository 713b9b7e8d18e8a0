"""The trainer's failure hooks behind one object (jobs/failure/resilience.py), on one real gloo process: the order
of the decisions (the SDC re-run before the spike check, a rollback before a stop, a stop in the last step ignored),
the stop notices in the ledger, the watchdog's limit per phase, and the collective timeouts."""

from __future__ import annotations

import copy
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from checkpoint import TrainState
from jobs.config import DataConfig, FailureConfig
from jobs.data import BatchSource, ensure_dataset
from jobs.events import EventLog, read_events
from jobs.failure.resilience import Resilience, Verdict
from jobs.failure.sdc import SilentCorruption
from jobs.failure.signals import StopSignals
from jobs.failure.watchdog import Watchdog
from jobs.launch.env import DistEnv

ENV = DistEnv(
    rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, nodes=1, master_addr="", master_port=0
)
SPIKES = {"spike_factor": 2.0, "spike_window": 2, "spike_patience": 1, "spike_skip_steps": 1}


@pytest.fixture
def mesh(tmp_path: Path):
    """The world of one gloo rank and its mesh: the all-reduce, the timeouts and the SDC gather are the real ones."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=60)
    )
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_shard",))
    finally:
        dist.destroy_process_group()


class _Loop:
    """The trainer's side of one rank: a model with gradients, real data, a TrainState, checkpoints kept as state
    dicts, and what it was asked (loads, waits for the save in flight)."""

    def __init__(self, tmp_path: Path) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 4)
        self.model(torch.ones(2, 4)).square().mean().backward()
        data = DataConfig(path=str(tmp_path / "tokens.h5"), num_samples=32, gen_seed=1)
        ensure_dataset(data, vocab_size=32, sample_len=9)
        self.data = BatchSource(data.path, seed=0, global_batch=4, seq_len=8, dp_rank=0, dp=1)
        self.st, self.ckpts, self.asked = TrainState(), {}, []

    def load(self, before_step: int | None = None) -> int:
        self.asked.append(("load", before_step))
        ok = [s for s in self.ckpts if before_step is None or s < before_step]
        if not ok:
            return 0
        self.st.load_state_dict(copy.deepcopy(self.ckpts[max(ok)]))
        return max(ok)

    def attach(self, r: Resilience) -> Resilience:
        r.attach(
            parts=[self.model],
            data=self.data,
            load=self.load,
            schedulers=[],
            agree=lambda x: x,
            wait_for_saves=lambda: self.asked.append("wait_for_saves"),
            checkpoint_groups=list,
        )
        return r

    def healthy_steps(self, r: Resilience, n: int) -> None:
        for _ in range(n):
            assert r.after_step(self.st, {"loss": 1.0, "grad_norm": 1.0}, stop=False, last=False) == Verdict()
            self.st.record(step=self.st.step + 1, loss=1.0, tokens=32)


def _resilience(tmp_path: Path, mesh, **kw) -> tuple[Resilience, EventLog]:
    failure = {k: kw.pop(k) for k in list(kw) if k in FailureConfig.__dataclass_fields__}
    events = EventLog(tmp_path / "events.jsonl", attempt="local.0")
    r = Resilience(FailureConfig(**failure), ENV, mesh=mesh, events=events, run_dir=str(tmp_path), vocab_size=32, **kw)
    return r, events


def _kinds(events: EventLog) -> list[str]:
    return [e["kind"] for e in read_events(events.path)]


def test_a_suspicious_step_is_rerun_before_the_spike_check_and_rolls_back_when_its_values_repeat(tmp_path, mesh):
    loop = _Loop(tmp_path)
    r, events = _resilience(tmp_path, mesh, **SPIKES)
    loop.attach(r)
    loop.healthy_steps(r, 2)
    loop.ckpts[2] = copy.deepcopy(loop.st.state_dict())  # the detector's window [1.0, 1.0] is in it
    grad, reruns = loop.model.weight.grad.clone(), []

    def recompute() -> torch.Tensor:  # the same batch from the same state: the same values (the data's spike)
        reruns.append(loop.st.step)
        loop.model.weight.grad = grad.clone()
        return torch.tensor(5.0)

    loop.healthy_steps(r, 1)  # step 2 -> 3
    r.before_optimizer(3, loop.st, loss=5.0, grad_norm=1.0, forward_value=torch.tensor(5.0), recompute=recompute)
    assert reruns == [3] and loop.st.health["detector"]["streak"] == []  # re-run; the spike detector untouched
    verdict = r.after_step(loop.st, {"loss": 5.0, "grad_norm": 1.0}, stop=True, last=False)
    # the spike rolls back to step 2 and skips data step 3; the stop agreed in that step waits for the next step
    assert verdict == Verdict(rolled_back=True, stop=False) and loop.st.step == 2
    assert loop.asked == [("load", 4)] and r.data_step(3) == 4
    assert _kinds(events) == ["sdc_check", "loss_spike", "rollback"]
    assert [e["verdict"] for e in read_events(events.path, "sdc_check")] == ["data"]


def test_a_step_whose_values_differ_on_its_rerun_ends_in_sdc_before_the_spike_check_sees_it(tmp_path, mesh):
    loop = _Loop(tmp_path)
    r, events = _resilience(tmp_path, mesh, **SPIKES)
    loop.attach(r)
    loop.healthy_steps(r, 2)

    def recompute() -> torch.Tensor:  # a flipped bit in the first run: the re-run's gradient differs
        loop.model.weight.grad = loop.model.weight.grad * 2
        return torch.tensor(5.0)

    with pytest.raises(SilentCorruption) as e:
        r.before_optimizer(2, loop.st, loss=5.0, grad_norm=1.0, forward_value=torch.tensor(5.0), recompute=recompute)
    assert e.value.incident.cls == "sdc" and [s["rank"] for s in e.value.incident.suspects] == [0]
    assert loop.asked == ["wait_for_saves"]  # the save in flight committed; nothing loaded, nothing rolled back
    assert loop.st.health["detector"] == {"history": [1.0, 1.0], "streak": []}
    assert _kinds(events) == ["sdc_check"]


def test_an_agreed_stop_ends_the_attempt_unless_it_came_in_the_last_step(tmp_path, mesh):
    loop = _Loop(tmp_path)
    r, _ = _resilience(tmp_path, mesh, **SPIKES)
    loop.attach(r)
    m = {"loss": 1.0, "grad_norm": 1.0}
    assert r.after_step(loop.st, dict(m), stop=True, last=False) == Verdict(stop=True)
    assert r.after_step(loop.st, dict(m), stop=True, last=True) == Verdict()
    assert r.after_step(loop.st, dict(m), stop=False, last=False) == Verdict()


def test_a_stop_signal_before_training_and_a_committed_stop_step_are_written_to_the_ledger(tmp_path, mesh):
    loop = _Loop(tmp_path)
    quiet, _ = _resilience(tmp_path / "quiet", mesh, stop=StopSignals())
    assert not loop.attach(quiet).stop_requested and not quiet.stop_before_training(0)
    stop = StopSignals()
    stop.note(signal.SIGUSR2)  # as the handler records it
    r, events = _resilience(tmp_path, mesh, stop=stop)
    loop.attach(r)
    assert r.stop_requested and r.stop_before_training(3)
    r.stopped(7)
    assert [(e["step"], e["signal"], e["action"]) for e in read_events(events.path, "stop_requested")] == [
        (3, "SIGUSR2", "exit before training"),
        (7, "SIGUSR2", "checkpoint saved; ending the attempt"),
    ]
    assert not (tmp_path / "quiet" / "events.jsonl").exists()


def test_the_watchdog_limit_follows_the_phase_and_a_checkpoint_phase_gets_checkpoint_timeout_s(tmp_path, mesh):
    wd = Watchdog(
        run_dir=str(tmp_path),
        attempt="local.0",
        rank=0,
        node="node7",
        heartbeat_s=1.0,
        init_timeout_s=600.0,
        hang_timeout_s=30.0,
        on_hang=lambda idle: None,
    )  # not started: its threads are not what is tested
    r, _ = _resilience(tmp_path, mesh, watchdog=wd, init_timeout_s=600.0, hang_timeout_s=30.0, checkpoint_timeout_s=555)
    _Loop(tmp_path).attach(r)
    limits = []
    for call in (
        lambda: r.phase("load"),
        lambda: r.progress(1, first=True),
        lambda: r.phase("checkpoint_save"),
        lambda: r.phase("train"),
        lambda: r.phase("checkpoint_wait"),
    ):
        call()
        limits.append((wd.beat.phase, wd.beat.step, wd.limit_s))
    assert limits == [
        ("load", -1, 600.0),
        ("load", 1, 30.0),
        ("checkpoint_save", 1, 555.0),
        ("train", 1, 30.0),
        ("checkpoint_wait", 1, 555.0),
    ]


def _timeout_s(pg) -> float:
    return pg._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_collective_timeout_s_applies_after_the_first_step_only_and_checkpoint_groups_keep_theirs(tmp_path, mesh):
    loop = _Loop(tmp_path)
    ckpt_group = dist.new_group(backend="gloo")
    r, _ = _resilience(tmp_path, mesh, init_timeout_s=600.0, collective_timeout_s=42.0, checkpoint_timeout_s=1234.0)
    r.attach(
        parts=[loop.model],
        data=loop.data,
        load=loop.load,
        schedulers=[],
        agree=lambda x: x,
        wait_for_saves=lambda: None,
        checkpoint_groups=lambda: [ckpt_group],
    )
    assert (_timeout_s(dist.group.WORLD), _timeout_s(ckpt_group)) == (600.0, 1234.0)
    r.progress(1, first=True)
    assert (_timeout_s(dist.group.WORLD), _timeout_s(ckpt_group)) == (42.0, 1234.0)
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=7), dist.group.WORLD)
    r.progress(2, first=False)
    assert _timeout_s(dist.group.WORLD) == 7.0  # later steps leave the timeouts alone
