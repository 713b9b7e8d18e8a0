"""The checkpoint save error and the one-line description of any failure (a full disk named as such)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

__all__ = ["CheckpointConfigError", "CheckpointSaveError", "describe_error"]


class CheckpointSaveError(RuntimeError):
    """A save failed on some rank; the previous committed checkpoint is untouched."""


class CheckpointConfigError(ValueError):
    """A checkpoint setting this allocation cannot honour, found by the ranks at start, alike on every rank (the
    RAM tier larger than checkpoint.memory_dir's free memory): a config error, no restart cures it."""


def describe_error(e: BaseException, folder: Path) -> str:
    """A one-line cause; a full disk is named as such, with the free space and the fix."""
    text = f"{type(e).__name__}: {e}"
    enospc = "No space left on device" in text or any(getattr(x, "errno", None) == errno.ENOSPC for x in _chain(e))
    if enospc:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = -1
        return (
            f"no space left on device under {folder} ({free} bytes free); free space or put run.dir on a "
            "larger filesystem"
        )
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), text)
    return first[:500]


def _chain(e: BaseException) -> list[BaseException]:
    out, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out
