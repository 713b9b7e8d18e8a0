"""python -m jobs.prepare_data at the edges: one tokenizer per mixture, data.tokenizer errors before any input
is read, plain text documents per line / paragraph / file in bounded pieces, the token dtype, tokens/s."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from jobs.config import DataConfig, DataSource
from jobs.data import BatchSource, corpus, ensure_dataset, prepare
from jobs.data.corpus import pieces
from jobs.data.prepare import prepare_data, read_manifest
from tests.unit.test_prepare_data import _documents, _prepare, write_corpus


def _mixture(tmp_path, a: str, b: str) -> DataConfig:
    return DataConfig(
        name="tokenized",
        sources=[DataSource(path=str(tmp_path / a), weight=0.5), DataSource(path=str(tmp_path / b), weight=0.5)],
    )


def test_a_mixture_of_files_with_their_own_bpe_is_refused_and_one_shared_tokenizer_is_accepted(tmp_path) -> None:
    files, _ = write_corpus(tmp_path, docs=200)
    _prepare(files[:1], tmp_path / "a.h5")
    _prepare(files[1:], tmp_path / "b.h5")  # its own BPE, trained on other text: ids mean other tokens
    assert read_manifest(tmp_path / "a.h5")["tokenizer_sha256"] != read_manifest(tmp_path / "b.h5")["tokenizer_sha256"]
    with pytest.raises(
        ValueError,
        match=r"different tokenizers: .*a\.h5 \(tokenizer [0-9a-f]{12}, eos_id \d+\); "
        r".*b\.h5 .*data\.tokenizer=.*a\.h5",
    ):
        ensure_dataset(_mixture(tmp_path, "a.h5", "b.h5"), vocab_size=384, sample_len=17)
    m = _prepare(files[1:], tmp_path / "b2.h5", tokenizer=str(tmp_path / "a.h5"))  # a.h5's tokenizer reused
    assert m["tokenizer_sha256"] == read_manifest(tmp_path / "a.h5")["tokenizer_sha256"]
    assert m["eos_id"] == read_manifest(tmp_path / "a.h5")["eos_id"]
    ensure_dataset(_mixture(tmp_path, "a.h5", "b2.h5"), vocab_size=384, sample_len=17)


@pytest.mark.parametrize("kind", ["missing", "garbage", "hdf5_without_tokenizer", "directory"])
def test_an_unusable_data_tokenizer_is_refused_before_the_inputs_are_read(tmp_path, monkeypatch, kind: str) -> None:
    files, _ = write_corpus(tmp_path, docs=30)
    spec = tmp_path / "tok"
    if kind == "garbage":
        spec.write_text("{not json")
    elif kind == "hdf5_without_tokenizer":
        with h5py.File(spec, "w") as f:
            f["tokens"] = np.zeros(4, np.int32)
    elif kind == "directory":
        spec.mkdir()

    def read_input(*_a, **_k):
        raise AssertionError("an input was read before data.tokenizer was checked")

    monkeypatch.setattr(prepare, "file_digest", read_input)
    monkeypatch.setattr(prepare, "pieces", read_input)
    with pytest.raises(
        ValueError,
        match=f"^data.tokenizer={spec} (is not a file|cannot be read as a tokenizer"
        "|is an HDF5 file without a tokenizer_json)",
    ):
        _prepare(files, tmp_path / "out.h5", tokenizer=str(spec))
    assert not (tmp_path / "out.h5").exists()


def _lines(n: int) -> list[str]:
    return [f"line {i} of a log with no blank line, word{i % 97} and more words" for i in range(n)]


def test_a_text_file_without_blank_lines_is_read_in_bounded_pieces_or_one_document_per_line(tmp_path) -> None:
    lines = _lines(4000)  # 260 kB of text, no blank line: one paragraph
    (tmp_path / "log.txt").write_text("\n".join(lines) + "\n")
    got = list(pieces(tmp_path / "log.txt"))
    assert len(got) >= 4 and max(len(t) for t, _ in got) <= corpus.PIECE_CHARS  # never the whole file at once
    assert [e for _, e in got] == [False] * (len(got) - 1) + [True]  # the pieces make up one document
    assert "".join(t for t, _ in got) == "\n".join(lines)
    assert all(t[0] in " \n" for t, _ in got[1:])  # cut before a whitespace: words stay whole
    per_line = list(pieces(tmp_path / "log.txt", doc_per="line"))
    assert [t for t, _ in per_line] == lines and all(e for _, e in per_line)
    small = tmp_path / "small.txt"
    small.write_text("a b\nc\n\n\nd\n\n")
    assert list(pieces(small, doc_per="file")) == [("a b\nc\n\n\nd", True)]
    assert list(pieces(small, doc_per="paragraph")) == [("a b\nc", True), ("d", True)]


def test_doc_per_line_makes_a_document_of_each_line_and_a_bad_value_names_the_choices(tmp_path) -> None:
    lines = _lines(300)
    (tmp_path / "log.txt").write_text("\n".join(lines) + "\n")
    m = _prepare([tmp_path / "log.txt"], tmp_path / "line.h5", doc_per="line")
    assert m["documents"] + m["heldout_documents"] == 300
    assert sorted(_documents(tmp_path / "line.h5", "tokens") + _documents(tmp_path / "line.h5", "heldout")) == sorted(
        lines
    )
    m = _prepare([tmp_path / "log.txt"], tmp_path / "para.h5", tokenizer=str(tmp_path / "line.h5"))
    assert m["documents"] + m["heldout_documents"] == 1  # the default: one paragraph
    with pytest.raises(ValueError, match="data.doc_per=page is not one of line, paragraph, file"):
        _prepare([tmp_path / "log.txt"], tmp_path / "x.h5", doc_per="page")


def test_a_long_documents_pieces_stay_on_one_side_of_the_heldout_split(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(corpus, "PIECE_CHARS", 64)  # every document below is 3-12 pieces long
    docs = [" ".join(f"w{(i * 7 + j) % 50}" for j in range(60 + 20 * (i % 5))) for i in range(80)]
    (tmp_path / "docs.txt").write_text("\n\n".join(docs) + "\n")
    m = _prepare([tmp_path / "docs.txt"], tmp_path / "out.h5")
    train, held = _documents(tmp_path / "out.h5", "tokens"), _documents(tmp_path / "out.h5", "heldout")
    assert m["documents"] == len(train) and m["heldout_documents"] == len(held) and len(held) >= 5
    assert sorted(train + held) == sorted(docs)  # whole documents on each side, no piece astray


def test_token_ids_are_stored_as_uint16_and_an_older_int32_file_still_reads_and_appends(tmp_path) -> None:
    assert (prepare._token_dtype(65536), prepare._token_dtype(65537)) == (np.uint16, np.uint32)
    files, _ = write_corpus(tmp_path, docs=200)
    said: list[str] = []
    cfg = DataConfig(name="tokenized", path=str(tmp_path / "new.h5"), inputs=[str(files[0])], heldout_fraction=0.2)
    prepare_data(cfg, vocab_size=384, progress=said.append)
    assert any("tokens/s" in s for s in said), said
    with h5py.File(tmp_path / "new.h5", "a") as f:
        assert f["tokens"].dtype == np.uint16 and f["heldout"].dtype == np.uint16
        want = f["tokens"][:]
        for name in ("tokens", "heldout"):  # as prepare_data wrote them before: int32
            data = f[name][:].astype(np.int32)
            del f[name]
            f.create_dataset(name, data=data, maxshape=(None,), chunks=(1 << 16,))
    src = BatchSource(tmp_path / "new.h5", seed=0, global_batch=4, seq_len=15, dp_rank=0, dp=1)
    x, _ = src.batch(0)
    assert x.dtype == np.int64 or str(x.dtype) == "torch.int64"
    assert all(any(np.array_equal(r, want[i : i + 15]) for i in range(0, len(want) - 15, 16)) for r in x.numpy())
    _prepare(files, tmp_path / "new.h5")  # an append keeps the file's int32 streams
    with h5py.File(tmp_path / "new.h5") as f:
        assert f["tokens"].dtype == np.int32 and np.array_equal(f["tokens"][: len(want)], want)
