"""`python -m jobs.prepare_data`'s work: a corpus -> the tokenized HDF5 token file the trainer reads.

The file holds `tokens` (training documents) and `heldout` (documents kept out by the hash of their
text, `data.heldout_fraction` of them), each a 1-D stream of documents each ended by EOS; the tokenizer
(`tokenizer_json`) and a JSON manifest (`manifest`: source files with size and sha256, vocabulary,
counts) as byte datasets; `format`, `kind`, `vocab_size`, `eos_id`, `heldout_fraction` as attributes.
Streaming: documents are read one line at a time and tokenized in batches appended to resizable
datasets. Deterministic: the same inputs give the same bytes (no timestamps in the file). Re-running
with more inputs appends them (a file already in the manifest, by sha256, is skipped). Every write goes
to a temporary copy renamed at the end: a malformed input (InputError) leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import numpy as np

from jobs.config import DataConfig
from jobs.data.corpus import documents, file_digest
from jobs.data.files import FORMAT_VERSION

__all__ = ["prepare_data", "read_manifest", "read_tokenizer", "EOS_TOKENS"]

EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")  # a given tokenizer's EOS: the first it has
_BATCH_DOCS = 512  # documents tokenized per encode_batch call
_FLUSH_TOKENS = 1 << 20  # tokens buffered before an append to the file
_CHUNK = 1 << 16  # HDF5 chunk of the token streams


def prepare_data(cfg: DataConfig, *, vocab_size: int, progress: Callable[[str], None] | None = None) -> dict:
    """Tokenizes cfg.inputs into cfg.path (appending to an existing file); returns the manifest.
    ValueError (InputError for a malformed file) before anything is written."""
    say = progress or (lambda msg: print(f"prepare_data: {msg}", file=sys.stderr, flush=True))
    out = Path(cfg.path)
    inputs = _check_inputs(cfg)
    old = read_manifest(out) if out.exists() else None
    if old is not None and old["heldout_fraction"] != cfg.heldout_fraction:
        raise ValueError(f"{out} was split with data.heldout_fraction={old['heldout_fraction']}; append with the same")
    new = _new_files(inputs, old, say)
    if not new:
        say(f"nothing to add: every input is already in {out}")
        return old
    for path, _ in new:  # the whole check first: a malformed file stops the run before anything is written
        for _ in documents(path):
            pass
    tok = _tokenizer(cfg, out=out, old=old, new=[p for p, _ in new], vocab_size=vocab_size, say=say)
    origin = old["tokenizer"] if old else (cfg.tokenizer or f"byte-level BPE trained on the inputs (model.vocab_size={vocab_size})")
    return _write(out, tok, new=new, old=old, heldout_fraction=cfg.heldout_fraction, origin=origin, say=say)


def _check_inputs(cfg: DataConfig) -> list[Path]:
    if not cfg.inputs:
        raise ValueError("data.inputs is empty: name the corpus files, e.g. data.inputs=[a.txt,b.jsonl]")
    paths = [Path(p) for p in cfg.inputs]
    for p in paths:
        if not p.is_file():
            raise ValueError(f"data.inputs: {p} is not a file")
    if not 0.0 < cfg.heldout_fraction < 1.0:
        raise ValueError(f"data.heldout_fraction({cfg.heldout_fraction}) must be in (0, 1)")
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


def _all_documents(paths: list[Path]) -> Iterator[str]:
    for p in paths:
        yield from documents(p)


def _tokenizer(cfg: DataConfig, *, out: Path, old: dict | None, new: list[Path], vocab_size: int,
               say: Callable[[str], None]):
    """The file's own tokenizer when appending, else data.tokenizer, else a byte-level BPE trained on the inputs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if old is not None:
        if cfg.tokenizer and Tokenizer.from_file(cfg.tokenizer).to_str() != read_tokenizer(out).to_str():
            raise ValueError(f"data.tokenizer={cfg.tokenizer} is not the tokenizer {out} was made with; "
                             "append without data.tokenizer, or write a new data.path")
        return read_tokenizer(out)
    if cfg.tokenizer:
        return Tokenizer.from_file(cfg.tokenizer)
    if vocab_size < 257:
        raise ValueError(f"model.vocab_size({vocab_size}) leaves no room for a byte-level BPE (256 byte tokens + EOS): "
                         "set model.vocab_size=512 (or more), or give data.tokenizer=tokenizer.json")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKENS[0]], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    say(f"training a byte-level BPE of model.vocab_size={vocab_size} tokens on {len(new)} file(s)")
    tok.train_from_iterator(_all_documents(new), trainer)
    return tok


def _eos_id(tok, *, given: str | None) -> int:
    for t in EOS_TOKENS:
        if (i := tok.token_to_id(t)) is not None:
            return i
    raise ValueError(f"data.tokenizer={given} has none of the end-of-document tokens {', '.join(EOS_TOKENS)}")


def _is_heldout(doc: str, fraction: float) -> bool:
    """Held out by the document's text hash: stable across runs, appends and file order."""
    return int.from_bytes(hashlib.sha256(doc.encode()).digest()[:8], "big") < fraction * 2**64


def _write(out: Path, tok, *, new: list[tuple[Path, dict]], old: dict | None, heldout_fraction: float, origin: str,
           say: Callable[[str], None]) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    if old is not None:
        shutil.copyfile(out, tmp)  # an append works on a copy: the original stays whole until the rename
    try:
        with h5py.File(tmp, "a" if old is not None else "w") as f:
            eos = int(f.attrs["eos_id"]) if old is not None else _eos_id(tok, given=origin)
            streams = {name: f.get(name) or f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=np.int32,
                                                             chunks=(_CHUNK,), track_times=False)
                       for name in ("tokens", "heldout")}
            files = (old["files"] if old else []) + [
                {**meta, **_append_file(path, tok, streams, eos=eos, fraction=heldout_fraction, say=say)}
                for path, meta in new]
            manifest = _manifest(files, tok, eos=eos, heldout_fraction=heldout_fraction, origin=origin)
            _put_bytes(f, "manifest", json.dumps(manifest, indent=1, sort_keys=True).encode())
            _put_bytes(f, "tokenizer_json", tok.to_str().encode())
            for k in ("format", "kind", "vocab_size", "eos_id", "heldout_fraction"):
                f.attrs[k] = manifest[k]
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    say(f"wrote {out}: {manifest['documents']} documents, {manifest['tokens']} training and "
        f"{manifest['heldout_tokens']} held-out tokens, vocabulary {manifest['vocab_size']}")
    return manifest


def _append_file(path: Path, tok, streams: dict, *, eos: int, fraction: float, say: Callable[[str], None]) -> dict:
    """Tokenizes one file into the two streams; returns its counts."""
    bufs: dict[str, list[np.ndarray]] = {"tokens": [], "heldout": []}
    counts = {"documents": 0, "heldout_documents": 0, "tokens": 0, "heldout_tokens": 0}
    batch: list[str] = []

    def encode() -> None:
        for doc, enc in zip(batch, tok.encode_batch(batch, add_special_tokens=False)):
            held = _is_heldout(doc, fraction)
            ids = np.asarray(enc.ids + [eos], dtype=np.int32)
            bufs["heldout" if held else "tokens"].append(ids)
            counts["heldout_documents" if held else "documents"] += 1
            counts["heldout_tokens" if held else "tokens"] += len(ids)
        batch.clear()
        if sum(len(b) for bs in bufs.values() for b in bs) >= _FLUSH_TOKENS:
            _flush(streams, bufs)
            say(f"{path}: {counts['documents'] + counts['heldout_documents']} documents, "
                f"{counts['tokens'] + counts['heldout_tokens']} tokens")

    for doc in documents(path):
        batch.append(doc)
        if len(batch) == _BATCH_DOCS:
            encode()
    encode()
    _flush(streams, bufs)
    say(f"{path}: {counts['documents']} + {counts['heldout_documents']} held-out documents, "
        f"{counts['tokens'] + counts['heldout_tokens']} tokens")
    return counts


def _flush(streams: dict, bufs: dict[str, list[np.ndarray]]) -> None:
    for name, parts in bufs.items():
        if parts:
            ds, data = streams[name], np.concatenate(parts)
            n = ds.shape[0]
            ds.resize((n + len(data),))
            ds[n:] = data
            parts.clear()


def _manifest(files: list[dict], tok, *, eos: int, heldout_fraction: float, origin: str) -> dict:
    total = {k: sum(f[k] for f in files) for k in ("documents", "heldout_documents", "tokens", "heldout_tokens")}
    return {"format": FORMAT_VERSION, "kind": "tokenized", "vocab_size": tok.get_vocab_size(with_added_tokens=True),
            "tokenizer": origin, "eos_id": eos, "eos_token": tok.id_to_token(eos), "heldout_fraction": heldout_fraction, "files": files,
            **total}


def _put_bytes(f: h5py.File, name: str, data: bytes) -> None:
    if name in f:
        del f[name]
    f.create_dataset(name, data=np.frombuffer(data, dtype=np.uint8), track_times=False)


def read_manifest(path: Path) -> dict:
    """The manifest inside a tokenized file."""
    with h5py.File(path, "r") as f:
        if "manifest" not in f:
            raise ValueError(f"data.path={path} exists and is not a tokenized file; choose a new data.path")
        return json.loads(f["manifest"][:].tobytes())


def read_tokenizer(path: Path):
    """The `tokenizers.Tokenizer` stored inside a tokenized file."""
    from tokenizers import Tokenizer

    with h5py.File(path, "r") as f:
        return Tokenizer.from_str(f["tokenizer_json"][:].tobytes().decode())
