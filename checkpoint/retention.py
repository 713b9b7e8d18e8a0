"""Which committed checkpoints stay: retention after a save (`checkpoint.keep`), and the checkpoints of an
abandoned timeline moved aside at a rollback (never counted, never loaded)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint.manifest import ManifestError, check_files, fsync_dir, read_manifest, step_dirs

__all__ = ["ABANDONED", "abandon_above", "manifest_crc", "retain"]

ABANDONED = "abandoned"  # under the checkpoint folder: step_<N>.<attempt>, kept for a human


def retain(
    folder: Path,
    *,
    keep: int,
    emit: Callable[..., Any],
    newest: int | None = None,
    damaged: set[tuple[int, str]] | frozenset[tuple[int, str]] = frozenset(),
) -> None:
    """Deletes the checkpoints past the newest `keep` under `folder`, reading no checkpoint back: the crc32
    recorded at commit from the bytes as they were written is trusted, so a checkpoint counts toward
    checkpoint.keep, newest first, when its manifest and file sizes check out (a stat each), and so does an
    older one before it is deleted (the rest are left for a human). Damage after the commit (same size) is
    found by load's checksum (checkpoint.verify), which skips that checkpoint; `damaged`: the (step, manifest
    crc32) of those this attempt's load skipped, neither counted nor deleted. `newest`: the step just committed, the head
    of the current timeline; it is never deleted, and folders of a later step (another timeline's, left by a
    crash during a rollback) are neither counted nor deleted. `emit(kind, **fields)` records each deletion."""
    dirs = [(s, d) for s, d in step_dirs(folder) if newest is None or s <= newest]
    if len(dirs) <= keep:
        return
    kept, retired = 0, []
    for step, d in dirs:
        crc = _sound(d, step)
        if crc is None or (step, crc) in damaged:
            continue  # torn, truncated or found damaged by the load: neither counted nor deleted
        if kept < keep:
            kept += 1
        elif step != newest:
            retired.append((step, d))
    for step, d in retired:
        shutil.rmtree(d)
        emit("checkpoint_deleted", step=step, path=str(d), reason=f"retention: checkpoint.keep={keep}")


def _sound(d: Path, step: int) -> str | None:
    """The manifest's own crc32 when the manifest and every file's size check out, else None (no file read)."""
    try:
        manifest = read_manifest(d, step=step)
        if check_files(d, manifest["files"], sorted(manifest["files"]), checksum=False):
            return None
    except (ManifestError, OSError):
        return None
    return str(manifest.get("manifest_crc32", ""))


def manifest_crc(d: Path) -> str:
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
