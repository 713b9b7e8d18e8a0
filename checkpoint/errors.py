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
    ranks = _rank_failures(e)
    causes = [x for _, inner in ranks for x in _chain(inner)]
    enospc = "No space left on device" in text or any(
        getattr(x, "errno", None) == errno.ENOSPC for x in [*_chain(e), *causes]
    )
    if enospc:
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            free = -1
        return (
            f"no space left on device under {folder} ({free} bytes free); free space or put run.dir on a "
            "larger filesystem"
        )
    if ranks:  # DCP's first line names only the ranks ("CheckpointException ranks:dict_keys([1])"): say what failed
        return (
            f"{type(e).__name__} on rank(s) {[r for r, _ in ranks]}: "
            + "; ".join(f"rank {r}: {_first_line(f'{type(x).__name__}: {x}')}" for r, x in ranks)
        )[:500]
    return _first_line(text)[:500]


def _first_line(text: str) -> str:
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), text)


def _rank_failures(e: BaseException) -> list[tuple[int, BaseException]]:
    """Each rank's exception inside a `torch.distributed.checkpoint.api.CheckpointException` in `e`'s chain (its
    `failures`: rank -> (exception, traceback summary)); [] for any other error."""
    for x in _chain(e):
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):
            return [
                (int(r), w[0])
                for r, w in sorted(failures.items())
                if isinstance(w, tuple) and w and isinstance(w[0], BaseException)
            ]
    return []


def _chain(e: BaseException) -> list[BaseException]:
    out, seen = [], set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out
