"""The trainer's failure hooks behind one object: stop signals, the watchdog's phases and progress, the bounded
collective timeouts, silent data corruption (jobs/failure/sdc.py) and loss spikes (jobs/failure/spike.py).

`Trainer` builds one from `failure.*` and calls it at fixed points of the loop, in this order:

    phase("load"); resume(st); stop_before_training(step)   start-up: rollbacks replayed, a stop signal honoured
    batch(step)                      the step's data, read at its data step (a rollback skips data)
    after_backward(step)             the SDC test seam (nothing unless MESHJOB_TEST_FLIP_GRAD is set)
    stop_requested                   this rank's stop flag, which the step's one all-reduce makes every rank's
    before_optimizer(step, st, ...)  SDC: a suspicious step is re-run from the same state; SilentCorruption if it differs
    after_step(st, m, ...)           the spike check, then the stop: a Verdict (roll back, or save and stop, or go on)
    progress(step, first=...)        the watchdog's clock; after the attempt's first step the shorter collective timeout
    phase("checkpoint_save") ...     a save or the wait for one is bounded by failure.checkpoint_timeout_s
    stopped(step)                    the stop step is committed: the ledger says so, the attempt ends

SDC comes before the spike check: the re-run needs the pre-step state, and only a step whose values repeat (the
data's, not the hardware's) may count toward a spike and roll back. Every decision is taken from numbers the step's
all-reduce made equal on every rank, so every rank decides alike without a collective of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from jobs.config import FailureConfig
from jobs.events import EventLog
from jobs.failure.sdc import SdcGuard, pipeline_groups, replica_groups
from jobs.failure.signals import StopSignals
from jobs.failure.spike import Load, TrainingHealth
from jobs.failure.timeouts import set_pg_timeouts
from jobs.failure.watchdog import Watchdog
from jobs.launch.env import DistEnv

__all__ = ["CHECKPOINT_PHASES", "Resilience", "Verdict"]

# The watchdog phases bounded by failure.checkpoint_timeout_s, not the hang timeout: a save, or the wait for one
# (a final write on a slow filesystem may take longer than failure.hang_timeout_s).
CHECKPOINT_PHASES = frozenset({"checkpoint_save", "checkpoint_wait"})


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the loop does after a step: `rolled_back` (a loss spike: the state is an earlier checkpoint's and the step
    is not recorded), else `stop` (an agreed stop signal: save this step, commit it, end the attempt), else go on."""

    rolled_back: bool = False
    stop: bool = False


class Resilience:
    """One rank's failure hooks of the training loop (the order of the calls: this module's docstring)."""

    def __init__(
        self,
        cfg: FailureConfig,
        env: DistEnv,
        *,
        mesh: DeviceMesh,
        events: EventLog,
        run_dir: str,
        vocab_size: int,
        stop: StopSignals | None = None,
        watchdog: Watchdog | None = None,
    ) -> None:
        self.cfg, self.events = cfg, events
        self._stop = stop or StopSignals()  # installed at process start by the launcher's rank entry
        self._watchdog = watchdog
        # Loss spikes: the step -> data step map, rollbacks and their LR scale (jobs/failure/spike.py).
        self._health = TrainingHealth(
            cfg,
            rank=env.rank,
            run_dir=run_dir,
            attempt=env.attempt,
            emit=events.emit,
            events_path=events.path,
            vocab_size=vocab_size,
        )
        # Silent data corruption: a suspicious step is re-run before its optimizer step (jobs/failure/sdc.py).
        self._sdc = SdcGuard(
            cfg,
            rank=env.rank,
            world_size=env.world_size,
            hostname=env.hostname,
            attempt=env.attempt,
            first_attempt=env.restart_count == 0 and env.restart_in_allocation == 0,
            emit=events.emit,
            groups=replica_groups(mesh),
            pipelines=pipeline_groups(mesh),
        )

    def attach(
        self,
        *,
        parts: list[nn.Module],
        data: Any,
        load: Load,
        schedulers: list[Any],
        agree: Callable[[Any], Any],
        wait_for_saves: Callable[[], None],
        checkpoint_groups: Callable[[], list[dist.ProcessGroup]],
    ) -> None:
        """The loop's side, once it is built: the model parts, the training data (a rollback's skip is its sample
        range), the checkpoint load and LR schedulers a rollback uses, rank 0's value on every rank, the wait for the
        save in flight, and the checkpoint's process groups. Every process group this rank has now gets
        failure.init_timeout_s, the checkpoint's failure.checkpoint_timeout_s."""
        self._health.bind(data)
        self._parts, self._data, self._load, self._schedulers = parts, data, load, schedulers
        self._agree, self._wait_for_saves, self._checkpoint_groups = agree, wait_for_saves, checkpoint_groups
        self._set_timeouts(self.cfg.init_timeout_s)

    @property
    def lr_scale(self) -> float:
        """The factor of the learning rate: the product of the rollbacks' failure.spike_lr_scale."""
        return self._health.lr_scale

    @property
    def stop_requested(self) -> bool:
        """Whether this rank holds a stop signal (the step's all-reduce tells every rank)."""
        return self._stop.received is not None

    def phase(self, name: str) -> None:
        """The loop moved on to `name` (load, train, checkpoint_save, checkpoint_wait): progress for the watchdog,
        under the phase's own limit (CHECKPOINT_PHASES: failure.checkpoint_timeout_s)."""
        if self._watchdog is not None:
            self._watchdog.phase(name, limit_s=self.cfg.checkpoint_timeout_s if name in CHECKPOINT_PHASES else None)

    def resume(self, st: Any) -> None:
        """After the first checkpoint load: every recorded rollback's data skip and LR scale again."""
        self._health.resume(st, load=self._load, schedulers=self._schedulers, agree=self._agree)

    def stop_before_training(self, step: int) -> bool:
        """Whether any rank already holds a stop signal (one all-reduce before the first step): a signal during
        start-up, with nothing new to save, ends the attempt (the ledger says so)."""
        flag = torch.tensor(1.0 if self.stop_requested else 0.0, dtype=torch.float64)
        dist.all_reduce(flag)
        if not flag > 0:
            return False
        self.events.emit("stop_requested", step=step, signal=self._stop.name, action="exit before training")
        return True

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's batch of step `step`, read at its data step (and the spike test seam, CORRUPT_VAR)."""
        return self._health.fetch(self._data, step, self._parts)

    def after_backward(self, step: int) -> None:
        """The SDC test seam: one flipped bit of this rank's gradient (nothing unless MESHJOB_TEST_FLIP_GRAD is set)."""
        self._sdc.inject(step, self._parts)

    def before_optimizer(
        self,
        step: int,
        st: Any,
        *,
        loss: float,
        grad_norm: float,
        forward_value: torch.Tensor,
        recompute: Callable[[], torch.Tensor],
    ) -> None:
        """Before step `step`'s optimizer step, with its global loss and grad norm: a suspicious step (or one whose
        replicas' gradients disagree) is computed again by `recompute` from the same state; raises SilentCorruption
        when the values differ, after the save in flight is committed. The spike detector is not changed."""
        self._sdc.check(
            step=step,
            suspicious=self._health.suspicious(st, loss=loss, grad_norm=grad_norm),
            forward_value=forward_value,
            parts=self._parts,
            recompute=recompute,
            wait_for_saves=self._wait_for_saves,
        )

    def after_step(self, st: Any, m: dict[str, Any], *, stop: bool, last: bool) -> Verdict:
        """Step `st.step` trained (not yet recorded), `m` its metrics (`data_step` is added), `stop` whether its
        all-reduce agreed on a stop, `last` whether it was the run's last step. The spike check comes first: a spike
        rolls back (st is then the checkpoint's; LossDiverged when it cannot), and a stop agreed in that step is
        agreed again by the next. A stop in the last step changes nothing (the run is done)."""
        if self._health.after_step(st, m, load=self._load, schedulers=self._schedulers):
            return Verdict(rolled_back=True)
        return Verdict(stop=stop and not last)

    def progress(self, step: int, *, first: bool) -> None:
        """Step `step` is recorded: the watchdog's clock restarts (under failure.hang_timeout_s from now on); after the
        attempt's `first` step every process group gets failure.collective_timeout_s, the checkpoint's keep theirs."""
        if self._watchdog is not None:
            self._watchdog.progress(step)
        if first:
            self._set_timeouts(self.cfg.collective_timeout_s)

    def stopped(self, step: int) -> None:
        """The stop step `step` is saved and committed: the ledger says so before the attempt ends."""
        self.events.emit(
            "stop_requested", step=step, signal=self._stop.name, action="checkpoint saved; ending the attempt"
        )

    def data_step(self, step: int) -> int:
        """The data step that step `step` reads (after rollbacks, past the data they skipped)."""
        return self._health.data_step(step)

    def known_rollbacks(self) -> int:
        """The rollbacks this run has recorded: a checkpoint load skips a RAM step of an abandoned timeline."""
        return self._health.known_rollbacks()

    def _set_timeouts(self, seconds: float) -> None:
        longer = {pg: self.cfg.checkpoint_timeout_s for pg in self._checkpoint_groups()}
        set_pg_timeouts(seconds, longer=longer)
