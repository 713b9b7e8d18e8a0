"""The sampler: a data step -> the global batch's samples, over one token file or a weighted mixture.

Two layouts of a split (`tokens` for training, `heldout` for evaluation) are read:
- rows (2-D, the synthetic file): a sample is the first `seq_len + 1` tokens of one row;
- a stream (1-D, a tokenized corpus): documents concatenated, each ended by EOS, and cut into
  consecutive samples of `seq_len + 1` tokens (packing; a document may span two samples, the tail
  shorter than one sample is not used): non-overlapping by default, so the transition from one sample's
  last token to the next one's first is never a target; with `sample_overlap` (data.sample_overlap)
  sample `i` starts at token `i * seq_len`, consecutive samples share one token and every transition
  of the stream is a target exactly once (Megatron's and nanoGPT's layout).

Data step `d` reads the `global_batch` global samples after the `(d - data_step) * global_batch` read since the
cursor's anchor (jobs/data/cursor.py: zero for a fresh run, a checkpoint's cursor on resume), jumping over the
global sample ranges that rollbacks skipped (`skips`, and the data steps they jumped, do not count): the skipped
samples are the same under any train.global_batch. A mixture blends its sources exactly (each global sample to the
source that lags its weight most); each source reads its own consumed count through epoch-wise permutations keyed
by (seed, epoch[, stream]), a file's stream kept in the cursor. Nothing depends on the mesh.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # annotations only: the login node prepares the data file (jobs.data) without torch
    import torch

from jobs.data.cursor import VERSION, Anchor, DataChanged, blend, default_streams, file_identity, restore_anchor
from jobs.data.h5 import open_read

__all__ = ["BatchSource", "global_batch_indices", "mixture_indices", "epoch_samples", "SPLITS"]

SPLITS = ("tokens", "heldout")  # dataset names: the training split and the held-out split


@functools.lru_cache(maxsize=8)
def _permutation(seed: int, epoch: int, stream: int, num_samples: int) -> np.ndarray:
    key = [seed, epoch] if stream == 0 else [seed, epoch, stream]
    perm = np.random.default_rng(key).permutation(num_samples)
    perm.flags.writeable = False
    return perm


def epoch_samples(*, seed: int, num_samples: int, positions: np.ndarray, stream: int = 0) -> np.ndarray:
    """The sample indices at a source's read positions (0 = its first sample ever read): epoch-wise
    permutations of the file seeded by (seed, epoch) (and `stream`, one per mixture source)."""
    positions = np.asarray(positions, dtype=np.int64)
    epochs = positions // num_samples
    out = np.empty(len(positions), dtype=np.int64)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        out[sel] = _permutation(seed, int(epoch), stream, num_samples)[positions[sel] % num_samples]
    return out


def global_batch_indices(*, seed: int, step: int, global_batch: int, num_samples: int, stream: int = 0) -> np.ndarray:
    """Sample indices of step `step`'s global batch of one file read from the start (positions
    step * global_batch onward). A pure function of its arguments (never of the mesh)."""
    start = step * global_batch
    return epoch_samples(
        seed=seed, num_samples=num_samples, positions=np.arange(start, start + global_batch), stream=stream
    )


def _mix(
    *,
    seed: int,
    consumed: Sequence[int],
    base: Sequence[int],
    n: int,
    sizes: Sequence[int],
    weights: Sequence[float],
    streams: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(source, sample) of the next `n` global samples after the sources consumed `consumed` (`streams`: each
    source's permutation stream, jobs/data/cursor.default_streams when None)."""
    streams = default_streams(len(sizes)) if streams is None else streams
    src = blend(consumed=consumed, weights=weights, n=n, base=base)
    sample = np.zeros(n, dtype=np.int64)
    for s, size in enumerate(sizes):
        sel = np.flatnonzero(src == s)
        if len(sel):
            pos = consumed[s] + np.arange(len(sel))
            sample[sel] = epoch_samples(seed=seed, num_samples=size, positions=pos, stream=streams[s])
    return src, sample


def mixture_indices(
    *, seed: int, step: int, global_batch: int, sizes: Sequence[int], weights: Sequence[float]
) -> tuple[np.ndarray, np.ndarray]:
    """(source, sample) of every position of step `step`'s global batch of a mixture read from the start
    (exact blending, jobs/data/cursor.py). One source is exactly `global_batch_indices`."""
    before = _counts_before(tuple(float(w) for w in weights), step * global_batch)
    return _mix(seed=seed, consumed=before, base=[0] * len(sizes), n=global_batch, sizes=sizes, weights=weights)


_COUNTS: dict[tuple[float, ...], tuple[int, list[int]]] = {}  # weights -> the last (position, counts) computed


def _counts_before(weights: tuple[float, ...], position: int) -> list[int]:
    """Each source's count among the first `position` samples blended from the start (going on from the last
    position computed for these weights when it is not past `position`: consecutive steps cost one batch each)."""
    at, counts = _COUNTS.get(weights, (0, [0] * len(weights)))
    if at > position:
        at, counts = 0, [0] * len(weights)
    src = blend(consumed=counts, weights=weights, n=position - at)
    counts = [c + int(k) for c, k in zip(counts, np.bincount(src, minlength=len(weights)))]
    _COUNTS[weights] = (position, counts)
    return list(counts)


class _Split:
    """One file's split as samples of `sample_len` tokens (rows, or a packed stream; `overlap`: a stream's
    consecutive samples share one token)."""

    def __init__(self, path: Path, split: str, sample_len: int, *, overlap: bool = False) -> None:
        self.file = open_read(path)
        if split not in self.file:
            raise ValueError(f"{path} has no {split!r} dataset; re-create it (python -m jobs.prepare_data)")
        self.ds, self.sample_len = self.file[split], sample_len
        self.stride = sample_len - 1 if overlap else sample_len  # tokens from one sample's start to the next's
        n = self.ds.shape[0] if self.ds.ndim == 2 else (self.ds.shape[0] - sample_len) // self.stride + 1
        if n < 1:
            raise ValueError(f"{path}:{split} holds fewer than {sample_len} tokens (one sample of train.seq_len + 1)")
        self.num_samples = n

    def rows(self, idx: np.ndarray) -> np.ndarray:
        if self.ds.ndim == 2:
            uniq, inverse = np.unique(idx, return_inverse=True)  # h5py reads need strictly increasing indices
            return self.ds[uniq, : self.sample_len][inverse]
        L, S = self.sample_len, self.stride
        return np.stack([self.ds[i * S : i * S + L] for i in idx]) if len(idx) else np.empty((0, L), np.int32)


def _layout_change(saved: dict | None, *, overlap: bool, accept: bool) -> list[str]:
    """A checkpoint's cursor read with another data.sample_overlap numbers the samples differently (another count,
    another permutation): refused like a changed file (DataChanged) unless `accept`; the note when accepted."""
    was = bool((saved or {}).get("sample_overlap", False))  # absent: saved before the key, without overlap
    if not saved or was == overlap:
        return []
    if not accept:
        now, then = str(overlap).lower(), str(was).lower()
        raise DataChanged(
            f"data.sample_overlap={now}, but the checkpoint of data step {saved['data_step']} was saved "
            f"with data.sample_overlap={then}: the samples are cut differently, so the consumed counts "
            f"point elsewhere. Resume with data.sample_overlap={then}, or with "
            "data.accept_changed_files=true to go on knowingly (each file from its consumed count, over "
            "the new samples)"
        )
    return [
        f"data.sample_overlap changed ({str(was).lower()} -> {str(overlap).lower()}), accepted "
        "(data.accept_changed_files=true): each file goes on from its consumed count over the new samples"
    ]


class BatchSource:
    """This dp rank's (inputs, targets) for a data step, read lazily in this process from one token file
    (`path`) or a mixture (`path` a list of (path, weight)); `split="heldout"` reads the held-out set.
    Reads from the start until `restore` puts it at a checkpoint's cursor; `cursor` is what to save.
    `seq_positions` (context parallel): only the inputs at those positions of a sample, and their targets.
    `indices` names a data step's global samples. `sample_overlap` (data.sample_overlap): a stream's consecutive
    samples share one token."""

    def __init__(
        self,
        path: str | os.PathLike[str] | Sequence[tuple[str, float]],
        *,
        seed: int,
        global_batch: int,
        seq_len: int,
        dp_rank: int,
        dp: int,
        split: str = "tokens",
        seq_positions: torch.Tensor | None = None,
        sample_overlap: bool = False,
    ) -> None:
        assert global_batch % dp == 0, (global_batch, dp)
        assert split in SPLITS, split
        sources = [(path, 1.0)] if isinstance(path, (str, os.PathLike)) else list(path)
        self.paths = [Path(p) for p, _ in sources]
        self.weights = [float(w) for _, w in sources]
        self.seed, self.global_batch, self.seq_len, self.split = seed, global_batch, seq_len, split
        self.dp_rank, self.dp = dp_rank, dp
        self.seq_positions, self.sample_overlap = seq_positions, sample_overlap
        self._splits: list[_Split] | None = None
        zeros = [0] * len(self.paths)
        self.anchor = Anchor(0, 0, list(zeros), list(zeros), default_streams(len(self.paths)))
        self._at: tuple[int, list[int]] = (0, list(zeros))  # (global position, consumed) last computed
        self._files: list[dict] | None = None  # the files' identity, taken once (file_identity)
        # A rollback's data skip (jobs/failure/spike.py, set through TrainingHealth.bind): (first data step jumped,
        # the data step read after the jump, first global sample skipped, end of the range). Reading jumps over the
        # samples by position, so the same samples stay skipped under another train.global_batch.
        self.skips: list[tuple[int, int, int, int]] = []

    def _open(self) -> list[_Split]:
        if self._splits is None:
            self._splits = [_Split(p, self.split, self.seq_len + 1, overlap=self.sample_overlap) for p in self.paths]
        return self._splits

    def _position(self, data_step: int) -> int:
        a = self.anchor
        if data_step < a.data_step:
            raise RuntimeError(
                f"data step {data_step} precedes the cursor's data step {a.data_step} (restored "
                "from the checkpoint); the run's data steps only go forward"
            )
        jumped = sum(max(0, min(b, data_step) - max(j, a.data_step)) for j, b, _, _ in self.skips)
        runs = self._runs(a.position, (data_step - a.data_step - jumped) * self.global_batch)
        return self._unskipped(runs[-1][1] if runs else a.position)

    def _ranges(self) -> list[tuple[int, int]]:
        """The skipped global sample ranges [start, end) ahead of the anchor, in order."""
        return sorted((s, e) for _, _, s, e in self.skips if e > self.anchor.position)

    def _unskipped(self, pos: int) -> int:
        """The first global position at or after `pos` outside every skipped range."""
        for s, e in self._ranges():
            if s <= pos < e:
                pos = e
        return pos

    def _runs(self, pos: int, n: int) -> list[tuple[int, int]]:
        """The runs [start, end) of global positions that the next `n` unskipped samples from `pos` occupy."""
        runs: list[tuple[int, int]] = []
        for s, e in self._ranges():
            if e <= pos:
                continue
            if s > pos:
                if n <= s - pos:
                    break
                runs.append((pos, s))
                n -= s - pos
            pos = max(pos, e)
        return [*runs, (pos, pos + n)] if n > 0 else runs

    def sample_span(self, first: int, last: int) -> tuple[int, int]:
        """The global sample range [start, end) that data steps `first..last` read (a rollback's skip)."""
        end = self._runs(self._position(last), self.global_batch)[-1][1]
        return self._position(first), end

    def _consumed_at(self, position: int) -> list[int]:
        """Each source's consumed count when `position` global samples are consumed (from the anchor on)."""
        at, consumed = self._at
        if not self.anchor.position <= at <= position:
            at, consumed = self.anchor.position, list(self.anchor.consumed)
        if position > at:
            src = blend(consumed=consumed, weights=self.weights, n=position - at, base=self.anchor.base)
            consumed = [c + int(k) for c, k in zip(consumed, np.bincount(src, minlength=len(consumed)))]
        self._at = (position, consumed)
        return list(consumed)

    def cursor(self, data_step: int) -> dict:
        """The cursor a checkpoint keeps when data step `data_step` is the next to read (TrainState.data)."""
        position = self._position(data_step)
        return {
            "version": VERSION,
            "data_step": data_step,
            "position": position,
            "consumed": self._consumed_at(position),
            "base": list(self.anchor.base),
            "global_batch": self.global_batch,
            "weights": list(self.weights),
            "files": self._identities(),
            "streams": list(self.anchor.streams),
            "sample_overlap": self.sample_overlap,
        }

    def _identities(self) -> list[dict]:
        if self._files is None:
            self._files = [file_identity(p) for p in self.paths]
        return self._files

    def restore(self, saved: dict | None, *, step: int = 0, accept_changed_files: bool = False) -> list[str]:
        """Goes on from a checkpoint's cursor (`saved`; empty: the checkpoint of step `step` is older than the
        cursor, which is then the step). DataChanged (a ValueError) when a data file changed, unless
        `accept_changed_files`. Returns the changes it went on over, in words (a changed train.global_batch,
        an accepted file change, new weights)."""
        layout = _layout_change(saved, overlap=self.sample_overlap, accept=accept_changed_files)
        self.anchor, notes = restore_anchor(
            saved,
            files=self._identities(),
            weights=self.weights,
            accept_changed_files=accept_changed_files,
            data_step=step,
            global_batch=self.global_batch,
        )
        self._at = (self.anchor.position, list(self.anchor.consumed))
        if saved and int(saved["global_batch"]) != self.global_batch:
            notes.insert(
                0,
                f"train.global_batch changed ({saved['global_batch']} -> {self.global_batch}): data step "
                f"{self.anchor.data_step} reads on from global sample {self.anchor.position}, the first unread",
            )
        return notes + layout

    def indices(self, data_step: int) -> tuple[int, np.ndarray, np.ndarray]:
        """The global samples of a data step: (its global position, source of each, sample within its source)."""
        splits = self._open()
        start = self._position(data_step)
        parts = []
        for a, b in self._runs(start, self.global_batch):  # one run unless a skipped range cuts the batch
            consumed = self._consumed_at(a)
            src, sample = _mix(
                seed=self.seed,
                consumed=consumed,
                base=self.anchor.base,
                n=b - a,
                sizes=[s.num_samples for s in splits],
                weights=self.weights,
                streams=self.anchor.streams,
            )
            self._at = (b, [c + int(k) for c, k in zip(consumed, np.bincount(src, minlength=len(consumed)))])
            parts.append((src, sample))
        return start, np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def batch(self, data_step: int) -> tuple[torch.Tensor, torch.Tensor]:
        splits = self._open()
        _, src, sample = self.indices(data_step)
        local = self.global_batch // self.dp
        mine = slice(self.dp_rank * local, (self.dp_rank + 1) * local)
        src, sample = src[mine], sample[mine]
        rows = np.empty((local, self.seq_len + 1), dtype=np.int64)
        for s, split in enumerate(splits):
            sel = src == s
            if sel.any():
                rows[sel] = split.rows(sample[sel])
        import torch  # lazy: a rank's method (see TYPE_CHECKING above)

        t = torch.from_numpy(rows)
        if self.seq_positions is not None:
            return t[:, self.seq_positions], t[:, self.seq_positions + 1]
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def close(self) -> None:
        for s in self._splits or []:
            s.file.close()
        self._splits = None
