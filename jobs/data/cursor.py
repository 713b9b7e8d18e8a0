"""The data cursor: exact, repeat-free blending of a mixture's sources, and where a resumed run goes on reading.

Blending (Megatron's blending indices are the reference): global sample `i` of a mixture goes to the
source whose realised count lags its share most, `argmax_s w_s * (i + 1) - c_s` (weights normalised to
sum 1, ties to the lower index); the source's next sample is its `c_s`-th, read through its own
epoch-wise permutation. The choice depends only on the per-source consumed counts, so a run that goes
on from counts saved in a checkpoint reads exactly what an uninterrupted run reads, and every source's
realised count stays within one sample of `w_s * i` at every prefix.

The cursor a checkpoint carries (`TrainState.data`): the data step the run reads next, the global
samples consumed before it, each source's consumed count, each file's identity (size and a hash of
its header) and its permutation stream (kept for the file, found by its identity, when sources are added,
removed or reordered: none of a file's samples repeats within its epoch). Data step `d` reads the `train.global_batch` samples from
`position + (d - data_step) * train.global_batch` on, so a changed batch size goes on at the next
unread sample.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from jobs.data.h5 import open_read

__all__ = ["Anchor", "DataChanged", "blend", "default_streams", "file_identity", "restore_anchor", "VERSION"]

VERSION = 2  # of the cursor dict kept in TrainState.data (2: each file's permutation stream, `streams`)


class DataChanged(ValueError):
    """A data file changed since the checkpoint a run resumes from: a config error (exit 2), the same on every rank."""


@dataclass
class Anchor:
    """Where reading goes on: data step `data_step` starts at global sample `position`, when the sources
    have consumed `consumed`; `base` holds their counts when the current weights took effect."""

    data_step: int = 0
    position: int = 0
    consumed: list[int] = field(default_factory=list)
    base: list[int] = field(default_factory=list)
    streams: list[int] = field(default_factory=list)  # each file's permutation stream (`default_streams`)


def default_streams(n: int) -> list[int]:
    """The permutation streams of a fresh run's `n` files: 0 for one file, 1..n for a mixture. A file keeps its
    stream for the whole run (the cursor carries it, matched by the file's identity), so adding, removing or
    reordering sources never restarts a file's permutation within an epoch."""
    return [0] if n == 1 else list(range(1, n + 1))


def _match(old: list[dict], files: list[dict]) -> list[int | None]:
    """For each file now, the index of the same file in a checkpoint's list, or None (a new source): by
    identity, then by path (a changed file), then by place for a list of the same length (a replaced file)."""
    match: list[int | None] = [None] * len(files)
    for key in ("id", "path"):
        for i, f in enumerate(files):
            if match[i] is None:
                match[i] = next((k for k, o in enumerate(old) if o[key] == f[key] and k not in match), None)
    if len(old) == len(files):
        for i in range(len(files)):
            if match[i] is None and i not in match:
                match[i] = i
    return match


def blend(
    *, consumed: Sequence[int], weights: Sequence[float], n: int, base: Sequence[int] | None = None
) -> np.ndarray:
    """The sources of the next `n` samples of a mixture whose sources have consumed `consumed` samples
    (`base`: their counts when these weights took effect; zeros by default). Deterministic, exact shares."""
    if len(weights) == 1:
        return np.zeros(n, dtype=np.int64)
    total = float(sum(weights))
    p = [float(w) / total for w in weights]
    c = [int(x) - int(b) for x, b in zip(consumed, base or [0] * len(consumed))]
    i, out = sum(c), np.empty(n, dtype=np.int64)
    for j in range(n):
        i += 1
        best, err = 0, p[0] * i - c[0]
        for s in range(1, len(p)):
            e = p[s] * i - c[s]
            if e > err:
                best, err = s, e
        out[j] = best
        c[best] += 1
    return out


def file_identity(path: str | os.PathLike[str]) -> dict:
    """A token file's identity, cheap to take: its size and a sha256 of its header (the attributes, and
    every dataset's name, shape and dtype; a tokenized file's manifest too). Appending changes both."""
    path = Path(path)
    h = hashlib.sha256()
    with open_read(path) as f:
        h.update(json.dumps({k: _plain(v) for k, v in sorted(f.attrs.items())}, sort_keys=True).encode())
        for name in sorted(f):
            obj = f[name]
            if isinstance(obj, h5py.Dataset):
                h.update(f"{name}:{obj.shape}:{obj.dtype}".encode())
                if name == "manifest":
                    h.update(np.asarray(obj[()]).tobytes())
    return {"path": str(path), "size": path.stat().st_size, "id": h.hexdigest()[:16]}


def _apportion(n: int, weights: list[float]) -> list[int]:
    """`n` split by `weights`, largest remainders first (exact for one source)."""
    share = [n * float(w) / float(sum(weights)) for w in weights]
    out = [int(x) for x in share]
    for k in sorted(range(len(share)), key=lambda k: out[k] - share[k])[: n - sum(out)]:
        out[k] += 1
    return out


def _plain(v: object) -> object:
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    return v


def restore_anchor(
    saved: dict | None,
    *,
    files: list[dict],
    weights: list[float],
    accept_changed_files: bool,
    data_step: int = 0,
    global_batch: int = 0,
) -> tuple[Anchor, list[str]]:
    """The anchor to go on from, given a checkpoint's cursor and this run's files and weights; and what
    changed, in words. A file whose size or header differs is refused (DataChanged) unless
    `accept_changed_files`. A checkpoint older than the cursor (`saved` empty) of step `data_step`: the
    cursor is the step, as then (data step d reads from sample d * global_batch; a mixture's counts there
    are its shares, rounded, without replaying the blend from the start)."""
    if not saved:
        position = data_step * global_batch
        consumed = _apportion(position, weights)
        return Anchor(data_step, position, consumed, list(consumed), default_streams(len(files))), []
    old = saved["files"]
    match = _match(old, files)  # sources added, removed or reordered: a new one starts at 0 consumed
    old_streams = [int(x) for x in saved.get("streams") or default_streams(len(old))]  # version 1: by place, as then
    streams = [old_streams[k] if k is not None else None for k in match]
    fresh = iter(range(max([*old_streams, *(x for x in streams if x is not None)]) + 1, 2**31))
    streams = [x if x is not None else next(fresh) for x in streams]  # a new file: a stream no file used
    changed = [
        f"{f['path']} (size {old[k]['size']} -> {f['size']} bytes, header {old[k]['id']} -> {f['id']})"
        for f, k in zip(files, match)
        if k is not None and (old[k]["size"], old[k]["id"]) != (f["size"], f["id"])
    ]
    if changed and not accept_changed_files:
        raise DataChanged(
            f"the data changed since the checkpoint of data step {saved['data_step']} was saved: {'; '.join(changed)}. "
            "A changed file (appended to, re-prepared, replaced) changes the samples a resumed run reads. Point "
            "data.path/data.sources back at the original files, or resume with data.accept_changed_files=true to go "
            "on knowingly (each source goes on from its consumed count, over the file as it is now)"
        )
    consumed = [int(saved["consumed"][k]) if k is not None else 0 for k in match]
    notes = [f"data file changed, accepted (data.accept_changed_files=true): {c}" for c in changed]
    same_mix = match == list(range(len(old))) and [float(w) for w in saved["weights"]] == [float(w) for w in weights]
    if same_mix:
        base = [int(b) for b in saved["base"]]
    else:
        base = list(consumed)  # the new weights blend from here on
        notes.append(
            f"data mixture changed (weights {saved['weights']} -> {weights}, {len(old)} -> {len(files)} "
            "sources): the new shares apply from this sample on"
        )
    return Anchor(int(saved["data_step"]), int(saved["position"]), consumed, base, streams), notes
