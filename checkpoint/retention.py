"""Retention: which committed checkpoints to delete after a save so that `checkpoint.keep` of them stay."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint.manifest import check_step_dir, step_dirs

__all__ = ["retain"]


def retain(folder: Path, *, keep: int, verify: str, emit: Callable[..., Any]) -> None:
    """Deletes the checkpoints past the newest `keep` under `folder`. Counts toward checkpoint.keep only
    what load would accept (checkpoint.verify), newest first; of the older ones, only those whose manifest
    and sizes check out are deleted (the rest are left for a human), and never the newest one that passes
    the checksum. `emit(kind, **fields)` records each deletion."""
    dirs = step_dirs(folder)
    if len(dirs) <= keep:
        return  # nothing to delete: no need to read any checkpoint back
    checksum = verify == "checksum"
    kept: list[tuple[int, Path]] = []
    retired: list[tuple[int, Path]] = []
    for step, d in dirs:
        if len(kept) < keep:
            if not check_step_dir(d, step=step, checksum=checksum):
                kept.append((step, d))
        elif not check_step_dir(d, step=step, checksum=False):
            retired.append((step, d))
    if retired and not checksum:  # kept by size only: the newest one that passes the checksum stays too
        sound = next((sd for sd in kept + retired if not check_step_dir(sd[1], step=sd[0], checksum=True)), None)
        retired = [sd for sd in retired if sd != sound]
    for step, d in retired:
        shutil.rmtree(d)
        emit("checkpoint_deleted", step=step, path=str(d), reason=f"retention: checkpoint.keep={keep}")
