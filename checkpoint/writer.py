"""The DCP storage writer and stager of a checkpoint save: crc32 and size taken from the bytes as they are
written (no re-read), torch's zip crc32 off, one fsync per file, and a staging copy that runs in a thread.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import AsyncStager

__all__ = ["RecordingWriter", "ThreadStager", "zip_crc32_off"]

_SYNC_FILE_RANGE_WRITE = 2
_WRITEBACK_MIN = 1 << 20  # writes smaller than this are left to the final fsync


class RecordingWriter(FileSystemWriter):
    """FileSystemWriter (one file per rank, fsync'ed once by DCP) that records each file's
    {"size", "crc32"} in `records` from the bytes it writes, for the manifest. In async_mode=process
    the writer runs in another process and `records` stays empty here: the caller reads the files.

    `collective_timeout_s` bounds the collectives of DCP's background process (async_mode=process): torch
    2.13 spawns it and makes its gloo group with the backend's 30-minute default, and offers no argument,
    environment variable or executor hook for it (torch/distributed/checkpoint/_async_process_executor.py,
    `_checkpointing_subprocess`: `dist.init_process_group(backend=dist.Backend.GLOO)`); this writer is the one
    object of ours that DCP runs in that process, and its set-up comes before every save's first collective."""

    def __init__(self, path: Path, *, thread_count: int, collective_timeout_s: float | None = None) -> None:
        super().__init__(str(path), single_file_per_rank=True, sync_files=True, thread_count=thread_count)
        self.records: dict[str, dict[str, Any]] = {}
        self.fs = _RecordingFileSystem(self.records)
        self.collective_timeout_s = collective_timeout_s
        self._pid = os.getpid()  # pickled with the writer: another pid is DCP's background process

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if self.collective_timeout_s is not None and os.getpid() != self._pid and dist.is_initialized():
            dist.distributed_c10d._set_pg_timeout(timedelta(seconds=self.collective_timeout_s))  # its only group

    def write_data(self, plan: Any, planner: Any) -> Future:
        with zip_crc32_off():  # DCP's FileSystemWriter writes synchronously in here
            return super().write_data(plan, planner)


_crc32_lock = threading.Lock()
_crc32_users: list[bool] = []  # the setting before the first of the writers now inside, one entry per writer


@contextlib.contextmanager
def zip_crc32_off() -> Iterator[None]:
    """torch.save skips the zip records' crc32 (the manifest has one per file); restored after the last
    writer inside leaves (the filesystem and RAM tiers write on threads of their own, possibly at once). The
    switch is process-wide: a torch.save on another thread meanwhile also goes without it."""
    with _crc32_lock:
        _crc32_users.append(_crc32_users[0] if _crc32_users else torch.serialization.get_crc32_options())
        torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        with _crc32_lock:
            prev = _crc32_users.pop()
            if not _crc32_users:
                torch.serialization.set_crc32_options(prev)


class _RecordingFileSystem(FileSystem):
    def __init__(self, records: dict[str, dict[str, Any]]) -> None:
        super().__init__()
        self.records = records

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as f:
            if "w" not in mode:
                yield f
                return
            s = _CrcStream(f)
            yield s
        # DCP writes `.metadata.tmp` and renames it to `.metadata`; the record keeps the final name.
        self.records[Path(path).name.removesuffix(".tmp")] = {"size": s.size, "crc32": f"{s.crc:08x}"}


class _CrcStream:
    """A binary file that sums what goes through it; large writes start their writeback at once
    (sync_file_range), so the disk works while the next item is serialized and summed."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.crc = 0
        self.size = 0
        self._flushed = 0

    def write(self, b: Any) -> int:
        n = self._f.write(b)
        nbytes = memoryview(b).nbytes
        assert n == nbytes, (n, nbytes)  # a BufferedWriter writes everything or raises
        self.crc = zlib.crc32(b, self.crc)
        self.size += n
        if self.size - self._flushed >= _WRITEBACK_MIN:
            self._f.flush()
            _start_writeback(self._f.fileno(), self._flushed, self.size - self._flushed)
            self._flushed = self.size
        return n

    def tell(self) -> int:
        return self._f.tell()

    def flush(self) -> None:
        self._f.flush()

    def fileno(self) -> int:
        return self._f.fileno()

    def writable(self) -> bool:
        return True

    def close(self) -> None:
        self._f.close()


def _load_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_sync_file_range = _load_sync_file_range()


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Asks the kernel to start writing [offset, offset+nbytes) to disk without waiting (Linux); a hint only."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


class ThreadStager(AsyncStager):
    """Copies a state dict into CPU buffers made on the first save and reused after (pinned where CUDA
    is), in a thread of its own: `stage` returns a Future at once. The caller must not change the
    source tensors until `wait()` returns (CheckpointManager waits in an optimizer step pre-hook) and
    must not stage again before the previous save finished writing from the buffers."""

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-stage")
        self._buffers: dict[str, Any] | None = None
        self._pending: Future | None = None

    def reset(self) -> None:
        """The next state dict has another structure: its buffers are made anew."""
        self.wait()
        self._buffers = None

    def stage(self, state_dict: dict[str, Any]) -> Future:
        self._pending = self._pool.submit(self._copy, state_dict)
        return self._pending

    def _copy(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._buffers is None:
            self._buffers = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self._buffers)

    def wait(self) -> None:
        """Blocks until the staging copy in flight (if any) is done; its failure is raised by the save."""
        pending = self._pending
        if pending is not None:
            pending.exception()

    def synchronize_staging(self) -> None:
        self.wait()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._buffers = None
