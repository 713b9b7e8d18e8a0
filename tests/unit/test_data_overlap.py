"""data.sample_overlap: a tokenized stream's consecutive samples share one token, so every transition is a target
exactly once; off (the default) keeps the non-overlapping samples; a resume with the other setting is refused."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from jobs.config import DataConfig
from jobs.data import BatchSource, DataChanged, ensure_dataset


def _stream(tmp_path, n: int):
    """A stream whose token at position p is p: a sample's tokens say where it was cut."""
    path = tmp_path / "stream.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("tokens", data=np.arange(n, dtype=np.int32))
    return path


def _all_samples(path, *, seq_len: int, overlap: bool) -> tuple[np.ndarray, np.ndarray]:
    src = BatchSource(path, seed=0, global_batch=1, seq_len=seq_len, dp_rank=0, dp=1, sample_overlap=overlap)
    n = src._open()[0].num_samples
    rows = [src.batch(step) for step in range(n)]  # one sample per step: the first epoch, permuted
    return np.concatenate([x.numpy() for x, _ in rows]), np.concatenate([y.numpy() for _, y in rows])


def test_overlapping_samples_make_every_transition_of_the_stream_a_target_exactly_once(tmp_path) -> None:
    seq_len, n = 7, 7 * 20 + 3  # 143 tokens
    x, y = _all_samples(_stream(tmp_path, n), seq_len=seq_len, overlap=True)
    assert len(x) == (n - 1) // seq_len == 20  # sample i is tokens[7i : 7i + 8]
    assert sorted(x[:, 0].tolist()) == list(range(0, 20 * seq_len, seq_len))
    pairs = sorted(zip(x.ravel().tolist(), y.ravel().tolist()))
    assert pairs == [(t, t + 1) for t in range(20 * seq_len)]  # every (token, next token) once, none twice
    x, y = _all_samples(_stream(tmp_path, n), seq_len=seq_len, overlap=False)  # the default, as before
    assert len(x) == n // (seq_len + 1) == 17 and sorted(x[:, 0].tolist()) == list(range(0, 17 * 8, 8))
    missed = {(t, t + 1) for t in range(17 * 8 - 1)} - set(zip(x.ravel().tolist(), y.ravel().tolist()))
    assert missed == {(8 * k + 7, 8 * k + 8) for k in range(16)}  # each sample boundary's transition is never trained


def test_a_resume_with_the_other_sample_overlap_is_refused_unless_accepted(tmp_path) -> None:
    path = _stream(tmp_path, 200)
    kw = dict(seed=0, global_batch=2, seq_len=7, dp_rank=0, dp=1)
    run = BatchSource(path, **kw)
    run.batch(0), run.batch(1)
    saved = run.cursor(2)
    assert saved["sample_overlap"] is False
    with pytest.raises(
        DataChanged,
        match="data.sample_overlap=true, but the checkpoint of data step 2 was saved with "
        "data.sample_overlap=false.*data.accept_changed_files=true",
    ):
        BatchSource(path, sample_overlap=True, **kw).restore(saved)
    notes = BatchSource(path, sample_overlap=True, **kw).restore(saved, accept_changed_files=True)
    assert any("data.sample_overlap changed (false -> true), accepted" in n for n in notes), notes
    older = {k: v for k, v in saved.items() if k != "sample_overlap"}  # a cursor saved before the key: no overlap
    assert BatchSource(path, **kw).restore(older) == []
    same = BatchSource(path, **kw)
    same.restore(saved)
    assert np.array_equal(same.batch(2)[0], run.batch(2)[0])


def test_sample_overlap_with_the_synthetic_rows_is_refused_with_the_fix(tmp_path) -> None:
    cfg = DataConfig(path=str(tmp_path / "syn.h5"), num_samples=8, sample_overlap=True)
    with pytest.raises(ValueError, match="data.sample_overlap=true .* synthetic .*drop it, or use data=tokenized"):
        ensure_dataset(cfg, vocab_size=16, sample_len=9)
