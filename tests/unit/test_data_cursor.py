"""The data cursor: exact, repeat-free blending of a mixture, and a resume that goes on at the next unread sample
(a changed train.global_batch included) or refuses a changed data file."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from jobs.config import DataConfig
from jobs.data import BatchSource, blend, ensure_dataset, global_batch_indices, mixture_indices


def _draws(sizes: list[int], weights: list[float], *, steps: int, global_batch: int) -> tuple[np.ndarray, np.ndarray]:
    out = [
        mixture_indices(seed=3, step=s, global_batch=global_batch, sizes=sizes, weights=weights) for s in range(steps)
    ]
    return np.concatenate([s for s, _ in out]), np.concatenate([i for _, i in out])


def test_a_mixture_never_repeats_a_sample_before_its_source_is_used_up() -> None:
    # The case: weight 0.5 of a 2,000-sample source, 1,024 draws from it (before: 760 distinct of 1,018).
    src, idx = _draws([2000, 5000], [0.5, 0.5], steps=64, global_batch=32)
    for s in (0, 1):
        got = idx[src == s]
        assert len(got) == 1024 and len(np.unique(got)) == 1024


def test_a_used_up_source_starts_a_new_permutation_and_each_epoch_holds_every_sample_once() -> None:
    src, idx = _draws([300, 5000], [0.5, 0.5], steps=40, global_batch=32)  # 640 draws from a 300-sample source
    small = idx[src == 0]
    assert len(small) == 640
    for epoch in (small[:300], small[300:600]):
        assert sorted(epoch.tolist()) == list(range(300))
    assert not np.array_equal(small[:300], small[300:600])  # another order in the next epoch


@pytest.mark.parametrize(
    "weights",
    [
        [0.5, 0.5],
        [0.7, 0.3],
        [0.5, 0.3, 0.2],
        [0.1, 0.2, 0.3, 0.4],
        [3.0, 1.0, 1.0, 0.5, 0.25],
        [0.97, 0.01, 0.01, 0.01],
    ],
)
def test_realised_shares_stay_within_one_sample_of_the_weights_at_every_prefix(weights) -> None:
    n = 4000
    src = blend(consumed=[0] * len(weights), weights=weights, n=n)
    counts = np.cumsum(np.eye(len(weights), dtype=np.int64)[src], axis=0)  # counts after 1..n samples
    want = np.outer(np.arange(1, n + 1), np.asarray(weights) / sum(weights))
    assert np.abs(counts - want).max() < 1.0


def test_blending_goes_on_from_consumed_counts_exactly_as_an_uninterrupted_run() -> None:
    w = [0.5, 0.3, 0.2]
    whole = blend(consumed=[0, 0, 0], weights=w, n=1000)
    head = blend(consumed=[0, 0, 0], weights=w, n=377)
    counts = np.bincount(head, minlength=3).tolist()
    assert np.array_equal(np.concatenate([head, blend(consumed=counts, weights=w, n=623)]), whole)


def test_one_source_reads_exactly_as_before_the_cursor() -> None:
    src, idx = mixture_indices(seed=4, step=5, global_batch=16, sizes=[100], weights=[1.0])
    assert not src.any()
    assert np.array_equal(idx, global_batch_indices(seed=4, step=5, global_batch=16, num_samples=100))


@pytest.fixture
def two_files(tmp_path) -> list[tuple[str, float]]:
    paths = []
    for name, n, seed in (("a.h5", 64, 1), ("b.h5", 48, 2)):
        cfg = DataConfig(path=str(tmp_path / name), num_samples=n, gen_seed=seed)
        ensure_dataset(cfg, vocab_size=32, sample_len=9)
        paths.append(cfg.path)
    return [(paths[0], 0.6), (paths[1], 0.4)]


def _read(mix, log, steps, *, global_batch: int, saved: dict | None = None, **kw) -> BatchSource:
    src = BatchSource(mix, seed=7, global_batch=global_batch, seq_len=8, dp_rank=0, dp=1)
    if saved is not None:
        src.restore(saved, **kw)
    with open(log, "a") as f:
        for d in steps:
            start, source, sample = src.indices(d)
            f.write(
                json.dumps({"data_step": d, "position": start, "source": source.tolist(), "sample": sample.tolist()})
                + "\n"
            )
    return src


def _logged(log) -> list[tuple[int, int]]:
    rows = [json.loads(l) for l in log.read_text().splitlines()]
    return [(s, i) for r in rows for s, i in zip(r["source"], r["sample"])]


def test_a_resume_with_a_larger_global_batch_reads_on_from_the_next_unread_sample(two_files, tmp_path) -> None:
    ref = tmp_path / "ref.jsonl"
    _read(two_files, ref, range(12), global_batch=8)  # uninterrupted: 96 samples
    first = tmp_path / "first.jsonl"
    saved = _read(two_files, first, range(4), global_batch=8).cursor(4)  # checkpoint at step 4: 32 consumed
    assert saved["position"] == 32 and sum(saved["consumed"]) == 32
    second = tmp_path / "second.jsonl"
    notes = _read(two_files, second, range(4, 8), global_batch=16, saved=saved).restore(saved)
    assert "train.global_batch changed (8 -> 16)" in notes[0]
    rows = [json.loads(l) for l in second.read_text().splitlines()]
    assert [r["position"] for r in rows] == [32, 48, 64, 80]
    # no sample repeated or skipped: the same 96 (source, sample) pairs in the same order
    assert _logged(first) + _logged(second) == _logged(ref)


def test_a_resume_with_a_smaller_global_batch_reads_on_from_the_next_unread_sample(two_files, tmp_path) -> None:
    ref = tmp_path / "ref.jsonl"
    _read(two_files, ref, range(4), global_batch=16)
    first = tmp_path / "first.jsonl"
    saved = _read(two_files, first, range(2), global_batch=16).cursor(2)
    second = tmp_path / "second.jsonl"
    _read(two_files, second, range(2, 6), global_batch=8, saved=saved)
    assert _logged(first) + _logged(second) == _logged(ref)


def test_a_checkpoint_without_a_cursor_reads_from_the_step_as_before(two_files, tmp_path) -> None:
    one = [two_files[0]]
    log = tmp_path / "a.jsonl"
    _read(one, log, [3, 4, 5], global_batch=8, saved={}, step=3)  # a checkpoint of step 3 from before the cursor
    rows = [json.loads(l) for l in log.read_text().splitlines()]
    assert [r["position"] for r in rows] == [24, 32, 40]
    assert [r["sample"] for r in rows] == [
        global_batch_indices(seed=7, step=s, global_batch=8, num_samples=64).tolist() for s in (3, 4, 5)
    ]
    far = BatchSource(two_files, seed=7, global_batch=1024, seq_len=8, dp_rank=0, dp=1)
    far.restore({}, step=10**6)  # a mixture's counts there are its shares, not a replay of 10**9 samples
    assert far.anchor.position == 1024 * 10**6 and far.anchor.consumed == [614400000, 409600000]


def test_a_changed_data_file_is_refused_naming_the_override_and_accepted_with_it(two_files, tmp_path) -> None:
    saved = _read(two_files, tmp_path / "x.jsonl", range(3), global_batch=8).cursor(3)
    path = two_files[1][0]
    with h5py.File(path, "a") as f:  # an append: more rows
        rows = f["tokens"][:]
        del f["tokens"]
        f["tokens"] = np.concatenate([rows, rows[:8]])
    with pytest.raises(ValueError, match=r"b\.h5 \(size .* -> .* bytes.*data\.accept_changed_files=true"):
        BatchSource(two_files, seed=7, global_batch=8, seq_len=8, dp_rank=0, dp=1).restore(saved)
    src = BatchSource(two_files, seed=7, global_batch=8, seq_len=8, dp_rank=0, dp=1)
    notes = src.restore(saved, accept_changed_files=True)
    assert any("accepted" in n and "b.h5" in n for n in notes)
    assert src.anchor.consumed == saved["consumed"]  # each source goes on from its consumed count
    assert src.cursor(3)["files"][1]["size"] != saved["files"][1]["size"]  # the next save records the new file


def test_an_unchanged_file_reopened_has_the_same_identity(two_files, tmp_path) -> None:
    saved = _read(two_files, tmp_path / "x.jsonl", range(2), global_batch=8).cursor(2)
    assert BatchSource(two_files, seed=7, global_batch=8, seq_len=8, dp_rank=0, dp=1).restore(saved) == []


def test_new_weights_on_resume_blend_the_following_samples_at_the_new_shares(two_files, tmp_path) -> None:
    saved = _read(two_files, tmp_path / "x.jsonl", range(5), global_batch=8).cursor(5)
    reweighted = [(two_files[0][0], 0.25), (two_files[1][0], 0.75)]
    log = tmp_path / "y.jsonl"
    src = _read(reweighted, log, range(5, 15), global_batch=8, saved=saved)
    assert src.anchor.base == saved["consumed"]
    got = np.array([s for s, _ in _logged(log)])
    counts = np.cumsum(np.eye(2, dtype=np.int64)[got], axis=0)
    want = np.outer(np.arange(1, len(got) + 1), [0.25, 0.75])
    assert np.abs(counts - want).max() < 1.0


def test_a_train_state_saved_before_the_cursor_loads_with_an_empty_one() -> None:
    from checkpoint import TrainState

    st = TrainState(data={"position": 5})
    st.load_state_dict({"step": 3, "tokens_seen": 0, "loss_tail": [], "health": {}})
    assert st.step == 3 and st.data == {}
