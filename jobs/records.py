"""The schema version stamped on every record the tools write and read back: `events.jsonl` lines, `incident.json`,
`owner.json`, `decision.json`. A reader refuses a record of a newer major version; a minor version only adds fields.
Records written before the stamp existed read as 1.0."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["SCHEMA", "NewerSchema", "stamped", "checked", "load_json"]

SCHEMA = "1.0"  # major.minor
_KEY = "schema"


class NewerSchema(RuntimeError):
    """A record written by a newer meshjob whose meaning this one does not know."""


def stamped(record: dict[str, Any]) -> dict[str, Any]:
    """The record with this version's `schema` first."""
    return {_KEY: SCHEMA, **record}


def checked(record: dict[str, Any], *, source: str | os.PathLike[str]) -> dict[str, Any]:
    """The record without its `schema` key; NewerSchema naming `source` when a newer major version wrote it."""
    version = str(record.get(_KEY, "1.0"))
    if int(version.split(".")[0]) > int(SCHEMA.split(".")[0]):
        raise NewerSchema(
            f"{source}: record schema {version} was written by a newer meshjob; this one reads schema "
            f"{SCHEMA.split('.')[0]}.x: upgrade meshjob (pip install -U meshjob) to read this run"
        )
    return {k: v for k, v in record.items() if k != _KEY}


def load_json(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A JSON record file, checked (OSError and ValueError as json.loads raises them)."""
    return checked(json.loads(Path(path).read_text()), source=path)
