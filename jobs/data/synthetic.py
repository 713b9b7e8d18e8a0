"""The embedded default data: a synthetic language generated deterministically into an HDF5 token file."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np

__all__ = ["write_synthetic", "heldout_rows"]

_RULES = 8  # distinct "grammars" of the synthetic language
_NOISE = 0.1  # share of tokens replaced by uniform noise
_HELDOUT_STREAM = 1  # the held-out rows' sample RNG: same rules, other samples


def _generate(num_samples: int, sample_len: int, vocab: int, seed: int, *, stream: int = 0) -> np.ndarray:
    """A learnable synthetic language: each sample follows one of `_RULES` affine successor rules
    next = (a·prev + b) mod vocab, chosen by the sample's first token, with 10% uniform noise tokens.
    A model must read the context to know the rule: the loss falls from ln(vocab) toward the noise floor.
    The rules come from `seed`; `stream` != 0 draws other samples of the same language (the held-out set)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(0, vocab // 2, size=_RULES) * 2 + 1  # odd multipliers: bijective successor maps
    b = rng.integers(0, vocab, size=_RULES)
    if stream:
        rng = np.random.default_rng([seed, stream])
    out = np.empty((num_samples, sample_len), dtype=np.int32)
    out[:, 0] = rng.integers(0, vocab, size=num_samples)
    rule = out[:, 0] % _RULES
    for t in range(1, sample_len):
        nxt = (a[rule] * out[:, t - 1] + b[rule]) % vocab
        noise = rng.random(num_samples) < _NOISE
        nxt[noise] = rng.integers(0, vocab, size=int(noise.sum()))
        out[:, t] = nxt
    return out


def heldout_rows(num_samples: int, heldout_fraction: float) -> int:
    """Held-out rows of a synthetic file: heldout_fraction of its training rows, at least one."""
    return max(1, round(num_samples * heldout_fraction))


def write_synthetic(
    path: Path, *, num_samples: int, sample_len: int, vocab: int, seed: int, heldout_fraction: float, attrs: dict
) -> None:
    """Writes the training rows (`tokens`) and held-out rows (`heldout`: the same language, other
    samples) to a temporary name and renames it, so a crash never leaves a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    held = heldout_rows(num_samples, heldout_fraction)
    with h5py.File(tmp, "w") as f:
        f.create_dataset(
            "tokens", data=_generate(num_samples, sample_len, vocab, seed), chunks=(min(64, num_samples), sample_len)
        )
        f.create_dataset(
            "heldout",
            data=_generate(held, sample_len, vocab, seed, stream=_HELDOUT_STREAM),
            chunks=(min(64, held), sample_len),
        )
        for k, v in attrs.items():
            f.attrs[k] = v
    os.replace(tmp, path)
