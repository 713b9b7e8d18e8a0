"""The run's append-only lifecycle ledger, `RUN_DIR/events.jsonl`, shared by every rank and attempt."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from jobs.records import checked, stamped

__all__ = ["DURABLE", "EventLog", "read_events"]

# The records that budgets and decisions are computed from (failures and attempts counted, the job MTBF, the
# progress check against failure.max_attempts_without_progress): fsync'ed before emit returns, so a node
# that loses power right after cannot take them back. Other kinds are left to the page cache.
DURABLE = frozenset({"failure", "decision", "attempt_end", "attempt_start", "checkpoint_saved"})


class EventLog:
    """Appends one JSON object per event; each line is one `write` on an O_APPEND file, so lines from
    concurrent ranks never interleave on a local or NFS-like filesystem. The kinds in DURABLE are fsync'ed."""

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
