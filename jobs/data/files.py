"""The token files a run reads, checked (or, for the synthetic default, generated) once before any rank starts."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from jobs.config import DataConfig
from jobs.data.h5 import open_read
from jobs.data.synthetic import heldout_rows, write_synthetic

__all__ = ["FORMAT_VERSION", "ensure_dataset", "sources_of", "padded_vocab", "tokenizer_sha256", "NAMES"]

# 2: a `heldout` split beside `tokens` (held-out evaluation), and the `kind` attribute (synthetic | tokenized).
FORMAT_VERSION = 2
NAMES = ("synthetic", "tokenized")  # data.name


def padded_vocab(vocab: int, multiple: int = 64) -> int:
    """The model.vocab_size to suggest for a file's vocabulary: rounded up to a multiple of 64."""
    return -(-vocab // multiple) * multiple


def tokenizer_sha256(tokenizer_json: str) -> str:
    """The identity of a tokenizer: sha256 of its JSON with sorted keys and no spaces (formatting does not count)."""
    canon = json.dumps(json.loads(tokenizer_json), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode()).hexdigest()


def sources_of(cfg: DataConfig) -> list[tuple[str, float]]:
    """(path, weight) of every file the run samples from: data.sources, else data.path alone."""
    return [(s.path, s.weight) for s in cfg.sources] if cfg.sources else [(cfg.path, 1.0)]


def ensure_dataset(cfg: DataConfig, *, vocab_size: int, sample_len: int, eval_sample_len: int = 0) -> Path:
    """Checks the run's token files against the model (ValueError naming the override), generating the
    synthetic one first if it is missing. `eval_sample_len` > 0 (train.eval_every on): every tokenized
    file's held-out split must hold one sample of that many tokens. Call it from one process before
    ranks start (the entry point does)."""
    if cfg.name not in NAMES:
        raise ValueError(f"data={cfg.name!r} is not one of {', '.join(NAMES)}")
    if not 0.0 < cfg.heldout_fraction < 1.0:
        raise ValueError(f"data.heldout_fraction({cfg.heldout_fraction}) must be in (0, 1)")
    if cfg.name == "synthetic":
        if cfg.sources:
            raise ValueError("data.sources mixes tokenized files: use it with data=tokenized")
        if cfg.sample_overlap:
            raise ValueError(
                "data.sample_overlap=true cuts a tokenized stream into overlapping samples; the synthetic "
                "file's rows are separate samples: drop it, or use data=tokenized"
            )
        return _ensure_synthetic(cfg, vocab_size=vocab_size, sample_len=sample_len)
    for path, weight in sources_of(cfg):
        if weight <= 0:
            raise ValueError(f"data.sources: {path} has weight {weight}; every weight must be > 0")
        _check_tokenized(Path(path), vocab_size=vocab_size, sample_len=sample_len, eval_sample_len=eval_sample_len)
    _check_one_tokenizer([path for path, _ in sources_of(cfg)])
    return Path(sources_of(cfg)[0][0]).resolve()


def _ensure_synthetic(cfg: DataConfig, *, vocab_size: int, sample_len: int) -> Path:
    path = Path(cfg.path).resolve()
    want = {"format": FORMAT_VERSION, "vocab_size": vocab_size, "gen_seed": cfg.gen_seed}
    held = heldout_rows(cfg.num_samples, cfg.heldout_fraction)
    if not path.exists():
        write_synthetic(
            path,
            num_samples=cfg.num_samples,
            sample_len=sample_len,
            vocab=vocab_size,
            seed=cfg.gen_seed,
            heldout_fraction=cfg.heldout_fraction,
            attrs={**want, "kind": "synthetic"},
        )
        return path
    with open_read(path) as f:
        have = {k: int(f.attrs.get(k, -1)) for k in want}
        shape, held_have = f["tokens"].shape, (f["heldout"].shape[0] if "heldout" in f else 0)
    if have["format"] == 1:
        raise ValueError(
            f"data.path={cfg.path} is a format-1 synthetic file, without the held-out set that "
            "evaluation reads; delete it (it is generated again on first use) or point data.path at a new file"
        )
    if have != want or shape[0] < cfg.num_samples or shape[1] < sample_len or held_have < held:
        raise ValueError(
            f"data.path={cfg.path} holds {have} with shape {shape} and {held_have} held-out rows, but this run needs "
            f"{want} with at least ({cfg.num_samples}, {sample_len}) and {held}; point data.path at a new file "
            "(it is generated on first use)"
        )
    return path


def _check_tokenized(path: Path, *, vocab_size: int, sample_len: int, eval_sample_len: int) -> None:
    if not path.is_file():
        raise ValueError(
            f"data.path={path} does not exist; make it with "
            f"python -m jobs.prepare_data data.inputs=[FILES] data.path={path}"
        )
    with open_read(path) as f:
        kind, fmt, vocab = f.attrs.get("kind", ""), int(f.attrs.get("format", -1)), int(f.attrs.get("vocab_size", -1))
        tokens = f["tokens"].shape[0] if "tokens" in f else 0
        heldout = f["heldout"].shape[0] if "heldout" in f else 0
        counted = json.loads(f["manifest"][:].tobytes()) if "manifest" in f else {}
    if (tokens, heldout) != (counted.get("tokens", tokens), counted.get("heldout_tokens", heldout)):
        raise ValueError(
            f"{path} holds {tokens} training and {heldout} held-out tokens but its manifest counts "
            f"{counted['tokens']} and {counted['heldout_tokens']}: an append to it stopped before its "
            "commit; run the same python -m jobs.prepare_data again (it cuts the stream back and appends)"
        )
    if kind != "tokenized" or fmt != FORMAT_VERSION:
        raise ValueError(
            f"{path} is not a format-{FORMAT_VERSION} tokenized file (kind={kind!r}, format={fmt}); "
            "make it with python -m jobs.prepare_data, or use data=synthetic for the generated language"
        )
    if vocab > vocab_size:
        raise ValueError(
            f"{path} was tokenized with a vocabulary of {vocab} tokens, more than model.vocab_size"
            f"({vocab_size}) embeds: set model.vocab_size={padded_vocab(vocab)} (at least {vocab}; "
            "a multiple of 64 splits evenly over mesh.tp)"
        )
    if tokens < sample_len:
        raise ValueError(
            f"{path} holds {tokens} training tokens, fewer than one sample of model.max_seq_len + 1 "
            f"= {sample_len}; add documents (python -m jobs.prepare_data appends) or lower model.max_seq_len"
        )
    if heldout < eval_sample_len:
        raise ValueError(
            f"{path} holds {heldout} held-out tokens, fewer than one evaluation sample of train.seq_len + 1 "
            f"= {eval_sample_len}; prepare it with a larger data.heldout_fraction, or set train.eval_every=0"
        )


def _check_one_tokenizer(paths: list[str]) -> None:
    """A mixture's files share one tokenizer (the hash of its JSON) and one EOS id, else an id would mean
    different tokens in different samples."""
    seen: dict[tuple[str, int], list[str]] = {}
    for path in paths:
        with open_read(path) as f:
            sha = tokenizer_sha256(f["tokenizer_json"][:].tobytes().decode()) if "tokenizer_json" in f else "none"
            seen.setdefault((sha, int(f.attrs.get("eos_id", -1))), []).append(path)
    if len(seen) > 1:
        groups = "; ".join(f"{', '.join(p)} (tokenizer {sha[:12]}, eos_id {eos})" for (sha, eos), p in seen.items())
        raise ValueError(
            f"data.sources mixes files made with different tokenizers: {groups}. Prepare every file "
            f"with one tokenizer, e.g. python -m jobs.prepare_data data.tokenizer={paths[0]} "
            "data.inputs=[FILES] data.path=NEW.h5 (the tokenizer of that file is reused)"
        )
