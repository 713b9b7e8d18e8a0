"""The run's append-only lifecycle ledger, `RUN_DIR/events.jsonl`, shared by every rank and attempt, and the
lock that serialises its writers (and those of other shared files: `jobs.failure.quarantine`) across hosts."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from jobs.records import checked, stamped

__all__ = ["DURABLE", "EventLog", "read_events", "exclusive"]

# The records that budgets and decisions are computed from (failures and attempts counted, the job MTBF, the
# progress check against failure.max_attempts_without_progress): fsync'ed before emit returns, so a node
# that loses power right after cannot take them back. Other kinds are left to the page cache.
DURABLE = frozenset({"failure", "decision", "attempt_end", "attempt_start", "checkpoint_saved"})


# `exclusive`: how long a writer waits for the lock, and how long a holder may keep it unchanged before it is taken
# for dead (killed between create and unlink) and broken.
_LOCK_WAIT_S = 15.0
_LOCK_STALE_S = 10.0


@contextlib.contextmanager
def exclusive(path: str | os.PathLike[str]) -> Iterator[bool]:
    """Holds `PATH.lock`, a file created with O_CREAT|O_EXCL (atomic on NFSv3+ and parallel filesystems, where
    fcntl/flock locks are not reliable; the run's decision claim relies on the same), while the caller writes
    `path`; the next opener then sees its whole size (NFS close-to-open). Yields True when held; after
    `_LOCK_WAIT_S`, or when the lock cannot be created at all (a full or read-only disk), it yields False and the
    caller writes unlocked (a ledger record is worth more than its order). A lock whose holder left it unchanged
    for `_LOCK_STALE_S` is broken (its holder died in between)."""
    lock = Path(f"{path}.lock")
    token = f"{os.uname().nodename}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}".encode()
    held = _acquire(lock, token)
    try:
        yield held
    finally:
        if held and _read(lock) == token:
            with contextlib.suppress(OSError):
                os.unlink(lock)


def _acquire(lock: Path, token: bytes) -> bool:
    start = seen_since = time.monotonic()
    seen, pause = None, 0.002
    while True:
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(lock)
            if holder != seen:
                seen, seen_since = holder, time.monotonic()
            elif time.monotonic() - seen_since > _LOCK_STALE_S:
                _break(lock, holder)
            if time.monotonic() - start > _LOCK_WAIT_S:
                logging.getLogger("meshjob").warning(
                    "%s held by %r for %.0f s: writing without it", lock, seen, _LOCK_WAIT_S
                )
                return False
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            continue
        except FileNotFoundError:  # the folder is not there yet
            lock.parent.mkdir(parents=True, exist_ok=True)
            continue
        except OSError as e:
            logging.getLogger("meshjob").warning("%s cannot be created (%s): writing without it", lock, e)
            return False
        try:
            os.write(fd, token)
        finally:
            os.close(fd)
        return True


def _read(lock: Path) -> bytes | None:
    try:
        return lock.read_bytes()
    except OSError:
        return None


def _break(lock: Path, holder: bytes | None) -> None:
    """Removes a stale lock: renamed away first (one breaker wins), then deleted."""
    aside = lock.with_name(f"{lock.name}.stale.{uuid.uuid4().hex[:8]}")
    with contextlib.suppress(OSError):
        os.rename(lock, aside)
        logging.getLogger("meshjob").warning("%s: broke a lock left by %r (its holder died?)", lock, holder)
        os.unlink(aside)


class EventLog:
    """Appends one JSON object per event, one `write` on an O_APPEND file under `exclusive`. O_APPEND alone
    is atomic only on a local filesystem: on NFS the client computes the end itself, so two hosts appending at
    once can overwrite each other's record (open(2), O_APPEND); hence the lock. The kinds in DURABLE are
    fsync'ed before the lock is released."""

    def __init__(self, path: str | os.PathLike[str], *, rank: int = 0, restart: int = 0, attempt: str = "") -> None:
        self.path = Path(path)
        self.rank = rank
        self.restart = restart
        self.attempt = attempt  # `<job id>.<restart>` under Slurm, `local.<n>` locally (jobs.failure.ledger)

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        record = stamped(
            {
                "time": time.time(),
                "kind": kind,
                "rank": self.rank,
                "restart": self.restart,
                "attempt": self.attempt,
                **fields,
            }
        )
        line = (json.dumps(record, default=str) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with exclusive(self.path):
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, line)
                if kind in DURABLE:
                    os.fsync(fd)
            finally:
                os.close(fd)
        return record


def read_events(path: str | os.PathLike[str], kind: str | None = None) -> list[dict[str, Any]]:
    """All events of the ledger (optionally of one kind), in order; a torn last line is ignored, a line of a
    newer schema major version refused (jobs.records.NewerSchema)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        try:
            rec = checked(json.loads(line), source=f"{p} line {n}")
        except json.JSONDecodeError:
            continue
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out
