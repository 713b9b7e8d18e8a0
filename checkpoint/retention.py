"""Which committed checkpoints stay: retention after a save (`checkpoint.keep`), and the checkpoints of an
abandoned timeline moved aside at a rollback (never counted, never loaded)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint.manifest import ManifestError, check_step_dir, fsync_dir, read_manifest, step_dirs

__all__ = ["ABANDONED", "abandon_above", "retain"]

ABANDONED = "abandoned"  # under the checkpoint folder: step_<N>.<attempt>, kept for a human


def retain(folder: Path, *, keep: int, verify: str, emit: Callable[..., Any], newest: int | None = None,
           verified: dict[tuple[int, str], bool] | None = None) -> None:
    """Deletes the checkpoints past the newest `keep` under `folder`. Counts toward checkpoint.keep only
    what load would accept (checkpoint.verify), newest first; of the older ones, only those whose manifest
    and sizes check out are deleted (the rest are left for a human), and never the newest one that passes
    the checksum. `newest`: the step just committed, the head of the current timeline; it is never deleted,
    and folders of a later step (another timeline's, left by a crash during a rollback) are neither counted
    nor deleted. `emit(kind, **fields)` records each deletion. `verified`: the outcome of each full crc32
    check so far, by (step, manifest crc32), kept by the caller across saves, so that a checkpoint's files
    are read back once (in the page cache, right after its commit) and never again after later saves."""
    cache: dict[tuple[int, str], bool] = {} if verified is None else verified

    def problems(step: int, d: Path, checksum: bool) -> bool:
        if not checksum:
            return bool(check_step_dir(d, step=step, checksum=False))
        key = (step, _manifest_crc(d))
        if key[1] == "" or key not in cache:
            cache[key] = not check_step_dir(d, step=step, checksum=True)
        return not cache[key]

    dirs = [(s, d) for s, d in step_dirs(folder) if newest is None or s <= newest]
    if len(dirs) <= keep:
        return  # nothing to delete: no need to read any checkpoint back
    checksum = verify == "checksum"
    kept: list[tuple[int, Path]] = []
    retired: list[tuple[int, Path]] = []
    for step, d in dirs:
        if len(kept) < keep:
            if not problems(step, d, checksum):
                kept.append((step, d))
        elif not problems(step, d, False):
            retired.append((step, d))
    if retired and not checksum:  # kept by size only: the newest one that passes the checksum stays too
        sound = next((sd for sd in kept + retired if not problems(sd[0], sd[1], True)), None)
        retired = [sd for sd in retired if sd != sound]
    for step, d in retired:
        if step == newest:
            continue
        shutil.rmtree(d)
        emit("checkpoint_deleted", step=step, path=str(d), reason=f"retention: checkpoint.keep={keep}")


def _manifest_crc(d: Path) -> str:
    """The manifest's own crc32 (it covers every file's size and crc32): names one commit of a step."""
    try:
        return str(read_manifest(d).get("manifest_crc32", ""))
    except (ManifestError, OSError):
        return ""


def abandon_above(folder: Path, *, step: int, attempt: str) -> list[tuple[int, Path, Path]]:
    """Moves every committed-looking `step_<N>` with N > `step` to `abandoned/step_<N>.<attempt>` (a rename,
    then an fsync of both folders); returns (N, old path, new path) of each, newest first."""
    moved = []
    for s, d in step_dirs(folder):
        if s <= step:
            break
        aside = folder / ABANDONED / f"{d.name}.{attempt}"
        if aside.exists():  # the same step abandoned twice in one attempt
            aside = aside.with_name(f"{aside.name}.{time.time_ns()}")
        aside.parent.mkdir(exist_ok=True)
        os.rename(d, aside)
        moved.append((s, d, aside))
    if moved:
        fsync_dir(folder / ABANDONED)
        fsync_dir(folder)
    return moved
