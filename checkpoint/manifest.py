"""The manifest that commits a checkpoint step folder, and the checks that decide whether one is valid."""

from __future__ import annotations

import json
import os
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

__all__ = [
    "MANIFEST",
    "FORMAT",
    "step_dirs",
    "file_record",
    "write_manifest",
    "write_synced",
    "read_manifest",
    "check_files",
    "check_step_dir",
    "verify_share",
]

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_RE = re.compile(r"^step_(\d+)$")
_CHUNK = 8 << 20
_MIN_RANGE = 64 << 20  # bytes per crc32 thread at least: below it a thread costs more than it saves
_MAX_THREADS = 8


class ManifestError(Exception):
    """The manifest is missing or unreadable; str() is the reason."""


def step_dirs(folder: Path) -> list[tuple[int, Path]]:
    """Committed-looking step folders (`step_<N>`, no temp ones), newest first."""
    if not folder.is_dir():
        return []
    out = []
    for p in folder.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            out.append((int(m.group(1)), p))
    return sorted(out, reverse=True)


def file_record(path: Path, *, checksum: bool = True) -> dict[str, Any]:
    """{"size", "crc32"} of a file, fsync'ed first so what is summed is what is on disk (for files
    whose writer did not record them, see checkpoint.writer)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        size = os.fstat(fd).st_size
        crc = _crc32_fd(fd) if checksum else 0
    finally:
        os.close(fd)
    rec: dict[str, Any] = {"size": size}
    if checksum:
        rec["crc32"] = f"{crc:08x}"
    return rec


def _crc32_fd(fd: int) -> int:
    """crc32 of the whole file: a large file in ranges summed by threads at once (zlib releases the GIL), one per core
    this process may run on, up to _MAX_THREADS and one per _MIN_RANGE bytes, their sums combined."""
    size = os.fstat(fd).st_size
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n = max(1, min(cores, _MAX_THREADS, size // _MIN_RANGE))
    if n == 1:
        return _crc32_range(fd, 0, size)
    bounds = [size * i // n for i in range(n + 1)]
    with ThreadPoolExecutor(n, thread_name_prefix="ckpt-crc32") as pool:
        crcs = list(pool.map(lambda i: _crc32_range(fd, bounds[i], bounds[i + 1]), range(n)))
    crc = crcs[0]
    for i in range(1, n):
        crc = crc32_combine(crc, crcs[i], bounds[i + 1] - bounds[i])
    return crc


def _crc32_range(fd: int, start: int, end: int) -> int:
    """crc32 of the file's bytes [start, end) (fewer where it ends first), read into one reused buffer."""
    buf = bytearray(min(_CHUNK, max(end - start, 1)))
    view = memoryview(buf)
    crc, off = 0, start
    while off < end and (n := os.preadv(fd, [view[: min(len(buf), end - off)]], off)):
        crc = zlib.crc32(view[:n], crc)
        off += n
    return crc


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The crc32 of A + B from crc32(A), crc32(B) and len(B) (zlib's crc32_combine, which Python's zlib lacks): crc1
    advanced over len2 zero bytes by squaring the one-zero-bit operator (a 32x32 matrix over GF(2))."""
    if len2 <= 0:
        return crc1
    op = [0xEDB88320] + [1 << i for i in range(31)]  # the operator for one zero bit
    for _ in range(3):
        op = _gf2_square(op)  # ... for one zero byte
    while len2:  # apply len2 zero bytes, one power of two at a time
        if len2 & 1:
            crc1 = _gf2_times(op, crc1)
        len2 >>= 1
        op = _gf2_square(op)
    return crc1 ^ crc2


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[i]) for i in range(32)]


def _crc32_path(path: Path) -> str:
    """The crc32 of a file as the manifest writes it; reading only (verification needs no fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return f"{_crc32_fd(fd):08x}"
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(step_dir: Path, manifest: dict[str, Any]) -> None:
    """Writes the manifest into a step folder not yet under its final name (the rename that follows is
    the commit, so a torn manifest is never seen): the file, its fsync, the folder's fsync."""
    body = dict(manifest, format=FORMAT)
    body["manifest_crc32"] = _self_crc(body)
    data = json.dumps(body, indent=1, sort_keys=True, default=str).encode()
    write_synced(step_dir / MANIFEST, data)
    fsync_dir(step_dir)


def write_synced(path: Path, data: bytes) -> None:
    """Writes `data` to `path` (created or truncated) and fsyncs the file; the caller fsyncs its folder."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def read_manifest(step_dir: Path, *, step: int | None = None) -> dict[str, Any]:
    """The parsed manifest; raises ManifestError with the reason when it is missing or damaged."""
    path = step_dir / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ManifestError(f"no {MANIFEST} (save never committed)") from None
    except OSError as e:
        raise ManifestError(f"{MANIFEST} unreadable: {e}") from None
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{MANIFEST} is not valid JSON ({e}); truncated?") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ManifestError(
            f"{MANIFEST} has format {body.get('format') if isinstance(body, dict) else '?'}, expected {FORMAT}"
        )
    if body.get("manifest_crc32") != _self_crc(body):
        raise ManifestError(f"{MANIFEST} checksum mismatch (edited or damaged)")
    if step is not None and body.get("step") != step:
        raise ManifestError(f"{MANIFEST} says step {body.get('step')}, folder says {step}")
    if not isinstance(body.get("files"), dict) or ".metadata" not in body["files"]:
        raise ManifestError(f"{MANIFEST} lists no DCP .metadata file")
    return body


def check_files(step_dir: Path, files: dict[str, dict[str, Any]], names: list[str], *, checksum: bool) -> list[str]:
    """Problems with the named files against their manifest records (empty when all match)."""
    problems = []
    for name in names:
        want = files[name]
        p = step_dir / name
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            problems.append(f"{name} missing")
            continue
        if size != want["size"]:
            problems.append(f"{name} has {size} bytes, manifest says {want['size']} (truncated?)")
            continue
        if checksum and "crc32" in want:
            got = _crc32_path(p)
            if got != want["crc32"]:
                problems.append(f"{name} crc32 {got} != manifest {want['crc32']}")
    return problems


def verify_share(names: list[str], *, rank: int, world_size: int) -> list[str]:
    """The files of a step folder that `rank` checks before a load (each file by one rank): the DCP shards it wrote
    (`__<rank>_<i>.distcp`), which are the ones it reads back on the same mesh, so the check brings them into its
    node's page cache and the load reads them from there, not from storage a second time; and of the others (the
    .metadata, shards of ranks a smaller world no longer has) every `world_size`-th, sorted."""
    own = [n for n in sorted(names) if _writer(n) == rank]
    rest = [n for n in sorted(names) if _writer(n) is None or _writer(n) >= world_size]
    return sorted(own + rest[rank::world_size])


def _writer(name: str) -> int | None:
    """The rank that wrote DCP shard `__<rank>_<i>.distcp` (None for any other file)."""
    head, sep, _ = name.removeprefix("__").partition("_")
    return int(head) if name.startswith("__") and sep and head.isdigit() and name.endswith(".distcp") else None


def check_step_dir(step_dir: Path, *, step: int, checksum: bool) -> list[str]:
    """Problems with a whole step folder, manifest and every file (empty when it is valid)."""
    try:
        manifest = read_manifest(step_dir, step=step)
        return check_files(step_dir, manifest["files"], sorted(manifest["files"]), checksum=checksum)
    except ManifestError as e:
        return [str(e)]
    except OSError as e:
        return [f"{step_dir.name} unreadable: {e}"]


def _self_crc(body: dict[str, Any]) -> str:
    rest = {k: v for k, v in body.items() if k != "manifest_crc32"}
    return f"{zlib.crc32(json.dumps(rest, sort_keys=True, default=str).encode()):08x}"
