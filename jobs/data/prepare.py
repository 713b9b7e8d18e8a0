"""`python -m jobs.prepare_data`'s work: a corpus -> the tokenized HDF5 token file the trainer reads.

The file holds `tokens` (training documents) and `heldout` (documents kept out by the hash of their
text, `data.heldout_fraction` of them), each a 1-D stream of documents each ended by EOS, as uint16 when
the vocabulary fits (else uint32; older files hold int32 and are read as they are); the tokenizer
(`tokenizer_json`) and a JSON manifest (`manifest`: source files with size and sha256, vocabulary,
tokenizer hash, counts) as byte datasets; `format`, `kind`, `vocab_size`, `eos_id`, `heldout_fraction`
as attributes. Streaming with bounded memory: documents (`data.doc_per` for plain text) are read in
pieces of at most `corpus.PIECE_CHARS` characters and tokenized in batches of bounded size appended to
resizable datasets; a long document's pieces follow each other in one split, EOS after the last. Deterministic: the same inputs give the same bytes (no timestamps in the file). Re-running
with more inputs appends them (a file already in the manifest, by sha256, is skipped) in place: the streams
grow, nothing is rewritten, and the manifest, replaced last, is the commit (`_extend`). A new file is written
to a temporary name renamed at the end; a malformed input (InputError) is found before anything is written.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import h5py
import numpy as np

from jobs.config import DataConfig
from jobs.data.corpus import DOC_PER, file_digest, pieces
from jobs.data.files import FORMAT_VERSION, tokenizer_sha256
from jobs.data.h5 import open_read
from jobs.extras import require

__all__ = ["prepare_data", "read_manifest", "read_tokenizer", "load_tokenizer", "EOS_TOKENS"]

EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")  # a given tokenizer's EOS: the first it has
_BATCH_DOCS = 512  # pieces tokenized per encode_batch call, at most
_BATCH_CHARS = 1 << 20  # characters tokenized per encode_batch call, at most (plus one piece)
_FLUSH_TOKENS = 1 << 20  # tokens buffered before an append to the file
_CHUNK = 1 << 16  # HDF5 chunk of the token streams
_MANIFEST_CHUNK = 1 << 12  # HDF5 chunk of the manifest (bytes)
_AHEAD = 2  # batches read and queued for encoding ahead of the one being stored (overlap)
_STREAMS = ("tokens", "heldout")  # the token streams: training documents, held-out documents


def prepare_data(
    cfg: DataConfig, *, vocab_size: int, progress: Callable[[str], None] | None = None, overlap: bool = True
) -> dict:
    """Tokenizes cfg.inputs into cfg.path (appending to an existing file); returns the manifest.
    ValueError (InputError for a malformed file) before anything is written. `overlap=False`: reading and
    encoding take turns in one thread (the serial baseline of scripts/bench/prepare_parallel.py; same bytes)."""
    say = progress or (lambda msg: print(f"prepare_data: {msg}", file=sys.stderr, flush=True))
    out = Path(cfg.path)
    inputs = _check_inputs(cfg)
    given = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None  # before any input is read
    old = read_manifest(out) if out.exists() else None
    if old is not None and old["heldout_fraction"] != cfg.heldout_fraction:
        raise ValueError(f"{out} was split with data.heldout_fraction={old['heldout_fraction']}; append with the same")
    new = _new_files(inputs, old, say)
    if not new:
        say(f"nothing to add: every input is already in {out}")
        return old
    for path, _ in new:  # the whole check first: a malformed file stops the run before anything is written
        for _ in pieces(path, doc_per=cfg.doc_per):
            pass
    tok = _tokenizer(cfg, given=given, out=out, old=old, new=[p for p, _ in new], vocab_size=vocab_size, say=say)
    origin = (
        old["tokenizer"]
        if old
        else (cfg.tokenizer or f"byte-level BPE trained on the inputs (model.vocab_size={vocab_size})")
    )
    return _write(
        out,
        tok,
        new=new,
        old=old,
        heldout_fraction=cfg.heldout_fraction,
        doc_per=cfg.doc_per,
        origin=origin,
        overlap=overlap,
        say=say,
    )


def _check_inputs(cfg: DataConfig) -> list[Path]:
    if not cfg.inputs:
        raise ValueError("data.inputs is empty: name the corpus files, e.g. data.inputs=[a.txt,b.jsonl]")
    paths = [Path(p) for p in cfg.inputs]
    for p in paths:
        if not p.is_file():
            raise ValueError(f"data.inputs: {p} is not a file")
    if not 0.0 < cfg.heldout_fraction < 1.0:
        raise ValueError(f"data.heldout_fraction({cfg.heldout_fraction}) must be in (0, 1)")
    if cfg.doc_per not in DOC_PER:
        raise ValueError(
            f"data.doc_per={cfg.doc_per} is not one of {', '.join(DOC_PER)} (what one document of a "
            "plain text file is; JSON lines are always one document per line)"
        )
    return paths


def _new_files(inputs: list[Path], old: dict | None, say: Callable[[str], None]) -> list[tuple[Path, dict]]:
    """The inputs not yet in the file (by sha256, also within this call), with their size and hash."""
    seen = {f["sha256"] for f in old["files"]} if old else set()
    new = []
    for p in inputs:
        size, sha = file_digest(p)
        if sha in seen:
            say(f"{p}: skipped, already present (sha256 {sha[:12]})")
            continue
        seen.add(sha)
        new.append((p, {"path": str(p), "size": size, "sha256": sha}))
    return new


def sample_texts(paths: list[Path], doc_per: str, *, limit_bytes: int) -> Iterator[str]:
    """The pieces of the inputs a BPE is trained on: all of them up to `limit_bytes` in all, else an even spread
    of them (a piece is kept while the characters kept stay below limit / total x those read), so that the
    trainer's word counts, which grow with the distinct words it sees, stay bounded whatever the corpus size."""
    total = sum(p.stat().st_size for p in paths)
    share = min(1.0, limit_bytes / total) if total else 1.0
    seen = kept = 0
    for p in paths:
        for text, _ in pieces(p, doc_per=doc_per):
            seen += len(text)
            if kept + len(text) <= share * seen:
                kept += len(text)
                yield text


def load_tokenizer(spec: str):
    """data.tokenizer: a tokenizer.json, or a file made by prepare_data whose tokenizer is reused (one tokenizer
    for a mixture); ValueError naming the override when it is missing, unreadable or has no EOS token."""
    require("tokenizers", needed_by="jobs.prepare_data")  # names the extra when it is missing
    from tokenizers import Tokenizer

    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"data.tokenizer={spec} is not a file: give a tokenizer.json, a token file made by "
            "python -m jobs.prepare_data (its tokenizer is reused), or no data.tokenizer (a BPE is "
            "trained on the inputs)"
        )
    try:
        if h5py.is_hdf5(path):
            with open_read(path) as f:
                if "tokenizer_json" not in f:
                    raise ValueError(
                        f"data.tokenizer={spec} is an HDF5 file without a tokenizer_json dataset, "
                        "not a token file made by python -m jobs.prepare_data"
                    )
                tok = Tokenizer.from_str(f["tokenizer_json"][:].tobytes().decode())
        else:
            tok = Tokenizer.from_file(str(path))
    except ValueError:
        raise
    except Exception as e:  # tokenizers raises a bare Exception; OSError for a file that cannot be opened
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"data.tokenizer={spec} cannot be read as a tokenizer ({why}); give the tokenizer.json "
            "of the `tokenizers` library or a token file made by python -m jobs.prepare_data"
        ) from None
    _eos_id(tok, given=spec)
    return tok


def _tokenizer(
    cfg: DataConfig, *, given, out: Path, old: dict | None, new: list[Path], vocab_size: int, say: Callable[[str], None]
):
    """The file's own tokenizer when appending, else data.tokenizer, else a byte-level BPE trained on the inputs."""
    require("tokenizers", needed_by="jobs.prepare_data")  # names the extra when it is missing
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if old is not None:
        mine = read_tokenizer(out)
        if given is not None and tokenizer_sha256(given.to_str()) != tokenizer_sha256(mine.to_str()):
            raise ValueError(
                f"data.tokenizer={cfg.tokenizer} is not the tokenizer {out} was made with; "
                "append without data.tokenizer, or write a new data.path"
            )
        return mine
    if given is not None:
        return given
    if vocab_size < 257:
        raise ValueError(
            f"model.vocab_size({vocab_size}) leaves no room for a byte-level BPE (256 byte tokens + EOS): "
            "set model.vocab_size=512 (or more), or give data.tokenizer=tokenizer.json"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKENS[0]],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    if cfg.tokenizer_sample_mb <= 0:
        raise ValueError(f"data.tokenizer_sample_mb({cfg.tokenizer_sample_mb}) must be > 0; e.g. 32")
    say(
        f"training a byte-level BPE of model.vocab_size={vocab_size} tokens on {len(new)} file(s) "
        f"(at most data.tokenizer_sample_mb={cfg.tokenizer_sample_mb:g} MB of them)"
    )
    limit = int(cfg.tokenizer_sample_mb * 1e6)
    tok.train_from_iterator(sample_texts(new, cfg.doc_per, limit_bytes=limit), trainer)
    return tok


def _eos_id(tok, *, given: str | None) -> int:
    for t in EOS_TOKENS:
        if (i := tok.token_to_id(t)) is not None:
            return i
    raise ValueError(f"data.tokenizer={given} has none of the end-of-document tokens {', '.join(EOS_TOKENS)}")


def _is_heldout(doc: str, fraction: float) -> bool:
    """Held out by the document's text hash: stable across runs, appends and file order."""
    return int.from_bytes(hashlib.sha256(doc.encode()).digest()[:8], "big") < fraction * 2**64


def _token_dtype(vocab: int) -> type:
    """The narrowest unsigned type that holds every id of a `vocab`-token vocabulary."""
    return np.uint16 if vocab <= 1 << 16 else np.uint32


def _write(
    out: Path,
    tok,
    *,
    new: list[tuple[Path, dict]],
    old: dict | None,
    heldout_fraction: float,
    doc_per: str,
    origin: str,
    overlap: bool,
    say: Callable[[str], None],
) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    kw = dict(
        new=new, old=old, heldout_fraction=heldout_fraction, doc_per=doc_per, origin=origin, overlap=overlap, say=say
    )
    manifest = _append(out, tok, **kw) if old is not None else _create(out, tok, **kw)
    added = sum(c["tokens"] + c["heldout_tokens"] for c in manifest["files"][len(old["files"]) if old else 0 :])
    secs = time.perf_counter() - t0
    say(
        f"wrote {out}: {manifest['documents']} documents, {manifest['tokens']} training and "
        f"{manifest['heldout_tokens']} held-out tokens, vocabulary {manifest['vocab_size']}; "
        f"{added} tokens added in {secs:.1f} s ({added / max(secs, 1e-9):,.0f} tokens/s, tokenizing and writing; "
        f"{_cores()} core(s) to encode{', overlapped with reading' if overlap else ''})"
    )
    return manifest


def _cores() -> int:
    """The cores this process may use (Slurm's, taskset's), which the `tokenizers` batch encode spreads over."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _create(
    out: Path,
    tok,
    *,
    new: list[tuple[Path, dict]],
    old: None,
    heldout_fraction: float,
    doc_per: str,
    origin: str,
    overlap: bool,
    say: Callable[[str], None],
) -> dict:
    """A new file, written to a temporary name renamed at the end: an error leaves nothing behind."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            eos = _eos_id(tok, given=origin)
            dtype = _token_dtype(tok.get_vocab_size(with_added_tokens=True))
            streams = {
                name: f.create_dataset(
                    name, shape=(0,), maxshape=(None,), dtype=dtype, chunks=(_CHUNK,), track_times=False
                )
                for name in _STREAMS
            }
            files = [
                {
                    **meta,
                    **_append_file(
                        path,
                        tok,
                        streams,
                        eos=eos,
                        fraction=heldout_fraction,
                        doc_per=doc_per,
                        overlap=overlap,
                        say=say,
                    ),
                }
                for path, meta in new
            ]
            manifest = _manifest(files, tok, eos=eos, heldout_fraction=heldout_fraction, origin=origin)
            _put_manifest(f, manifest)
            _put_bytes(f, "tokenizer_json", tok.to_str().encode())
            for k in ("format", "kind", "vocab_size", "eos_id", "heldout_fraction"):
                f.attrs[k] = manifest[k]
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return manifest


def _append(
    out: Path,
    tok,
    *,
    new: list[tuple[Path, dict]],
    old: dict,
    heldout_fraction: float,
    doc_per: str,
    origin: str,
    overlap: bool,
    say: Callable[[str], None],
) -> dict:
    """Appends in place (the streams grow, nothing is rewritten), unless the file cannot grow where it is: its
    streams have a fixed size (made before appends were in place), or another process holds it open (HDF5's file
    lock: a run reading it keeps reading the file it opened; or this process has it open to read). Then to a
    resizable copy renamed over it."""
    kw = dict(
        new=new, old=old, heldout_fraction=heldout_fraction, doc_per=doc_per, origin=origin, overlap=overlap, say=say
    )
    try:
        f = h5py.File(out, "a")
    except OSError as e:  # BlockingIOError: another process has it open; or this one has, read-only
        why = (
            f"it cannot be opened for writing ({str(e).split('(')[-1].rstrip(')')}: a run reading it keeps the "
            "file it opened)"
        )
    else:
        with f:
            fixed = [name for name in _STREAMS if f[name].maxshape != (None,)]
            if not fixed:
                return _extend(f, tok, **kw)
        why = f"its {' and '.join(fixed)} stream(s) have a fixed size (made before appends extended a file in place)"
    say(
        f"{out}: {why}: appending to a resizable copy renamed over it, a one-time rewrite of "
        f"{out.stat().st_size / 1e6:.1f} MB (later appends extend the file in place)"
    )
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        _copy_resizable(out, tmp)
        with h5py.File(tmp, "a") as f:
            manifest = _extend(f, tok, **kw)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return manifest


def _extend(
    f: h5py.File,
    tok,
    *,
    new: list[tuple[Path, dict]],
    old: dict,
    heldout_fraction: float,
    doc_per: str,
    origin: str,
    overlap: bool,
    say: Callable[[str], None],
) -> dict:
    """The append proper, in this order: the streams grow and their data reach the disk, then the manifest is
    replaced (the commit). An error on the way cuts the streams back and puts the old manifest back; a process
    killed before the commit leaves streams longer than the manifest says, which the next append cuts back (and
    which a run refuses until then: jobs/data/files.py). A manifest never counts tokens that are not there."""
    committed = _cut_to_manifest(f, old, say)
    before = f["manifest"][:]
    try:
        streams = {name: f[name] for name in _STREAMS}
        files = old["files"] + [
            {
                **meta,
                **_append_file(
                    path,
                    tok,
                    streams,
                    eos=int(old["eos_id"]),
                    fraction=heldout_fraction,
                    doc_per=doc_per,
                    overlap=overlap,
                    say=say,
                ),
            }
            for path, meta in new
        ]
        _sync(f)  # the data first
        manifest = _manifest(files, tok, eos=int(old["eos_id"]), heldout_fraction=heldout_fraction, origin=origin)
        _put_manifest(f, manifest)
        _sync(f)
    except BaseException:
        for name, n in committed.items():
            f[name].resize((n,))
        if not np.array_equal(f["manifest"][:], before):
            _put_bytes(f, "manifest", before.tobytes(), resizable=True)
        raise
    return manifest


def _cut_to_manifest(f: h5py.File, old: dict, say: Callable[[str], None]) -> dict[str, int]:
    """Each stream's committed length (its manifest's count); tokens past it (an append killed before its commit)
    are cut off. ValueError when a stream is shorter than its manifest says (the file is damaged)."""
    want = {"tokens": int(old["tokens"]), "heldout": int(old["heldout_tokens"])}
    for name, n in want.items():
        have = f[name].shape[0]
        if have < n:
            raise ValueError(
                f"{f.filename}: its {name} stream holds {have} tokens, fewer than the {n} its manifest "
                "counts: the file is damaged; prepare the corpus again into a new data.path"
            )
        if have > n:
            say(
                f"{f.filename}: {have - n} {name} tokens past its manifest (an append stopped before its commit): "
                "cut off"
            )
            f[name].resize((n,))
    return want


def _sync(f: h5py.File) -> None:
    """HDF5's buffers to the OS, then to the disk."""
    f.flush()
    os.fsync(f.id.get_vfd_handle())


def _copy_resizable(src: Path, dst: Path) -> None:
    """A copy of a token file whose streams are resizable (in blocks: bounded memory); the rest copied as it is."""
    with open_read(src) as a, h5py.File(dst, "w") as b:
        b.attrs.update(a.attrs)
        for name in a:
            if name not in _STREAMS:
                a.copy(a[name], b, name=name)
                continue
            ds = a[name]
            out = b.create_dataset(
                name, shape=ds.shape, maxshape=(None,), dtype=ds.dtype, chunks=(_CHUNK,), track_times=False
            )
            for i in range(0, ds.shape[0], _FLUSH_TOKENS):
                out[i : i + _FLUSH_TOKENS] = ds[i : i + _FLUSH_TOKENS]


_COUNT = {False: ("tokens", "documents"), True: ("heldout_tokens", "heldout_documents")}  # held out -> counters


def _append_file(
    path: Path,
    tok,
    streams: dict,
    *,
    eos: int,
    fraction: float,
    doc_per: str,
    overlap: bool,
    say: Callable[[str], None],
) -> dict:
    """Tokenizes one file's pieces into the two streams (a document's split is chosen by its first piece, so a
    long document's pieces never straddle it); returns its counts."""
    bufs: dict[str, list[np.ndarray]] = {"tokens": [], "heldout": []}
    counts = {"documents": 0, "heldout_documents": 0, "tokens": 0, "heldout_tokens": 0}
    starts, held = True, False
    with closing(_encoded(tok, _batches(path, doc_per), overlap=overlap)) as encoded:  # an error stops the thread
        for batch, encodings in encoded:
            for (text, ends), enc in zip(batch, encodings):
                if starts:
                    held = _is_heldout(text, fraction)
                name = "heldout" if held else "tokens"
                ids = np.asarray(enc.ids + [eos] if ends else enc.ids, dtype=streams[name].dtype)
                bufs[name].append(ids)
                tokens, documents = _COUNT[held]
                counts[tokens] += len(ids)
                counts[documents] += ends
                starts = ends
            if sum(len(b) for bs in bufs.values() for b in bs) >= _FLUSH_TOKENS:
                _flush(streams, bufs)
                say(
                    f"{path}: {counts['documents'] + counts['heldout_documents']} documents, "
                    f"{counts['tokens'] + counts['heldout_tokens']} tokens"
                )
    _flush(streams, bufs)
    say(
        f"{path}: {counts['documents']} + {counts['heldout_documents']} held-out documents, "
        f"{counts['tokens'] + counts['heldout_tokens']} tokens"
    )
    return counts


def _batches(path: Path, doc_per: str) -> Iterator[list[tuple[str, bool]]]:
    """One file's pieces in batches of at most _BATCH_DOCS pieces and about _BATCH_CHARS characters."""
    batch, chars = [], 0
    for piece in pieces(path, doc_per=doc_per):
        batch.append(piece)
        chars += len(piece[0])
        if len(batch) == _BATCH_DOCS or chars >= _BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _encoded(tok, batches: Iterator[list[tuple[str, bool]]], *, overlap: bool) -> Iterator[tuple[list, list]]:
    """(batch, its encodings), in the order of `batches`. `overlap`: the encoding runs in a thread (the `tokenizers`
    batch encode releases the GIL and uses every core the process may use) while this one reads the next batches
    and the caller stores the previous ones; at most _AHEAD batches in flight (bounded memory). The same output
    either way: the same batches, encoded alike, taken in order."""

    def encode(batch: list[tuple[str, bool]]) -> tuple[list, list]:
        return batch, tok.encode_batch_fast([text for text, _ in batch], add_special_tokens=False)

    if not overlap:
        yield from map(encode, batches)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="encode") as pool:
        ahead: deque[Future] = deque()
        try:
            for batch in batches:
                ahead.append(pool.submit(encode, batch))
                if len(ahead) > _AHEAD:
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()
        finally:  # an error (a malformed line, a failed write): what is queued is not encoded for nothing
            for future in ahead:
                future.cancel()


def _flush(streams: dict, bufs: dict[str, list[np.ndarray]]) -> None:
    for name, parts in bufs.items():
        if parts:
            ds = streams[name]
            data = np.concatenate(parts)
            n = ds.shape[0]
            ds.resize((n + len(data),))
            ds[n:] = data
            parts.clear()


def _manifest(files: list[dict], tok, *, eos: int, heldout_fraction: float, origin: str) -> dict:
    total = {k: sum(f[k] for f in files) for k in ("documents", "heldout_documents", "tokens", "heldout_tokens")}
    return {
        "format": FORMAT_VERSION,
        "kind": "tokenized",
        "vocab_size": tok.get_vocab_size(with_added_tokens=True),
        "tokenizer": origin,
        "tokenizer_sha256": tokenizer_sha256(tok.to_str()),
        "eos_id": eos,
        "eos_token": tok.id_to_token(eos),
        "heldout_fraction": heldout_fraction,
        "files": files,
        **total,
    }


def _put_manifest(f: h5py.File, manifest: dict) -> None:
    _put_bytes(f, "manifest", json.dumps(manifest, indent=1, sort_keys=True).encode(), resizable=True)


def _put_bytes(f: h5py.File, name: str, data: bytes, *, resizable: bool = False) -> None:
    """A byte dataset; `resizable` (the manifest, rewritten at every append) is overwritten where it is."""
    arr = np.frombuffer(data, dtype=np.uint8)
    if resizable and name in f and f[name].maxshape == (None,):
        f[name].resize((len(arr),))
        f[name][:] = arr
        return
    if name in f:
        del f[name]
    if resizable:
        f.create_dataset(name, data=arr, maxshape=(None,), chunks=(_MANIFEST_CHUNK,), track_times=False)
    else:
        f.create_dataset(name, data=arr, track_times=False)


def read_manifest(path: Path) -> dict:
    """The manifest inside a tokenized file."""
    with open_read(path) as f:
        if "manifest" not in f:
            raise ValueError(f"data.path={path} exists and is not a tokenized file; choose a new data.path")
        return json.loads(f["manifest"][:].tobytes())


def read_tokenizer(path: Path):
    """The `tokenizers.Tokenizer` stored inside a tokenized file."""
    require("tokenizers", needed_by="jobs.prepare_data")  # names the extra when it is missing
    from tokenizers import Tokenizer

    with open_read(path) as f:
        return Tokenizer.from_str(f["tokenizer_json"][:].tobytes().decode())
