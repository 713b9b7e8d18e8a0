"""The synthetic data file and the sampler: deterministic, and the same global batches on every mesh."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from jobs.config import DataConfig
from jobs.data import BatchSource, ensure_dataset, global_batch_indices


def test_global_batch_indices_are_a_pure_function_of_seed_and_step() -> None:
    a = global_batch_indices(seed=3, step=7, global_batch=16, num_samples=100)
    b = global_batch_indices(seed=3, step=7, global_batch=16, num_samples=100)
    c = global_batch_indices(seed=4, step=7, global_batch=16, num_samples=100)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_one_epoch_visits_every_sample_once() -> None:
    idx = np.concatenate([global_batch_indices(seed=0, step=s, global_batch=10, num_samples=50) for s in range(5)])
    assert sorted(idx.tolist()) == list(range(50))


def test_a_batch_spanning_two_epochs_takes_the_tail_of_one_and_the_head_of_the_next() -> None:
    idx = global_batch_indices(seed=0, step=1, global_batch=8, num_samples=12)  # positions 8..15
    e0 = np.random.default_rng([0, 0]).permutation(12)
    e1 = np.random.default_rng([0, 1]).permutation(12)
    assert idx.tolist() == e0[8:12].tolist() + e1[0:4].tolist()


def test_dataset_generation_is_deterministic_and_rechecked(tmp_path) -> None:
    cfg_a = DataConfig(path=str(tmp_path / "a.h5"), num_samples=64, gen_seed=5)
    cfg_b = DataConfig(path=str(tmp_path / "b.h5"), num_samples=64, gen_seed=5)
    ensure_dataset(cfg_a, vocab_size=32, sample_len=17)
    ensure_dataset(cfg_b, vocab_size=32, sample_len=17)
    with h5py.File(cfg_a.path) as fa, h5py.File(cfg_b.path) as fb:
        ta, tb = fa["tokens"][:], fb["tokens"][:]
    assert np.array_equal(ta, tb) and ta.shape == (64, 17) and ta.max() < 32
    with pytest.raises(ValueError, match="data.path="):
        ensure_dataset(cfg_a, vocab_size=64, sample_len=17)  # same file, another vocabulary


def test_the_language_mostly_follows_its_rules(tmp_path) -> None:
    cfg = DataConfig(path=str(tmp_path / "t.h5"), num_samples=256, gen_seed=1)
    ensure_dataset(cfg, vocab_size=64, sample_len=33)
    with h5py.File(cfg.path) as f:
        t = f["tokens"][:].astype(np.int64)
    # Given the (prev, next) pair, the successor of a rule-following token is determined: measure
    # how often next == the most common successor of prev within the same rule class.
    rule = t[:, 0] % 8
    hits = total = 0
    for r in range(8):
        rows = t[rule == r]
        pairs = {}
        for prev, nxt in zip(rows[:, :-1].ravel(), rows[:, 1:].ravel()):
            pairs.setdefault(prev, []).append(nxt)
        for nxts in pairs.values():
            hits += np.bincount(nxts).max()
            total += len(nxts)
    assert 0.85 < hits / total < 0.95  # 90% rule-following, 10% noise


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_slices_concatenate_to_the_same_global_batch(tmp_path, dp: int) -> None:
    cfg = DataConfig(path=str(tmp_path / "t.h5"), num_samples=40, gen_seed=2)
    ensure_dataset(cfg, vocab_size=16, sample_len=9)
    ref = BatchSource(cfg.path, seed=0, global_batch=8, seq_len=8, dp_rank=0, dp=1).batch(6)
    parts = [BatchSource(cfg.path, seed=0, global_batch=8, seq_len=8, dp_rank=r, dp=dp).batch(6) for r in range(dp)]
    x = np.concatenate([p[0].numpy() for p in parts])
    y = np.concatenate([p[1].numpy() for p in parts])
    assert np.array_equal(x, ref[0].numpy()) and np.array_equal(y, ref[1].numpy())
    assert np.array_equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
