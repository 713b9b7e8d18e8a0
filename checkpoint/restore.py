"""The choice a (re)start makes across the tiers (a part of CheckpointManager's, checkpoint/manager.py): which
candidate step, from which tier, skipping the ones that fail their check or their load on any rank, and the record
of the one loaded. Every decision is agreed: one rank's problem with a candidate is every rank's."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint.cadence import Cadence
from checkpoint.errors import describe_error
from checkpoint.fs_restore import FsRestore
from checkpoint.group import Group
from checkpoint.memory_tier import MemoryTier
from checkpoint.tiers import FILESYSTEM, MEMORY

__all__ = ["Restore"]

log = logging.getLogger("meshjob.checkpoint")


class Restore:
    """Loads the newest checkpoint of either tier that validates and loads on every rank, for one rank under `folder`.
    `ctl`: the group the ranks agree on; `fs` and `memory`: the tiers' parts (their candidates, checks and loads, each
    with no collective inside the load); `cadence`: resumes the save intervals from the step loaded;
    `emit(kind, **fields)`: the ledger (rank 0's)."""

    def __init__(
        self,
        folder: Path,
        *,
        rank: int,
        ctl: Group,
        fs: FsRestore,
        memory: MemoryTier,
        cadence: Cadence,
        emit: Callable[..., None],
    ) -> None:
        self.folder, self.rank = folder, rank
        self._ctl, self._fs, self._memory, self._cadence, self._emit = ctl, fs, memory, cadence, emit

    def newest(self, *, before_step: int | None, rollbacks: int) -> int:
        """Loads the newest candidate of any tier that validates and loads on every rank and returns its step
        (0 when none); at the same step the RAM tier comes first (the cheaper read; own copies, or partner copies
        where a rank's own is missing or damaged). `before_step`: only steps below it are candidates; `rollbacks`:
        the rollbacks the run knows (a RAM step that knows fewer is none). Raises once a candidate was partly read
        and none after it loaded: the bound objects may then hold a mix of checkpoints."""
        t0 = time.perf_counter()
        steps = self._candidates(before_step, rollbacks)
        touched = False
        for step, tier in steps:
            if tier == MEMORY:
                d, problems, manifest, tier = self._memory.validate(step)
            else:
                d, problems, manifest = self._fs.validate(step)
            if problems:
                more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
                self._skip(step, d, "; ".join(problems[:5]) + more, tier=tier)
                continue
            touched = True
            info, failed = self._load_agreed(d, manifest, tier=tier)
            if info is None:
                self._skip(step, d, f"load failed on {failed}", tier=tier)
                continue
            self._loaded(step, d, manifest, info, t0, tier=tier)
            self._memory.after_load(step)
            return step
        if touched:
            raise RuntimeError(
                f"every checkpoint under {self.folder} failed to load after one was partly read, so the "
                "model state is undefined; see checkpoint_skipped in events.jsonl, move the damaged ones aside"
            )
        self._memory.after_load(0)
        self._emit("checkpoint_none", folder=str(self.folder), skipped=len(steps), before_step=before_step)
        return 0

    def _candidates(self, before_step: int | None, rollbacks: int) -> list[tuple[int, str]]:
        """(step, tier) of every tier's candidates below `before_step`, newest first, RAM first at a tie (a RAM
        candidate's tier may turn PARTNER at its check)."""
        steps = [(s, FILESYSTEM) for s in self._fs.candidates()]
        steps += [(s, MEMORY) for s in self._memory.candidates(rollbacks=rollbacks)]
        return sorted(
            [c for c in steps if before_step is None or c[0] < before_step], key=lambda c: (-c[0], c[1] != MEMORY)
        )

    def _load_agreed(self, d: Path, manifest: dict[str, Any], *, tier: str) -> tuple[dict[str, Any] | None, str]:
        """Either tier's load runs no collective (DCP reads with no_dist, set_*_state_dict are local on FSDP2/TP/PP),
        so a rank failing anywhere in it cannot leave another blocked inside it; one all_gather afterwards, reached
        by every rank, decides for all: (what the load reports, "") or (None, which ranks failed and why)."""
        err = info = None
        try:
            info = self._fs.load(d, manifest) if tier == FILESYSTEM else self._memory.load(d, manifest)
        except Exception as e:  # noqa: BLE001 - agreed on below
            err = describe_error(e, self.folder)
        failed = [f"rank {r}: {e}" for r, e in enumerate(self._ctl.all_gather(err)) if e]
        return (None, "; ".join(failed)[:2000]) if failed else (info, "")

    def _loaded(
        self, step: int, d: Path, manifest: dict[str, Any], info: dict[str, Any], t0: float, *, tier: str
    ) -> None:
        """Records a successful load (started at perf_counter `t0`) from `tier`: the save cadence resumes from
        it, and it is reported."""
        self._cadence.restore(step, manifest)
        load_s = time.perf_counter() - t0
        self._emit(
            "checkpoint_loaded",
            step=step,
            tier=tier,
            path=str(d),
            load_s=round(load_s, 4),
            bytes=manifest["bytes"],
            saved_world_size=manifest["world_size"],
            **info,
        )
        log.info("resumed from %s (%s tier, %.2f s, resharded=%s)", d, tier, load_s, info["resharded"])

    def _skip(self, step: int, d: Path, reason: str, *, tier: str) -> None:
        """A candidate every rank passes over: reported, and kept out of the filesystem tier's retention."""
        if tier == FILESYSTEM:
            self._fs.mark_damaged(step, d)
        self._emit("checkpoint_skipped", step=step, tier=tier, path=str(d), reason=reason)
        if self.rank == 0:
            log.warning("skipping checkpoint %s: %s", d, reason)
