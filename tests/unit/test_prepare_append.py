"""python -m jobs.prepare_data appending: in place (no rewrite), read back exactly, the manifest as the commit
(an error or a kill between the data and the manifest never leaves a manifest counting tokens that are not
there), and files with fixed-size streams converted once."""

from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from jobs.config import DataConfig
from jobs.data import ensure_dataset, prepare
from jobs.data.prepare import prepare_data, read_manifest
from tests.conftest import REPO
from tests.unit.test_prepare_data import write_corpus

_STREAMS = ("tokens", "heldout")


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    """(a.jsonl, b.txt, c.txt, tok.h5: a tokenizer trained on all three, reused so that files compare)."""
    monkeypatch.setattr(prepare, "_CHUNK", 1024)  # small chunks: an append's writes are small next to the file
    files, _ = write_corpus(tmp_path, docs=600)
    (tmp_path / "c.txt").write_text("\n\n".join(f"third file document {i} of the river" for i in range(40)) + "\n")
    files.append(tmp_path / "c.txt")
    _prepare(files, tmp_path / "tok.h5")
    return [*files, tmp_path / "tok.h5"]


def _prepare(inputs, out, *, tokenizer=None, said: list | None = None) -> dict:
    cfg = DataConfig(
        name="tokenized",
        path=str(out),
        inputs=[str(p) for p in inputs],
        heldout_fraction=0.2,
        tokenizer=str(tokenizer) if tokenizer else None,
    )
    return prepare_data(cfg, vocab_size=384, progress=(said.append if said is not None else lambda _: None))


def _contents(path) -> tuple[dict, dict]:
    with h5py.File(path) as f:
        return read_manifest(path), {name: f[name][:] for name in _STREAMS}


def _same(a, b) -> bool:
    (ma, sa), (mb, sb) = _contents(a), _contents(b)
    return ma == mb and all(np.array_equal(sa[n], sb[n]) and sa[n].dtype == sb[n].dtype for n in _STREAMS)


def _chunks(path) -> dict[str, list[tuple[int, bytes]]]:
    """Each stream's chunks: (byte offset, bytes up to the stream's end)."""
    out, raw = {}, path.read_bytes()
    with h5py.File(path) as f:
        for name in _STREAMS:
            ds, out[name] = f[name], []
            for k in range(ds.id.get_num_chunks()):
                info = ds.id.get_chunk_info(k)
                used = min(ds.chunks[0], ds.shape[0] - info.chunk_offset[0]) * ds.dtype.itemsize
                out[name].append((info.byte_offset, raw[info.byte_offset : info.byte_offset + used]))
    return out


def _kept(old: dict, new: dict) -> bool:
    """Every old chunk where it was, its bytes unchanged (the last one, partly filled, only grew)."""

    def kept(o: list, n: list) -> bool:
        last = n[len(o) - 1]
        return len(o) >= 2 and n[: len(o) - 1] == o[:-1] and last[0] == o[-1][0] and last[1].startswith(o[-1][1])

    return all(kept(old[name], new[name]) for name in _STREAMS)


def _written() -> int:
    return int(dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())["wchar"])


def test_an_append_extends_the_file_in_place_and_reads_back_as_one_prepare_of_all(tmp_path, corpus) -> None:
    a, b, c, tok = corpus
    _prepare([a, b, c], tmp_path / "whole.h5", tokenizer=tok)
    out = tmp_path / "out.h5"
    _prepare([a, b], out, tokenizer=tok)
    inode, size, chunks = out.stat().st_ino, out.stat().st_size, _chunks(out)
    w0 = _written()
    m = _prepare([a, b, c], out, tokenizer=tok)  # a and b are present (skipped), c is appended
    written = _written() - w0
    assert out.stat().st_ino == inode  # the same file, not a copy renamed over it
    assert _kept(chunks, _chunks(out))  # every old chunk where it was, its bytes unchanged
    added = (m["files"][2]["tokens"] + m["files"][2]["heldout_tokens"]) * 2  # bytes of uint16
    print(f"appended {added} bytes of tokens to a {size}-byte file: {written} bytes written")
    assert written < size / 3, (written, size, added)  # the old data are not written again
    assert _same(out, tmp_path / "whole.h5")  # the same tokens and manifest as one prepare of all three
    ensure_dataset(DataConfig(name="tokenized", path=str(out)), vocab_size=384, sample_len=33)


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_an_error_during_an_append_leaves_the_file_as_it_was(tmp_path, corpus, monkeypatch, where: str) -> None:
    a, b, c, tok = corpus
    out = tmp_path / "out.h5"
    _prepare([a], out, tokenizer=tok)
    _prepare([a], tmp_path / "before.h5", tokenizer=tok)

    def fail(orig):
        def call(*args, **kw):
            orig(*args, **kw)  # it did its writing: the error comes after it
            raise RuntimeError(f"injected after the {where}")

        return call

    name = "_flush" if where == "data" else "_put_manifest"
    monkeypatch.setattr(prepare, name, fail(getattr(prepare, name)))
    with pytest.raises(RuntimeError, match="injected"):
        _prepare([a, b], out, tokenizer=tok)
    monkeypatch.undo()
    assert _same(out, tmp_path / "before.h5")  # streams cut back, the old manifest back
    ensure_dataset(DataConfig(name="tokenized", path=str(out)), vocab_size=384, sample_len=33)
    _prepare([a, b], out, tokenizer=tok)
    _prepare([a, b], tmp_path / "whole.h5", tokenizer=tok)
    assert _same(out, tmp_path / "whole.h5")


_KILLED = """
import os, signal, sys
from jobs.config import DataConfig
from jobs.data import prepare
prepare._put_manifest = lambda f, m: os.kill(os.getpid(), signal.SIGKILL)  # killed after the data, before the commit
prepare.prepare_data(DataConfig(name="tokenized", path=sys.argv[1], inputs=sys.argv[2:4], tokenizer=sys.argv[4],
                                heldout_fraction=0.2), vocab_size=384, progress=lambda _: None)
"""


def test_a_kill_between_the_data_and_the_manifest_is_refused_by_a_run_and_cut_back_by_the_next_append(
    tmp_path, corpus
) -> None:
    a, b, c, tok = corpus
    out = tmp_path / "out.h5"
    _prepare([a], out, tokenizer=tok)
    before, streams = _contents(out)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, "-c", _KILLED, str(out), str(a), str(b), str(tok)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == -9, p.stderr[-2000:]
    after, longer = _contents(out)
    assert after == before  # the manifest counts only what was there before
    assert longer["tokens"].shape[0] > streams["tokens"].shape[0]  # the uncommitted tokens are in the file
    assert np.array_equal(longer["tokens"][: len(streams["tokens"])], streams["tokens"])
    with pytest.raises(
        ValueError, match="manifest counts .*stopped before its commit; run the same python -m jobs.prepare_data again"
    ):
        ensure_dataset(DataConfig(name="tokenized", path=str(out)), vocab_size=384, sample_len=33)
    said: list[str] = []
    _prepare([a, b], out, tokenizer=tok, said=said)
    assert any("tokens past its manifest" in s and "cut off" in s for s in said), said
    _prepare([a, b], tmp_path / "whole.h5", tokenizer=tok)
    assert _same(out, tmp_path / "whole.h5")


def test_a_file_with_fixed_size_streams_is_converted_once_then_appended_in_place(tmp_path, corpus) -> None:
    a, b, c, tok = corpus
    out = tmp_path / "out.h5"
    _prepare([a], out, tokenizer=tok)
    with h5py.File(out, "a") as f:  # as a hand-made (or other tool's) file: contiguous, fixed-size datasets
        for name in (*_STREAMS, "manifest"):
            data = f[name][:]
            del f[name]
            f.create_dataset(name, data=data)
    said: list[str] = []
    inode = out.stat().st_ino
    _prepare([a, b], out, tokenizer=tok, said=said)
    assert any("fixed size" in s and "one-time rewrite" in s for s in said), said
    assert out.stat().st_ino != inode  # converted: a copy renamed over it
    with h5py.File(out) as f:
        assert all(f[name].maxshape == (None,) for name in _STREAMS)
    said.clear()
    inode = out.stat().st_ino
    _prepare([a, b, c], out, tokenizer=tok, said=said)
    assert out.stat().st_ino == inode and not any("rewrite" in s for s in said), said  # now in place
    _prepare([a, b, c], tmp_path / "whole.h5", tokenizer=tok)
    assert _same(out, tmp_path / "whole.h5")


def test_a_file_open_elsewhere_is_appended_to_a_copy_and_the_reader_keeps_its_file(tmp_path, corpus) -> None:
    if os.environ.get("HDF5_USE_FILE_LOCKING", "").upper() == "FALSE":
        pytest.skip("HDF5_USE_FILE_LOCKING=FALSE: a reader holds no lock (an append then goes in place)")
    a, b, c, tok = corpus
    out = tmp_path / "out.h5"
    _prepare([a], out, tokenizer=tok)
    reader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import h5py, sys; f = h5py.File(sys.argv[1], 'r'); "
            "print(f['tokens'].shape[0], flush=True); sys.stdin.read(); print(f['tokens'].shape[0])",
            str(out),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        n = int(reader.stdout.readline())  # it holds the file open (HDF5's lock)
        said: list[str] = []
        m = _prepare([a, b], out, tokenizer=tok, said=said)
        assert any("cannot be opened for writing" in s and "unable to lock file" in s for s in said), said
        assert m["tokens"] > n
    finally:
        kept, _ = reader.communicate("", timeout=60)
    assert int(kept) == n  # the reader read on from the file it opened
    _prepare([a, b], tmp_path / "whole.h5", tokenizer=tok)
    assert _same(out, tmp_path / "whole.h5")


def test_overlapped_tokenization_writes_the_same_bytes_as_the_serial_path(tmp_path, corpus, monkeypatch) -> None:
    a, b, c, tok = corpus
    monkeypatch.setattr(prepare, "_BATCH_DOCS", 7)  # many batches in flight, and several flushes per file
    monkeypatch.setattr(prepare, "_FLUSH_TOKENS", 500)
    for overlap in (False, True):
        cfg = DataConfig(
            name="tokenized",
            path=str(tmp_path / f"{overlap}.h5"),
            inputs=[str(a), str(b)],
            heldout_fraction=0.2,
            tokenizer=str(tok),
        )
        prepare_data(cfg, vocab_size=384, progress=lambda _: None, overlap=overlap)
        cfg.inputs.append(str(c))  # and an append
        prepare_data(cfg, vocab_size=384, progress=lambda _: None, overlap=overlap)
    assert (tmp_path / "False.h5").read_bytes() == (tmp_path / "True.h5").read_bytes()
    eos, m = read_manifest(tok)["eos_id"], read_manifest(tmp_path / "True.h5")
    texts = [t for t, _ in prepare.pieces(c, doc_per="paragraph")]  # c's documents, each one piece
    encoded = prepare.read_tokenizer(tok).encode_batch(texts, add_special_tokens=False)  # the plain batch encode
    with h5py.File(tmp_path / "True.h5") as f:
        for name, held in (("tokens", False), ("heldout", True)):
            key = "heldout_tokens" if held else "tokens"
            want = [i for t, e in zip(texts, encoded) if prepare._is_heldout(t, 0.2) == held for i in e.ids + [eos]]
            assert f[name][m[key] - m["files"][2][key] :].tolist() == want  # the ids c was appended as
