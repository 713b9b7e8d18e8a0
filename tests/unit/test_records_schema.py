"""Every record the tools read back carries a schema version (jobs.records); a newer major version is refused with a
message that names the file and says to upgrade, an older or unstamped record reads as before."""

from __future__ import annotations

import json

import pytest

from jobs.events import EventLog, read_events
from jobs.failure.incident import Incident, write_incident
from jobs.failure.policy import Decision, publish, read_decision
from jobs.launch.rundir import OWNER_FILE, read_owner
from jobs.records import SCHEMA, NewerSchema, load_json


def test_the_ledger_stamps_each_line_and_reads_it_back_without_the_stamp(tmp_path) -> None:
    log = EventLog(tmp_path / "events.jsonl", rank=1, restart=0, attempt="local.0")
    log.emit("attempt_start", step=0)
    (line,) = (tmp_path / "events.jsonl").read_text().splitlines()
    assert json.loads(line)["schema"] == SCHEMA == "1.0"
    (event,) = read_events(tmp_path / "events.jsonl")
    assert "schema" not in event and (event["kind"], event["rank"], event["step"]) == ("attempt_start", 1, 0)


def test_a_ledger_line_of_a_newer_major_version_is_refused_naming_the_line(tmp_path) -> None:
    path = tmp_path / "events.jsonl"
    EventLog(path).emit("attempt_start")
    with path.open("a") as f:
        f.write(json.dumps({"schema": "1.7", "kind": "checkpoint_saved", "time": 1.0}) + "\n")  # a minor: read
        f.write(json.dumps({"kind": "attempt_end", "time": 2.0}) + "\n")  # written before the stamp: 1.0
    assert [e["kind"] for e in read_events(path)] == ["attempt_start", "checkpoint_saved", "attempt_end"]
    with path.open("a") as f:
        f.write(json.dumps({"schema": "2.0", "kind": "attempt_end", "time": 3.0}) + "\n")
    with pytest.raises(
        NewerSchema,
        match=rf"{path} line 4: record schema 2.0 was written by a newer meshjob; "
        r"this one reads schema 1.x: upgrade meshjob",
    ):
        read_events(path)


def test_incident_decision_and_owner_files_are_stamped_and_refused_when_newer(tmp_path) -> None:
    fields = {f: None for f in Incident.__dataclass_fields__}
    inc = Incident(**{**fields, "attempt": "local.0", "cls": "rank_crashed", "summary": "rank 1 died"})
    path = write_incident(tmp_path, inc)
    assert json.loads(path.read_text())["schema"] == SCHEMA and load_json(path)["cls"] == "rank_crashed"
    publish(tmp_path, "local.0", Decision(**{f: None for f in Decision.__dataclass_fields__}))
    decision = path.parent / "decision.json"
    assert json.loads(decision.read_text())["schema"] == SCHEMA and "schema" not in read_decision(
        tmp_path, "local.0", wait_s=0
    )
    for newer in (path, decision, tmp_path / OWNER_FILE):
        newer.write_text(json.dumps({"schema": "2.1"}))
    with pytest.raises(NewerSchema, match="incident.json: record schema 2.1"):
        load_json(path)
    with pytest.raises(NewerSchema, match="decision.json: record schema 2.1"):
        read_decision(tmp_path, "local.0", wait_s=0)
    with pytest.raises(NewerSchema, match="owner.json: record schema 2.1"):
        read_owner(tmp_path)
