"""Reading a corpus as documents streamed in bounded pieces: text files (a document per line, per paragraph
(blank-line separated) or per file: `data.doc_per`) and JSON-lines files (one object with a string `text`
field per line, always one document per line). A malformed file is an InputError that names the file and the line."""

from __future__ import annotations

import codecs
import hashlib
import itertools
import json
from collections.abc import Iterator
from pathlib import Path

__all__ = ["InputError", "pieces", "file_digest", "JSONL_SUFFIXES", "DOC_PER", "PIECE_CHARS"]

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")  # read as JSON lines; anything else is plain text
DOC_PER = ("line", "paragraph", "file")  # data.doc_per: what one document of a plain text file is
PIECE_CHARS = 1 << 16  # the hard cap: a longer document is read and tokenized in pieces of at most this many characters
_MAX_JSON_LINE = 1 << 28  # bytes: a JSON line is parsed whole, so it is the one thing held at once


class InputError(ValueError):
    """A corpus file that cannot be read as documents: the message names the file and the line."""


def _line_parts(path: Path, limit: int) -> Iterator[tuple[int, str, bool]]:
    """(line number, part of the line, whether the line ends with it), parts of at most `limit` bytes, decoded as
    strict UTF-8; a line's end (\\n, \\r\\n) is dropped and a blank (whitespace-only) line is one empty part."""
    with path.open("rb") as f:
        for n in itertools.count(1):
            dec, at, ws, told = codecs.getincrementaldecoder("utf-8")("strict"), 0, "", False
            while True:
                raw = f.readline(limit)
                eol = raw.endswith(b"\n") or not raw  # the end of the file ends its last line
                if not raw and not at:
                    return
                try:
                    part = dec.decode(raw, final=eol)
                except UnicodeDecodeError as e:
                    raise InputError(f"{path}:{n}: not UTF-8 ({e.reason} at byte {at + e.start} of the line)") from None
                at += len(raw)
                part = (ws + part).rstrip("\r\n") if eol else ws + part
                if not part.strip() and not told:  # whitespace so far: the line may still be blank
                    if eol:
                        yield n, "", True
                        break
                    if len(part) < limit:
                        ws = part
                        continue
                ws = "\r" if not eol and part.endswith("\r") else ""  # it may be half of the line's \r\n
                yield n, part[: len(part) - len(ws)], eol
                told = True
                if eol:
                    break


class _Pieces:
    """One document's text, handed out in pieces of at most `cap` characters (cut before a whitespace in the
    second half of the window where there is one, so that words stay whole)."""

    def __init__(self, cap: int) -> None:
        self.cap, self.buf, self.size, self.started = cap, [], 0, False

    def add(self, text: str) -> Iterator[tuple[str, bool]]:
        self.started = True
        for i in range(0, len(text), self.cap):
            self.buf.append(text[i : i + self.cap])
            self.size += len(self.buf[-1])
            while self.size > self.cap:
                s = "".join(self.buf)
                cut = max(s.rfind(c, self.cap // 2, self.cap + 1) for c in " \n\t")
                cut = cut if cut > 0 else self.cap
                yield s[:cut], False
                self.buf, self.size = [s[cut:]], len(s) - cut

    def end(self) -> Iterator[tuple[str, bool]]:
        if self.started:
            yield "".join(self.buf), True
        self.buf, self.size, self.started = [], 0, False


def _text_pieces(path: Path, doc_per: str, cap: int) -> Iterator[tuple[str, bool]]:
    doc, blanks, first = _Pieces(cap), 0, True  # first: the next part starts a line
    for _, part, eol in _line_parts(path, cap):
        if first and not part and eol:  # a blank line
            if doc_per == "paragraph":
                yield from doc.end()
            blanks += doc.started
        else:
            if first and doc.started:
                yield from doc.add("\n" * (1 + (blanks if doc_per == "file" else 0)))
            blanks = 0
            yield from doc.add(part)
            if eol and doc_per == "line":
                yield from doc.end()
        first = eol
    yield from doc.end()


def _jsonl_pieces(path: Path, cap: int) -> Iterator[tuple[str, bool]]:
    doc, line, size = _Pieces(cap), [], 0
    for n, part, eol in _line_parts(path, 1 << 20):
        line.append(part)
        size += len(part)
        if size > _MAX_JSON_LINE:
            raise InputError(f"{path}:{n}: a JSON line longer than {_MAX_JSON_LINE} bytes; split its document")
        if not eol:
            continue
        text, line, size = "".join(line), [], 0
        if not text.strip():
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: not a JSON line ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise InputError(f'{path}:{n}: no "text" field (each line must be an object with a string "text")')
        if not isinstance(obj["text"], str):
            raise InputError(f'{path}:{n}: "text" is of type {type(obj["text"]).__name__}, not a string')
        yield from doc.add(obj["text"])
        yield from doc.end()


def pieces(path: Path, *, doc_per: str = "paragraph", cap: int | None = None) -> Iterator[tuple[str, bool]]:
    """(text, whether it ends its document) of one corpus file's documents, streamed: a document is one piece, or,
    past `cap` characters, several (each at most `cap`) that make it up in order; memory is bounded by `cap`
    (and, for JSON lines, the longest line). InputError (file and line) when the file is malformed or empty."""
    cap = cap or PIECE_CHARS
    read = _jsonl_pieces(path, cap) if path.suffix.lower() in JSONL_SUFFIXES else _text_pieces(path, doc_per, cap)
    count = 0
    for piece, ends in read:
        count += ends
        yield piece, ends
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
