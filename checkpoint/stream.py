"""A committed step folder of the RAM tier sent to another rank file by file, in chunks, while one is received from a
third (partner copies, checkpoint/memory_tier.py): process memory holds two chunk buffers, never the folder.

The protocol, on a gloo group of the tier's own: both manifests first (`partner.exchange`, small), then the files'
bytes in the order of each manifest's sorted file names, cut into chunks of at most CHUNK bytes; both sides know
every chunk's size from the manifest, so each round posts one send and one receive and waits for both. The receiver
writes each file as it arrives (crc32 taken as written), checks it against its manifest record, fsyncs it, writes
the manifest last and commits the folder by one rename, as `partner.commit_folder` does with a whole payload. A
side that fails part way (a file gone, a full disk) keeps taking part to the last chunk, so no rank waits forever.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.manifest import MANIFEST, fsync_dir, read_manifest, write_synced
from checkpoint.partner import exchange

__all__ = ["CHUNK", "SendError", "stream_folder"]

CHUNK = 8 << 20  # bytes per message: the most process memory a copy holds per direction


class SendError(OSError):
    """The sending side of a copy failed (its folder could not be read); the receiver's check refuses the copy."""


def _chunks(files: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """(file name, offset, size) of every chunk of `files` ((name, size), in order); an empty file has none."""
    return [(name, off, min(CHUNK, size - off)) for name, size in files for off in range(0, size, CHUNK)]


def _files(manifest: dict[str, Any]) -> list[tuple[str, int]]:
    return [(name, int(rec["size"])) for name, rec in sorted(manifest["files"].items())]


class _Writer:
    """The receiving side: each file of the copy written as its chunks arrive, checked once complete."""

    def __init__(self, tmp: Path, manifest: dict[str, Any], raw: bytes) -> None:
        self.tmp, self.manifest, self.raw, self.error = tmp, manifest, raw, None
        self.fd, self.name, self.crc, self.size = -1, "", 0, 0
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            for name, size in _files(manifest):
                if size == 0:
                    self._open(name)
                    self._close()
        except Exception as e:  # noqa: BLE001 - reported by stream_folder, after the last chunk
            self.error = e

    def _open(self, name: str) -> None:
        self.fd, self.name, self.crc, self.size = (
            os.open(self.tmp / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            name,
            0,
            0,
        )

    def _close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)
        self.fd, rec = -1, self.manifest["files"][self.name]
        if self.size != rec["size"] or ("crc32" in rec and f"{self.crc:08x}" != rec["crc32"]):
            raise ValueError(f"{self.name} of the copy does not match its manifest (size or crc32)")

    def write(self, name: str, data: memoryview, last: bool) -> None:
        if self.error is not None:
            return
        try:
            if self.fd < 0:
                self._open(name)
            view = data
            while view:
                view = view[os.write(self.fd, view) :]
            self.crc, self.size = zlib.crc32(data, self.crc), self.size + len(data)
            if last:
                self._close()
        except Exception as e:  # noqa: BLE001 - reported by stream_folder, after the last chunk
            self.error = e

    def discard(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        shutil.rmtree(self.tmp, ignore_errors=True)

    def commit(self, final: Path, step: int) -> dict[str, Any]:
        if self.fd >= 0:  # a file cut short: the copy is incomplete
            self.error = self.error or ValueError(f"{self.name} of the copy ended early")
        if self.error is not None:
            self.discard()
            raise self.error
        write_synced(self.tmp / MANIFEST, self.raw)  # the sender's bytes: read_manifest checks its own crc
        fsync_dir(self.tmp)
        manifest = read_manifest(self.tmp, step=step)
        if final.exists():
            shutil.rmtree(final)
        self.tmp.rename(final)
        fsync_dir(final.parent)
        return manifest


class _Reader:
    """The sending side: the chunks of the folder's files read into one buffer; a file that cannot be read is sent
    as zeros (the receiver's check refuses it) and its error raised once the streams end."""

    def __init__(self, src: Path) -> None:
        self.src, self.name, self.file, self.error = src, "", None, None

    def fill(self, view: memoryview, name: str) -> None:
        k = 0
        try:
            if name != self.name:
                self.close()
                self.name, self.file = name, open(self.src / name, "rb")  # noqa: SIM115 - closed by close()
            k = self.file.readinto(view) or 0
        except OSError as e:
            self.error = self.error or e
        view[k:] = bytes(len(view) - k)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def stream_folder(
    src: Path | None,
    *,
    send_to: int | None,
    recv_from: int | None,
    tmp: Path,
    final: Path,
    step: int,
    pg: Any,
) -> dict[str, Any] | None:
    """Sends the committed folder `src` (None: nothing to send) to rank `send_to` while receiving rank `recv_from`'s
    folder of `step`, committed as `final` (written in `tmp`); either rank may be None (one direction only). Returns
    the received manifest; None when nothing was received; raises ValueError (a damaged copy), OSError, or
    SendError (this side's folder unreadable), leaving no `final`, once both streams ended."""
    errors: list[Exception] = []
    mine, out = None, []
    try:  # a manifest this side cannot read is not sent (the other side then knows there is nothing to receive)
        if src is not None and send_to is not None:
            mine = (src / MANIFEST).read_bytes()
            out = _chunks(_files(json.loads(mine)))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        mine, out = None, []
        errors.append(SendError(f"{src}: {e}"))
    got = exchange(mine, send_to=send_to, recv_from=recv_from, pg=pg)
    theirs = json.loads(got) if got is not None else None
    inc = _chunks(_files(theirs)) if theirs is not None else []
    writer = None
    if theirs is not None and theirs.get("step") != step:
        errors.append(ValueError(f"the copy is of step {theirs.get('step')}, not {step}"))  # received, dropped
    elif theirs is not None:
        writer = _Writer(tmp, theirs, got)
    reader = _Reader(src) if src is not None else None
    send_buf, recv_buf = torch.empty(CHUNK, dtype=torch.uint8), torch.empty(CHUNK, dtype=torch.uint8)
    try:
        for i in range(max(len(out), len(inc))):
            reqs = []
            if i < len(out):
                reader.fill(memoryview(send_buf.numpy())[: out[i][2]], out[i][0])
                reqs.append(dist.isend(send_buf[: out[i][2]], dst=send_to, group=pg))
            if i < len(inc):
                reqs.append(dist.irecv(recv_buf[: inc[i][2]], src=recv_from, group=pg))
            for q in reqs:
                q.wait()
            if i < len(inc) and writer is not None:
                name, off, n = inc[i]
                writer.write(name, memoryview(recv_buf.numpy())[:n], last=off + n == theirs["files"][name]["size"])
    finally:
        if reader is not None:
            reader.close()
    if reader is not None and reader.error is not None:
        errors.append(SendError(f"{src}: {reader.error}"))
    if errors:
        if writer is not None:
            writer.discard()
        raise errors[0]
    return writer.commit(final, step) if writer is not None else None
