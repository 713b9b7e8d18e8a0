"""python -m jobs.prepare_data: deterministic bytes, round trip, appends, malformed inputs, the held-out split,
mixtures, and the vocabulary check before a run starts."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys

import h5py
import numpy as np
import pytest

from jobs.config import DataConfig, DataSource
from jobs.data import BatchSource, ensure_dataset, mixture_indices
from jobs.data.corpus import InputError
from jobs.data.prepare import prepare_data, read_manifest, read_tokenizer
from tests.conftest import REPO

_WORDS = "the a quick brown fox jumps over lazy dog cat sat on mat river stone tree green blue é ü 東京".split()


def write_corpus(tmp_path, *, docs: int = 120, seed: int = 0) -> tuple[list, list[str]]:
    """A JSON-lines and a text file of random sentences; returns (files, their documents in order)."""
    r = random.Random(seed)
    sent = lambda: " ".join(r.choice(_WORDS) for _ in range(r.randint(3, 30)))  # noqa: E731
    jl = [sent() + ("\n" + sent() if i % 5 == 0 else "") for i in range(docs)]
    tx = ["\n".join(sent() for _ in range(r.randint(1, 3))) for _ in range(docs // 3)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in jl))
    (tmp_path / "b.txt").write_text("\n\n".join(tx) + "\n")
    return [tmp_path / "a.jsonl", tmp_path / "b.txt"], jl + tx


def _prepare(inputs, out, **kw) -> dict:
    cfg = DataConfig(name="tokenized", path=str(out), inputs=[str(p) for p in inputs], heldout_fraction=0.2, **kw)
    return prepare_data(cfg, vocab_size=384, progress=lambda _: None)


def _documents(path, split: str) -> list[str]:
    tok, eos = read_tokenizer(path), read_manifest(path)["eos_id"]
    with h5py.File(path) as f:
        ids = f[split][:].tolist()
    docs, cur = [], []
    for i in ids:
        if i == eos:
            docs.append(tok.decode(cur))
            cur = []
        else:
            cur.append(i)
    assert not cur  # every document ends with EOS
    return docs


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_prepare_data_is_deterministic_and_round_trips(tmp_path) -> None:
    files, docs = write_corpus(tmp_path)
    _prepare(files, tmp_path / "one.h5")
    m = _prepare(files, tmp_path / "two.h5")
    assert _sha(tmp_path / "one.h5") == _sha(tmp_path / "two.h5")  # same inputs, same bytes
    train, held = _documents(tmp_path / "one.h5", "tokens"), _documents(tmp_path / "one.h5", "heldout")
    assert sorted(train + held) == sorted(docs)  # decode(tokens) == the documents, none lost
    assert train == [d for d in docs if d in set(train)] and len(held) > 5  # order kept within each split
    assert m["documents"] == len(train) and m["heldout_documents"] == len(held) and m["vocab_size"] <= 384
    assert [f["sha256"] for f in m["files"]] == [_sha(p) for p in files]


def test_a_rerun_appends_new_files_and_skips_present_ones(tmp_path) -> None:
    files, _ = write_corpus(tmp_path)
    _prepare(files[:1], tmp_path / "out.h5")
    first = _documents(tmp_path / "out.h5", "tokens")
    m = _prepare(files, tmp_path / "out.h5")  # a.jsonl is present (skipped by hash), b.txt is new
    assert [f["path"] for f in m["files"]] == [str(p) for p in files]
    assert _documents(tmp_path / "out.h5", "tokens")[: len(first)] == first
    before = _sha(tmp_path / "out.h5")
    _prepare(files, tmp_path / "out.h5")  # nothing new: the file is untouched
    assert _sha(tmp_path / "out.h5") == before


BAD = {  # file name -> (bytes, line the error names, words it says)
    "bad_json.jsonl": (b'{"text": "ok"}\n{"text": "no end\n', 2, "not a JSON line"),
    "no_text.jsonl": (b'{"text": "ok"}\n{"body": "x"}\n', 2, 'no "text" field'),
    "wrong_type.jsonl": (b'{"text": "ok"}\n\n{"text": 7}\n', 3, '"text" is of type int, not a string'),
    "empty.txt": (b"", 1, "no documents"),
    "latin1.txt": (b"fine line\n\ncaf\xe9\n", 3, "not UTF-8"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_malformed_input_names_file_and_line_and_writes_nothing(tmp_path, name: str) -> None:
    files, _ = write_corpus(tmp_path, docs=30)
    data, line, words = BAD[name]
    (tmp_path / name).write_bytes(data)
    with pytest.raises(InputError, match=f"{tmp_path / name}:{line}: {words}"):
        _prepare([files[0], tmp_path / name], tmp_path / "out.h5")
    assert sorted(os.listdir(tmp_path)) == sorted(["a.jsonl", "b.txt", name])  # no output, no temporary file
    _prepare(files, tmp_path / "out.h5")
    before = _sha(tmp_path / "out.h5")
    with pytest.raises(InputError):
        _prepare([*files, tmp_path / name], tmp_path / "out.h5")  # an append that fails leaves the file as it was
    assert _sha(tmp_path / "out.h5") == before and len(os.listdir(tmp_path)) == 4


def test_a_malformed_input_exits_2_from_the_command(tmp_path) -> None:
    (tmp_path / "bad.jsonl").write_bytes(BAD["bad_json.jsonl"][0])
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.prepare_data",
            f"data.inputs=[{tmp_path / 'bad.jsonl'}]",
            f"data.path={tmp_path / 'out.h5'}",
            "model.vocab_size=384",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and f"{tmp_path / 'bad.jsonl'}:2: not a JSON line" in p.stderr, p.stderr
    assert not (tmp_path / "out.h5").exists()


def test_the_heldout_split_never_overlaps_training_samples(tmp_path) -> None:
    files, _ = write_corpus(tmp_path, docs=200)
    _prepare(files, tmp_path / "out.h5")
    train, held = _documents(tmp_path / "out.h5", "tokens"), _documents(tmp_path / "out.h5", "heldout")
    assert held and not set(train) & set(held)  # split by document: no document on both sides
    with h5py.File(tmp_path / "out.h5") as f:
        stream_train, stream_held = f["tokens"][:], f["heldout"][:]
    src = BatchSource(tmp_path / "out.h5", seed=0, global_batch=4, seq_len=15, dp_rank=0, dp=1, split="heldout")
    x, y = src.batch(0)
    samples = {tuple(stream_train[i : i + 16]) for i in range(0, len(stream_train) - 15, 16)}
    assert len(samples) == len(stream_train) // 16  # the training samples: consecutive cuts of seq_len + 1
    for row in np.concatenate([x.numpy(), y.numpy()[:, -1:]], axis=1):
        assert tuple(row) not in samples and any(
            np.array_equal(row, stream_held[i : i + 16]) for i in range(0, len(stream_held) - 15, 16)
        )


def test_the_synthetic_heldout_rows_are_new_samples_of_the_same_language(tmp_path) -> None:
    cfg = DataConfig(path=str(tmp_path / "s.h5"), num_samples=200, gen_seed=3, heldout_fraction=0.1)
    ensure_dataset(cfg, vocab_size=256, sample_len=33)
    with h5py.File(cfg.path) as f:
        train, held = f["tokens"][:], f["heldout"][:]
    # Another draw (its own RNG stream, the same rules). With a small vocabulary a rule-only row can repeat
    # by chance; at 256 tokens x 33 this seed has none, so any shared row would be a copied one.
    assert held.shape == (20, 33) and not {tuple(r) for r in train} & {tuple(r) for r in held}
    rule_a = {}  # the same language: a held-out row's noise-free successors are the training rows' successors
    for r in train:
        for p, n in zip(r[:-1], r[1:]):
            rule_a.setdefault((r[0] % 8, p), []).append(n)
    follows = [
        np.bincount(rule_a[(r[0] % 8, p)]).argmax() == n
        for r in held
        for p, n in zip(r[:-1], r[1:])
        if (r[0] % 8, p) in rule_a
    ]
    assert np.mean(follows) > 0.8


def test_a_format_1_synthetic_file_is_refused_with_the_fix(tmp_path) -> None:
    with h5py.File(tmp_path / "old.h5", "w") as f:
        f["tokens"] = np.zeros((8, 9), np.int32)
        f.attrs.update({"format": 1, "vocab_size": 16, "gen_seed": 1})
    with pytest.raises(ValueError, match="format-1 synthetic file.*delete it"):
        ensure_dataset(
            DataConfig(path=str(tmp_path / "old.h5"), num_samples=8, gen_seed=1), vocab_size=16, sample_len=9
        )


def test_a_mixture_is_deterministic_and_follows_its_weights(tmp_path) -> None:
    kw = dict(seed=5, global_batch=64, sizes=[100, 37], weights=[0.7, 0.3])
    a = [mixture_indices(step=s, **kw) for s in range(200)]
    assert all(
        np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
        for x, y in zip(a, [mixture_indices(step=s, **kw) for s in range(200)])
    )
    src = np.concatenate([s for s, _ in a])
    assert abs((src == 0).mean() - 0.7) < 0.02  # 12800 draws: 4 standard deviations is 0.016
    assert all((i[s == 1] < 37).all() for s, i in a)
    files, _ = write_corpus(tmp_path, docs=60)
    _prepare(files[:1], tmp_path / "a.h5")
    _prepare(files[1:], tmp_path / "b.h5")
    mix = [(str(tmp_path / "a.h5"), 0.7), (str(tmp_path / "b.h5"), 0.3)]
    whole = BatchSource(mix, seed=1, global_batch=8, seq_len=7, dp_rank=0, dp=1).batch(3)[0].numpy()
    parts = [BatchSource(mix, seed=1, global_batch=8, seq_len=7, dp_rank=r, dp=2).batch(3)[0].numpy() for r in (0, 1)]
    assert np.array_equal(whole, np.concatenate(parts))  # every mesh's dp slices make the same global batch


def test_a_vocabulary_mismatch_is_refused_before_start(tmp_path) -> None:
    files, _ = write_corpus(tmp_path, docs=200)
    m = _prepare(files, tmp_path / "out.h5")
    cfg = DataConfig(name="tokenized", sources=[DataSource(path=str(tmp_path / "out.h5"), weight=1.0)])
    with pytest.raises(ValueError, match=f"set model.vocab_size=384 \\(at least {m['vocab_size']}"):
        ensure_dataset(cfg, vocab_size=256, sample_len=33)
    ensure_dataset(cfg, vocab_size=384, sample_len=33)  # a larger model vocabulary is fine (padding)
    with pytest.raises(ValueError, match="held-out tokens, fewer than one evaluation sample.*train.eval_every=0"):
        ensure_dataset(cfg, vocab_size=384, sample_len=33, eval_sample_len=m["heldout_tokens"] + 1)
    run_dir = tmp_path / "run"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.train",
            f"run.dir={run_dir}",
            "data=tokenized",
            f"data.path={tmp_path / 'out.h5'}",
            "mesh=single",
            "launcher.tasks_per_node=1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "model.vocab_size=384" in p.stderr, p.stderr
    assert not run_dir.exists()  # refused before any rank started or anything was written


def test_a_given_tokenizer_json_is_used_as_is_and_needs_an_eos_token(tmp_path) -> None:
    files, _ = write_corpus(tmp_path, docs=60)
    _prepare(files, tmp_path / "trained.h5")
    read_tokenizer(tmp_path / "trained.h5").save(str(tmp_path / "tokenizer.json"))
    m = _prepare(files, tmp_path / "given.h5", tokenizer=str(tmp_path / "tokenizer.json"))
    with h5py.File(tmp_path / "trained.h5") as a, h5py.File(tmp_path / "given.h5") as b:
        assert np.array_equal(a["tokens"][:], b["tokens"][:]) and np.array_equal(a["heldout"][:], b["heldout"][:])
    assert m["tokenizer"] == str(tmp_path / "tokenizer.json")
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    spec["added_tokens"] = []  # no end-of-document token left
    spec["model"]["vocab"] = {t: i for t, i in spec["model"]["vocab"].items() if t != "<|endoftext|>"}
    (tmp_path / "no_eos.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match="data.tokenizer=.*no_eos.json has none of the end-of-document tokens"):
        _prepare(files, tmp_path / "x.h5", tokenizer=str(tmp_path / "no_eos.json"))
    assert not (tmp_path / "x.h5").exists() and not list(tmp_path.glob(".x.h5*"))  # nor a temporary file
