"""A BPE trained on the inputs learns from a bounded, evenly spread sample of them: the
trainer's word counts grow with the distinct words it sees, so prepare_data's memory no longer grows with the
corpus."""

from __future__ import annotations

import dataclasses
import random

import pytest

from jobs.config import DataConfig
from jobs.data.prepare import prepare_data, sample_texts


def _corpus(path, *, lines: int, seed: int) -> None:
    r = random.Random(seed)
    with path.open("w") as f:
        for i in range(lines):
            f.write(f"line{i} " + " ".join(f"w{r.randrange(10**6)}" for _ in range(10)) + "\n")


def test_the_bpe_sample_is_bounded_and_spread_over_every_input(tmp_path) -> None:
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    _corpus(a, lines=4000, seed=1)
    _corpus(b, lines=4000, seed=2)
    total = a.stat().st_size + b.stat().st_size
    whole = list(sample_texts([a, b], "line", limit_bytes=10 * total))
    assert sum(map(len, whole)) == total - 8000  # everything below the limit (less the newlines)
    limit = total // 10
    got = list(sample_texts([a, b], "line", limit_bytes=limit))
    assert 0.95 * limit * (total - 8000) / total <= sum(map(len, got)) <= limit
    lines = [int(t.split()[0][4:]) for t in got]
    firsts = lines[: len(lines) // 2]
    assert min(firsts) < 400 and max(firsts) > 3600  # from the start to the end of a.txt ...
    assert got[-1].startswith("line399")  # ... and of b.txt: an even spread, not the head of the corpus


def test_prepare_data_trains_its_bpe_on_the_sample(tmp_path) -> None:
    a = tmp_path / "a.txt"
    _corpus(a, lines=3000, seed=3)
    cfg = DataConfig(name="tokenized", path=str(tmp_path / "a.h5"), inputs=[str(a)], doc_per="line")
    seen: list[str] = []
    say = seen.append
    prepare_data(dataclasses.replace(cfg, tokenizer_sample_mb=0.01), vocab_size=300, progress=say)
    assert any("at most data.tokenizer_sample_mb=0.01 MB" in s for s in seen)
    with pytest.raises(ValueError, match=r"data.tokenizer_sample_mb\(0.0\) must be > 0"):
        prepare_data(
            dataclasses.replace(cfg, path=str(tmp_path / "b.h5"), tokenizer_sample_mb=0.0),
            vocab_size=300,
            progress=say,
        )
