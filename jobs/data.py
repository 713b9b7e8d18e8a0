"""Training data: a synthetic language in an HDF5 token file, and a mesh-independent sampler.

The sampler maps (seed, step) to the global batch's sample indices; each dp rank takes its slice.
Every mesh therefore sees the same global batches, which is what makes parity tests and
resharded resumes exact. The data cursor of a run is just its step.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import torch

from jobs.config import DataConfig

__all__ = ["ensure_dataset", "global_batch_indices", "BatchSource", "FORMAT_VERSION"]

FORMAT_VERSION = 1
_RULES = 8  # distinct "grammars" of the synthetic language
_NOISE = 0.1  # share of tokens replaced by uniform noise


def _generate(num_samples: int, sample_len: int, vocab: int, seed: int) -> np.ndarray:
    """A learnable synthetic language: each sample follows one of `_RULES` affine successor rules
    next = (a·prev + b) mod vocab, chosen by the sample's first token, with 10% uniform noise tokens.
    A model must read the context to know the rule: the loss falls from ln(vocab) toward the noise floor."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, vocab // 2, size=_RULES) * 2 + 1  # odd multipliers: bijective successor maps
    b = rng.integers(0, vocab, size=_RULES)
    out = np.empty((num_samples, sample_len), dtype=np.int32)
    out[:, 0] = rng.integers(0, vocab, size=num_samples)
    rule = out[:, 0] % _RULES
    for t in range(1, sample_len):
        nxt = (a[rule] * out[:, t - 1] + b[rule]) % vocab
        noise = rng.random(num_samples) < _NOISE
        nxt[noise] = rng.integers(0, vocab, size=int(noise.sum()))
        out[:, t] = nxt
    return out


def ensure_dataset(cfg: DataConfig, *, vocab_size: int, sample_len: int) -> Path:
    """Generates the token file once (deterministically) if missing; checks an existing one matches.

    Call it from one process before ranks start (the entry point does). Written to a temporary
    name and renamed, so a crash never leaves a half-written file under the real name.
    """
    path = Path(cfg.path).resolve()
    want = {"format": FORMAT_VERSION, "vocab_size": vocab_size, "gen_seed": cfg.gen_seed}
    if path.exists():
        with h5py.File(path, "r") as f:
            have = {k: int(f.attrs.get(k, -1)) for k in want}
            shape = f["tokens"].shape
        if have != want or shape[0] < cfg.num_samples or shape[1] < sample_len:
            raise ValueError(
                f"data.path={cfg.path} holds {have} with shape {shape}, but this run needs {want} with at least "
                f"({cfg.num_samples}, {sample_len}); point data.path at a new file (it is generated on first use)"
            )
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens = _generate(cfg.num_samples, sample_len, vocab_size, cfg.gen_seed)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with h5py.File(tmp, "w") as f:
        f.create_dataset("tokens", data=tokens, chunks=(min(64, cfg.num_samples), sample_len))
        for k, v in want.items():
            f.attrs[k] = v
    os.replace(tmp, path)
    return path


def global_batch_indices(*, seed: int, step: int, global_batch: int, num_samples: int) -> np.ndarray:
    """Sample indices of step `step`'s global batch: epoch-wise permutations of the file, seeded by
    (seed, epoch), read in order. A pure function of its arguments (never of the mesh)."""
    start = step * global_batch
    pos = np.arange(start, start + global_batch)
    epochs = pos // num_samples
    out = np.empty(global_batch, dtype=np.int64)
    for epoch in np.unique(epochs):
        perm = np.random.default_rng([seed, int(epoch)]).permutation(num_samples)
        sel = epochs == epoch
        out[sel] = perm[pos[sel] % num_samples]
    return out


class BatchSource:
    """This dp rank's (inputs, targets) for a step, read lazily from the HDF5 file in this process."""

    def __init__(self, path: str | os.PathLike[str], *, seed: int, global_batch: int, seq_len: int,
                 dp_rank: int, dp: int) -> None:
        assert global_batch % dp == 0, (global_batch, dp)
        self.path, self.seed, self.global_batch, self.seq_len = Path(path), seed, global_batch, seq_len
        self.dp_rank, self.dp = dp_rank, dp
        self._file: h5py.File | None = None

    def _tokens(self) -> h5py.Dataset:
        if self._file is None:
            self._file = h5py.File(self.path, "r")
        return self._file["tokens"]

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self._tokens()
        idx = global_batch_indices(seed=self.seed, step=step, global_batch=self.global_batch,
                                   num_samples=tokens.shape[0])
        local = self.global_batch // self.dp
        mine = idx[self.dp_rank * local:(self.dp_rank + 1) * local]
        uniq, inverse = np.unique(mine, return_inverse=True)  # h5py reads need strictly increasing indices
        rows = tokens[uniq, : self.seq_len + 1][inverse]
        t = torch.from_numpy(rows.astype(np.int64))
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
