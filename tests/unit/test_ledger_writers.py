"""The ledger and the quarantine list on a network filesystem: O_APPEND from several hosts can lose
records on NFS (open(2)), and the quarantine list was an unlocked read-modify-write; both are now written under one
O_EXCL lock file (fcntl/flock are not reliable on parallel filesystems), which a dead holder cannot leave behind."""

from __future__ import annotations

import json
import multiprocessing
import threading
import time
from pathlib import Path

from jobs import events as events_mod
from jobs.events import EventLog, exclusive, read_events
from jobs.failure import quarantine
from jobs.records import stamped


def test_a_record_waits_for_the_writer_that_holds_the_ledger(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    log = EventLog(path, rank=3)
    released = []

    def other_host() -> None:  # another host's writer: it holds the lock while it appends its record by hand
        line = json.dumps(stamped({"time": time.time(), "kind": "failure", "rank": 1, "cls": "dead_rank"})) + "\n"
        with exclusive(path):
            time.sleep(0.4)
            with open(path, "a") as f:
                f.write(line)
            released.append(time.monotonic())

    t = threading.Thread(target=other_host)
    t.start()
    time.sleep(0.1)
    log.emit("stop_requested", step=4)
    done = time.monotonic()
    t.join()
    # Before: the second record went in at once, whatever the other writer was doing. (This test once nested an
    # emit inside the other writer's lock: that emit waited for its own lock until it broke it as stale, 10 s.)
    assert released and done >= released[0]
    assert [(e["rank"], e["kind"]) for e in read_events(path)] == [(1, "failure"), (3, "stop_requested")]
    assert not Path(f"{path}.lock").exists()


def test_a_lock_left_by_a_dead_writer_is_broken_and_the_record_written(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(events_mod, "_LOCK_STALE_S", 0.2)
    path = tmp_path / "events.jsonl"
    Path(f"{path}.lock").write_bytes(b"node2.4242.1.dead")  # killed between create and unlink
    t0 = time.monotonic()
    EventLog(path).emit("attempt_start")
    assert 0.2 <= time.monotonic() - t0 < 5.0
    assert [e["kind"] for e in read_events(path)] == ["attempt_start"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl"]


def test_a_lock_that_never_frees_delays_a_record_but_never_loses_it(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(events_mod, "_LOCK_WAIT_S", 0.3)
    monkeypatch.setattr(events_mod, "_LOCK_STALE_S", 60.0)
    path = tmp_path / "events.jsonl"
    with exclusive(path):
        EventLog(path).emit("decision", action="requeue")
    assert [e["kind"] for e in read_events(path)] == ["decision"]


def _add_many(run_dir: str, worker: int) -> None:
    for i in range(25):
        quarantine.add_to_quarantine(run_dir, [f"node{worker}-{i}"], reason="test", incident=f"{worker}.{i}")


def test_concurrent_additions_to_the_quarantine_list_are_all_kept(tmp_path: Path) -> None:
    # Before: each adder read the list, added its node and renamed its copy over the others': nodes were lost.
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_add_many, args=(str(tmp_path), w)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0, 0]
    assert len({e["node"] for e in quarantine.quarantined(tmp_path)}) == 100
