"""Adding, removing or reordering a mixture's sources never repeats a sample within its epoch:
each file keeps its permutation stream, carried in the cursor and found by the file's identity."""

from __future__ import annotations

import pytest

from jobs.config import DataConfig
from jobs.data import BatchSource, ensure_dataset

GB = 10


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    out = {}
    for name, n, seed in (("A", 1000, 1), ("B", 3000, 2), ("C", 2000, 3)):
        cfg = DataConfig(path=str(tmp_path / f"{name}.h5"), num_samples=n, gen_seed=seed)
        ensure_dataset(cfg, vocab_size=32, sample_len=9)
        out[name] = cfg.path
    return out


def _source(mix: list[tuple[str, float]]) -> BatchSource:
    return BatchSource(mix, seed=7, global_batch=GB, seq_len=8, dp_rank=0, dp=1)


def _read(src: BatchSource, steps: range) -> list[tuple[str, int]]:
    """(file path, sample) of every sample the data steps read."""
    out = []
    for d in steps:
        _, source, sample = src.indices(d)
        out += [(str(src.paths[s]), int(i)) for s, i in zip(source, sample)]
    return out


def _of(read: list[tuple[str, int]], path: str) -> list[int]:
    return [i for p, i in read if p == path]


def test_a_source_added_mid_epoch_does_not_repeat_the_samples_already_read(files) -> None:
    # The case: A alone, 500 of its 1,000 samples read; resumed as [A, B] (before: 122 of A's next 250
    # samples had been read already this epoch, 0 when A stays alone).
    alone = _source([(files["A"], 1.0)])
    first = _of(_read(alone, range(50)), files["A"])
    assert len(first) == 500
    mixed = _source([(files["A"], 0.5), (files["B"], 0.5)])
    notes = mixed.restore(alone.cursor(50))
    nxt = _of(_read(mixed, range(50, 100)), files["A"])
    assert len(nxt) == 250 and len(set(nxt)) == 250
    assert not set(first) & set(nxt)
    assert sorted(first + _of(_read(mixed, range(100, 150)), files["A"])[:250] + nxt) == list(range(1000))
    assert any("data mixture changed" in n for n in notes)


def test_a_source_removed_or_reordered_goes_on_with_the_same_permutation(files) -> None:
    ab = _source([(files["A"], 0.5), (files["B"], 0.5)])
    read = _read(ab, range(60))  # 300 of A, 300 of B
    cursor = ab.cursor(60)
    for mix in ([(files["A"], 1.0)], [(files["B"], 0.5), (files["A"], 0.5)], [(files["C"], 0.3), (files["A"], 0.7)]):
        src = _source(mix)
        src.restore(cursor)
        again = _read(src, range(60, 90))
        for path in (files["A"], files["B"]):
            before, after = _of(read, path), _of(again, path)
            assert len(set(after)) == len(after) and not set(before) & set(after), (mix, path)
    # an uninterrupted [A, B] and the same list resumed read the same samples
    same = _source([(files["A"], 0.5), (files["B"], 0.5)])
    same.restore(cursor)
    assert _read(same, range(60, 70)) == _read(ab, range(60, 70))


def test_a_cursor_without_streams_goes_on_with_the_streams_it_was_read_with(files) -> None:
    ab = _source([(files["A"], 0.5), (files["B"], 0.5)])
    read = _read(ab, range(60))
    old = {k: v for k, v in ab.cursor(60).items() if k != "streams"}
    old["version"] = 1  # saved before the cursor kept the streams: by place, as then
    ba = _source([(files["B"], 0.5), (files["A"], 0.5)])
    ba.restore(old)
    assert ba.anchor.streams == [2, 1]
    again = _read(ba, range(60, 90))
    assert not set(_of(read, files["A"])) & set(_of(again, files["A"]))
