"""The sampler: (seed, step) -> the global batch's samples, over one token file or a weighted mixture.

Two layouts of a split (`tokens` for training, `heldout` for evaluation) are read:
- rows (2-D, the synthetic file): a sample is the first `seq_len + 1` tokens of one row;
- a stream (1-D, a tokenized corpus): documents concatenated, each ended by EOS, and cut into
  consecutive non-overlapping samples of `seq_len + 1` tokens (packing; a document may span two
  samples, the tail shorter than one sample is not used).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import h5py
import numpy as np
import torch

__all__ = ["BatchSource", "global_batch_indices", "mixture_indices", "SPLITS"]

SPLITS = ("tokens", "heldout")  # dataset names: the training split and the held-out split
_MIX_KEY = 0x6D6978  # seeds the per-position source choice of a mixture apart from every sample permutation


def global_batch_indices(*, seed: int, step: int, global_batch: int, num_samples: int, stream: int = 0) -> np.ndarray:
    """Sample indices of step `step`'s global batch: epoch-wise permutations of the file, seeded by
    (seed, epoch) (and `stream`, one per mixture source), read in order. A pure function of its
    arguments (never of the mesh)."""
    start = step * global_batch
    pos = np.arange(start, start + global_batch)
    epochs = pos // num_samples
    out = np.empty(global_batch, dtype=np.int64)
    for epoch in np.unique(epochs):
        key = [seed, int(epoch)] if stream == 0 else [seed, int(epoch), stream]
        perm = np.random.default_rng(key).permutation(num_samples)
        sel = epochs == epoch
        out[sel] = perm[pos[sel] % num_samples]
    return out


def mixture_indices(*, seed: int, step: int, global_batch: int, sizes: Sequence[int],
                    weights: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(source, sample) of every position of step `step`'s global batch. Each position draws its source
    with probability weight / sum(weights) from an RNG keyed by (seed, step); source s's sample at that
    position comes from its own epoch-wise permutation (stream s + 1). A pure function of its arguments.
    One source is exactly `global_batch_indices`."""
    if len(sizes) == 1:
        return np.zeros(global_batch, dtype=np.int64), global_batch_indices(
            seed=seed, step=step, global_batch=global_batch, num_samples=sizes[0])
    p = np.asarray(weights, dtype=np.float64)
    src = np.random.default_rng([seed, step, _MIX_KEY]).choice(len(sizes), size=global_batch, p=p / p.sum())
    sample = np.zeros(global_batch, dtype=np.int64)
    for s, n in enumerate(sizes):
        sel = src == s
        if sel.any():
            sample[sel] = global_batch_indices(seed=seed, step=step, global_batch=global_batch, num_samples=n,
                                               stream=s + 1)[sel]
    return src.astype(np.int64), sample


class _Split:
    """One file's split as samples of `sample_len` tokens (rows, or a packed stream)."""

    def __init__(self, path: Path, split: str, sample_len: int) -> None:
        self.file = h5py.File(path, "r")
        if split not in self.file:
            raise ValueError(f"{path} has no {split!r} dataset; re-create it (python -m jobs.prepare_data)")
        self.ds, self.sample_len = self.file[split], sample_len
        n = self.ds.shape[0] if self.ds.ndim == 2 else self.ds.shape[0] // sample_len
        if n < 1:
            raise ValueError(f"{path}:{split} holds fewer than {sample_len} tokens (one sample of train.seq_len + 1)")
        self.num_samples = n

    def rows(self, idx: np.ndarray) -> np.ndarray:
        if self.ds.ndim == 2:
            uniq, inverse = np.unique(idx, return_inverse=True)  # h5py reads need strictly increasing indices
            return self.ds[uniq, : self.sample_len][inverse]
        L = self.sample_len
        return np.stack([self.ds[i * L:(i + 1) * L] for i in idx]) if len(idx) else np.empty((0, L), np.int32)


class BatchSource:
    """This dp rank's (inputs, targets) for a step, read lazily in this process from one token file
    (`path`) or a mixture (`path` a list of (path, weight)); `split="heldout"` reads the held-out set.
    `seq_positions` (context parallel): only the inputs at those positions of a sample, and their targets."""

    def __init__(self, path: str | os.PathLike[str] | Sequence[tuple[str, float]], *, seed: int, global_batch: int,
                 seq_len: int, dp_rank: int, dp: int, split: str = "tokens",
                 seq_positions: torch.Tensor | None = None) -> None:
        assert global_batch % dp == 0, (global_batch, dp)
        assert split in SPLITS, split
        sources = [(path, 1.0)] if isinstance(path, (str, os.PathLike)) else list(path)
        self.paths = [Path(p) for p, _ in sources]
        self.weights = [float(w) for _, w in sources]
        self.seed, self.global_batch, self.seq_len, self.split = seed, global_batch, seq_len, split
        self.dp_rank, self.dp = dp_rank, dp
        self.seq_positions = seq_positions
        self._splits: list[_Split] | None = None

    def _open(self) -> list[_Split]:
        if self._splits is None:
            self._splits = [_Split(p, self.split, self.seq_len + 1) for p in self.paths]
        return self._splits

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        splits = self._open()
        src, sample = mixture_indices(seed=self.seed, step=step, global_batch=self.global_batch,
                                      sizes=[s.num_samples for s in splits], weights=self.weights)
        local = self.global_batch // self.dp
        mine = slice(self.dp_rank * local, (self.dp_rank + 1) * local)
        src, sample = src[mine], sample[mine]
        rows = np.empty((local, self.seq_len + 1), dtype=np.int64)
        for s, split in enumerate(splits):
            sel = src == s
            if sel.any():
                rows[sel] = split.rows(sample[sel])
        t = torch.from_numpy(rows)
        if self.seq_positions is not None:
            return t[:, self.seq_positions], t[:, self.seq_positions + 1]
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def close(self) -> None:
        for s in self._splits or []:
            s.file.close()
        self._splits = None
