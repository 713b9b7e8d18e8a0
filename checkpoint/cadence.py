"""When each checkpoint tier saves: the interval state and the Young/Daly retuning from measured save costs
(`checkpoint.interval=auto`, `checkpoint.memory_interval=auto`; the formulas are checkpoint/interval.py and
checkpoint/tiers.py). CheckpointManager holds one `Cadence` and tells it the steps, the saves and their costs."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from typing import Any

from checkpoint.interval import interval_steps, plan_interval
from checkpoint.tiers import FILESYSTEM, MEMORY, cadence_share, memory_interval_s, memory_mtbf_s, tier_mtbf_s

log = logging.getLogger("meshjob.checkpoint")

__all__ = ["Cadence", "check_auto"]


def check_auto(cfg: Any, mtbf_s: float | None) -> None:
    """An auto interval needs the job MTBF: a config error naming the fix when there is none."""
    for key, mode in (("interval", cfg.interval), ("memory_interval", cfg.memory_interval)):
        if mode == "auto" and (mtbf_s is None or mtbf_s <= 0):
            raise ValueError(
                f"checkpoint.{key}=auto needs the job MTBF (got {mtbf_s}); set failure.mtbf_job_hours "
                f"or failure.mtbf_node_hours, or use checkpoint.{key}=steps"
            )


class Cadence:
    """The save intervals of both tiers, learnt from the steps and the saves as they go; identical on every rank.

    `agree_max(values)`: the element-wise max of `values` over the ranks (a collective, called at the same point on
    every rank); `emit(kind, **fields)`: the ledger (rank 0's); `mtbf_s`: the job MTBF, agreed (None: no auto mode);
    `tier_shares`: {tier: share of all failures it is read after} (checkpoint/tiers.py)."""

    def __init__(
        self,
        *,
        cfg: Any,
        mtbf_s: float | None,
        tier_shares: dict[str, float],
        rank: int,
        agree_max: Callable[[list[float]], list[float]],
        emit: Callable[..., None],
    ) -> None:
        self.cfg, self.mtbf_s, self.tier_shares, self.rank = cfg, mtbf_s, tier_shares, rank
        self._agree_max, self._emit = agree_max, emit
        self.last_save_step = 0  # the filesystem tier's last save (or the step loaded)
        self._step_times: list[float] = []
        self._delta_s: float | None = None  # agreed cost of a save (blocking + what it took from overlapped steps)
        # What an async save costs the steps it overlaps (see record_step): a save in flight, the
        # excess those steps took, the previous save's blocking time, recent steps no save overlapped.
        self._overlap, self._excess_s, self._prev_blocking = False, 0.0, None
        self._plain_times: list[float] = []
        self.interval_steps: int | None = None  # auto mode: the current interval in steps
        self.last_plan: dict[str, Any] | None = None
        self.memory_steps: int | None = None  # memory_interval=auto: the RAM tier's interval (None: not measured)

    def step_time(self) -> float | None:
        return statistics.median(self._step_times) if self._step_times else None

    def manifest_entry(self) -> dict[str, float | None]:
        """What a filesystem checkpoint records of the interval (a resume retunes from it at once)."""
        return {"delta_s": self._delta_s, "step_time_s": self.step_time()}

    def record_step(self, step_time_s: float, *, save_in_flight: bool) -> None:
        """A finished step's time. An async save's write competes with the steps it overlaps (CPU, memory bandwidth,
        the staging wait before the optimizer step): each such step's excess over the median of recent steps that
        no save overlapped is added to the save's cost. Measured on a 2-core machine it was ~30x the blocking part
        (0.65 s against 0.02 s), and an interval from the blocking part alone saved every 8 steps where Young/Daly
        with the whole cost says 40."""
        self._step_times.append(step_time_s)
        del self._step_times[:-50]
        if not self._overlap:
            self._plain_times.append(step_time_s)
            del self._plain_times[:-50]
            return
        if self._plain_times:
            self._excess_s += max(0.0, step_time_s - statistics.median(self._plain_times))
        if not save_in_flight:
            self._overlap = False

    def due(self, step: int, *, total_steps: int | None) -> bool:
        """Whether the filesystem tier saves `step` (just finished): the last step, every `every_steps`, or once the
        auto interval has passed since the last save."""
        if step <= self.last_save_step:
            return False
        if total_steps is not None and step >= total_steps:
            return True
        if self.cfg.interval == "steps":
            return self.cfg.every_steps > 0 and step % self.cfg.every_steps == 0
        if self.interval_steps is None:
            return True  # nothing measured yet: save once to measure the blocking cost
        return step - self.last_save_step >= self.interval_steps

    def started(self, step: int) -> None:
        """A filesystem save of `step` was written or handed to its background write: the next is due from it."""
        self.last_save_step = step

    def saved(self, step: int, blocking_s: float, *, overlapped: bool) -> None:
        """A filesystem save of `step` began and blocked `blocking_s`; `overlapped`: its write goes on behind the next
        steps. The interval's save cost: an async save's blocking part plus what it took from the steps it
        overlapped, known once the next save begins (the first save: its blocking part only). A collective in auto
        mode."""
        cost = blocking_s if self._prev_blocking is None else self._prev_blocking + self._excess_s
        self._overlap, self._excess_s = overlapped, 0.0
        self._prev_blocking = blocking_s if overlapped else None
        self._retune(step, cost)

    def restore(self, step: int, manifest: dict[str, Any]) -> None:
        """Checkpoint `step` was loaded: the saves resume from it, with the interval its manifest recorded."""
        self.last_save_step = step
        iv = manifest.get("interval") or {}
        if self.cfg.interval == "auto" and iv.get("delta_s") and iv.get("step_time_s"):
            self._delta_s = float(iv["delta_s"])
            self._set_interval(float(iv["step_time_s"]), step=manifest["step"])

    def _retune(self, step: int, cost_s: float) -> None:
        if self.cfg.interval != "auto":
            return
        self._delta_s, step_time = self._agree_max([cost_s, self.step_time() or 0.0])
        self._set_interval(step_time, step=step)

    def _set_interval(self, step_time: float, *, step: int) -> None:
        assert self.mtbf_s is not None and self._delta_s is not None
        if step_time <= 0:
            self.interval_steps = 1
            return
        plan = plan_interval(
            delta=max(self._delta_s, 1e-6), mtbf=self._tier_mtbf(FILESYSTEM) or self.mtbf_s, restart=self.cfg.restart_s
        )
        self.interval_steps = interval_steps(plan.interval_s, step_time)
        self.last_plan = dict(plan.as_dict(), interval_steps=self.interval_steps, step_time_s=step_time)
        self._emit(
            "checkpoint_interval",
            step=step,
            tier=FILESYSTEM,
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in self.last_plan.items()},
        )
        if self.rank == 0:
            log.info(
                "checkpoint interval %d steps (Daly %.1f s, Young %.1f s; δ=%.3f s, MTBF=%.0f s, step %.3f s): "
                "overhead %.2f%%, expected lost work per failure %.1f s",
                self.interval_steps,
                plan.interval_s,
                plan.young_s,
                plan.delta_s,
                plan.mtbf_s,
                step_time,
                100 * plan.checkpoint_overhead,
                plan.expected_lost_work_s,
            )

    def _tier_mtbf(self, tier: str) -> float | None:
        """The mean time between the failures `tier` is read after (checkpoint.tiers.tier_mtbf_s); None: none."""
        assert self.mtbf_s is not None
        return tier_mtbf_s(mtbf_s=self.mtbf_s, share=self.tier_shares.get(tier, 0.0))

    def memory_interval_steps(self) -> int:
        """The RAM tier's interval in steps: checkpoint.memory_every_steps (0 = off), or with memory_interval=auto
        the tier's own Daly optimum once a RAM save was measured (1 before: the next step saves, to measure)."""
        if not self.cfg.memory_on:
            return 0
        if self.cfg.memory_interval == "steps":
            return self.cfg.memory_every_steps
        return 1 if self.memory_steps is None else self.memory_steps

    def retune_memory(self, step: int, cost_s: float) -> None:
        """memory_interval=auto: the RAM saves' interval from their measured cost (agreed: every rank's slowest; it
        includes the partner copy the save sends) and the MTBF of the failures read from RAM or from a partner copy
        (checkpoint.tiers.memory_interval_s, as jobs.plan's); 0 = they cover none."""
        if self.cfg.memory_interval != "auto":
            return
        cost, step_time = self._agree_max([cost_s, self.step_time() or 0.0])
        assert self.mtbf_s is not None
        share = cadence_share(self.tier_shares)
        mtbf = memory_mtbf_s(mtbf_s=self.mtbf_s, shares=self.tier_shares)
        tau = memory_interval_s(mtbf_s=self.mtbf_s, shares=self.tier_shares, save_s=cost)
        self.memory_steps = 0 if tau is None else interval_steps(tau, step_time) if step_time > 0 else 1
        self._emit(
            "checkpoint_interval",
            step=step,
            tier=MEMORY,
            interval_s=None if tau is None else round(tau, 6),
            interval_steps=self.memory_steps,
            delta_s=round(cost, 6),
            mtbf_s=mtbf,
            share=share,
            step_time_s=round(step_time, 6),
        )
        if self.rank == 0:
            log.info(
                "RAM tier interval %d steps, partner copies included (Daly %s s; δ=%.4f s, MTBF of the failures "
                "read from RAM or a partner %s s, step %.3f s)",
                self.memory_steps,
                "-" if tau is None else f"{tau:.1f}",
                cost,
                "-" if mtbf is None else f"{mtbf:.0f}",
                step_time,
            )
