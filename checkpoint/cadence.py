"""When each checkpoint tier saves: CheckpointManager's interval state and the Young/Daly retuning from measured
save costs (`checkpoint.interval=auto`, `checkpoint.memory_interval=auto`; the formulas are checkpoint/interval.py
and checkpoint/tiers.py)."""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.interval import interval_steps, plan_interval
from checkpoint.tiers import FILESYSTEM, MEMORY, cadence_share, memory_interval_s, memory_mtbf_s, tier_mtbf_s

log = logging.getLogger("meshjob.checkpoint")

__all__ = ["IntervalMixin"]


class IntervalMixin:
    """CheckpointManager's methods of the save intervals (`self.cfg`, `self.mtbf_s`, `self.tier_shares`, `self.rank`,
    `self._dist`, `self._ctl_pg`, `self._pending`, `self._emit`)."""

    def _init_interval_state(self) -> None:
        """What the saves learn as they go: the state dict's bindings and the save cost behind the interval."""
        self._hooks: list[Any] = []
        self._bound: dict[str, Any] | None = None
        self._cached: tuple[tuple, dict[str, Any], list[tuple[str, int, int, str]] | None] | None = None
        self._last_save_step = 0
        self._step_times: list[float] = []
        self._delta_s: float | None = None  # agreed cost of a save (blocking + what it took from overlapped steps)
        # What an async save costs the steps it overlaps (see _count_overlap): a save in flight, the
        # excess those steps took, the previous save's blocking time, recent steps no save overlapped.
        self._overlap, self._excess_s, self._prev_blocking = False, 0.0, None
        self._plain_times: list[float] = []
        self._interval_steps: int | None = None  # auto mode: the current interval in steps
        self.last_plan: dict[str, Any] | None = None

    def _step_time(self) -> float | None:
        return statistics.median(self._step_times) if self._step_times else None

    def _count_overlap(self, step_time_s: float) -> None:
        """An async save's write competes with the steps it overlaps (CPU, memory bandwidth, the staging
        wait before the optimizer step): each such step's excess over the median of recent steps that
        no save overlapped is added to the save's cost. Measured on a 2-core machine it was ~30x the
        blocking part (0.65 s against 0.02 s), and an interval from the blocking part alone saved every
        8 steps where Young/Daly with the whole cost says 40."""
        if not self._overlap:
            self._plain_times.append(step_time_s)
            del self._plain_times[:-50]
            return
        if self._plain_times:
            self._excess_s += max(0.0, step_time_s - statistics.median(self._plain_times))
        if self._pending is None or self._pending.done():
            self._overlap = False

    def _retune(self, step: int, cost_s: float) -> None:
        if self.cfg.interval != "auto":
            return
        vals = torch.tensor([cost_s, self._step_time() or 0.0], dtype=torch.float64)
        if self._dist:
            dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        self._delta_s, step_time = float(vals[0]), float(vals[1])
        self._set_interval(step_time, step=step)

    def _restore_interval(self, manifest: dict[str, Any]) -> None:
        iv = manifest.get("interval") or {}
        if self.cfg.interval == "auto" and iv.get("delta_s") and iv.get("step_time_s"):
            self._delta_s = float(iv["delta_s"])
            self._set_interval(float(iv["step_time_s"]), step=manifest["step"])

    def _set_interval(self, step_time: float, *, step: int) -> None:
        assert self.mtbf_s is not None and self._delta_s is not None
        if step_time <= 0:
            self._interval_steps = 1
            return
        plan = plan_interval(
            delta=max(self._delta_s, 1e-6), mtbf=self._tier_mtbf(FILESYSTEM) or self.mtbf_s, restart=self.cfg.restart_s
        )
        self._interval_steps = interval_steps(plan.interval_s, step_time)
        self.last_plan = dict(plan.as_dict(), interval_steps=self._interval_steps, step_time_s=step_time)
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
                self._interval_steps,
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
        return 1 if self._memory_interval_steps is None else self._memory_interval_steps

    def _retune_memory(self, step: int, cost_s: float) -> None:
        """memory_interval=auto: the RAM saves' interval from their measured cost (agreed: every rank's slowest; it
        includes the partner copy the save sends) and the MTBF of the failures read from RAM or from a partner copy
        (checkpoint.tiers.memory_interval_s, as jobs.plan's); 0 = they cover none."""
        if self.cfg.memory_interval != "auto":
            return
        vals = torch.tensor([cost_s, self._step_time() or 0.0], dtype=torch.float64)
        if self._dist:
            dist.all_reduce(vals, op=dist.ReduceOp.MAX, group=self._ctl_pg)
        cost, step_time = float(vals[0]), float(vals[1])
        assert self.mtbf_s is not None
        share = cadence_share(self.tier_shares)
        mtbf = memory_mtbf_s(mtbf_s=self.mtbf_s, shares=self.tier_shares)
        tau = memory_interval_s(mtbf_s=self.mtbf_s, shares=self.tier_shares, save_s=cost)
        self._memory_interval_steps = 0 if tau is None else interval_steps(tau, step_time) if step_time > 0 else 1
        self._emit(
            "checkpoint_interval",
            step=step,
            tier=MEMORY,
            interval_s=None if tau is None else round(tau, 6),
            interval_steps=self._memory_interval_steps,
            delta_s=round(cost, 6),
            mtbf_s=mtbf,
            share=share,
            step_time_s=round(step_time, 6),
        )
        if self.rank == 0:
            log.info(
                "RAM tier interval %d steps, partner copies included (Daly %s s; δ=%.4f s, MTBF of the failures "
                "read from RAM or a partner %s s, step %.3f s)",
                self._memory_interval_steps,
                "-" if tau is None else f"{tau:.1f}",
                cost,
                "-" if mtbf is None else f"{mtbf:.0f}",
                step_time,
            )
