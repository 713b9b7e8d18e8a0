"""Reading a corpus as documents, one line at a time: text files (documents separated by blank lines) and
JSON-lines files (one object with a string `text` field per line). A malformed file is an InputError
that names the file and the line."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

__all__ = ["InputError", "documents", "file_digest", "JSONL_SUFFIXES"]

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")  # read as JSON lines; anything else is plain text


class InputError(ValueError):
    """A corpus file that cannot be read as documents: the message names the file and the line."""


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line without its newline), decoded as strict UTF-8."""
    with path.open("rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                yield n, raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise InputError(f"{path}:{n}: not UTF-8 ({e.reason} at byte {e.start} of the line)") from None


def _jsonl_documents(path: Path) -> Iterator[str]:
    for n, line in _lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not a JSON line ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise InputError(f"{path}:{n}: no \"text\" field (each line must be an object with a string \"text\")")
        if not isinstance(obj["text"], str):
            raise InputError(f"{path}:{n}: \"text\" is of type {type(obj['text']).__name__}, not a string")
        yield obj["text"]


def _text_documents(path: Path) -> Iterator[str]:
    para: list[str] = []
    for _, line in _lines(path):
        if line.strip():
            para.append(line)
        elif para:
            yield "\n".join(para)
            para = []
    if para:
        yield "\n".join(para)


def documents(path: Path) -> Iterator[str]:
    """The documents of one corpus file, streamed; InputError (file and line) when it is malformed or empty."""
    read = _jsonl_documents if path.suffix.lower() in JSONL_SUFFIXES else _text_documents
    count = 0
    for doc in read(path):
        count += 1
        yield doc
    if count == 0:
        raise InputError(f"{path}:1: no documents (the file is empty or blank)")


def file_digest(path: Path) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in 1 MiB blocks."""
    h, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return size, h.hexdigest()
