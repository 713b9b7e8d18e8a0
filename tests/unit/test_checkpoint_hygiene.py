"""Checkpoint hygiene: temporary and moved-aside folders are per attempt and cleaned at the next attempt's load
(checkpoint/manager.py, commit.py); the ledger records that budgets depend on are fsync'ed (jobs/events.py)."""

from __future__ import annotations

import os

import torch

import checkpoint.commit as commit_mod
from checkpoint import CheckpointConfig, CheckpointManager
from jobs import events as events_mod
from jobs.events import EventLog, read_events


def test_budget_records_are_fsynced_and_the_others_are_not(tmp_path, monkeypatch):
    synced: list[str] = []
    orig = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return orig(fd)

    monkeypatch.setattr(events_mod.os, "fsync", spy)
    log = EventLog(tmp_path / "events.jsonl", attempt="1.0")
    kinds = [
        "attempt_start",
        "train_start",
        "checkpoint_saved",
        "heartbeat",
        "failure",
        "decision",
        "attempt_end",
        "checkpoint_deleted",
    ]
    fsyncs = []
    for kind in kinds:
        before = len(synced)
        log.emit(kind, step=1)
        fsyncs.append(len(synced) - before)
    assert dict(zip(kinds, fsyncs)) == {
        "attempt_start": 1,
        "train_start": 0,
        "checkpoint_saved": 1,
        "heartbeat": 0,
        "failure": 1,
        "decision": 1,
        "attempt_end": 1,
        "checkpoint_deleted": 0,
    }
    assert set(synced) == {str(tmp_path / "events.jsonl")}
    assert [e["kind"] for e in read_events(tmp_path / "events.jsonl")] == kinds


def _manager(folder, attempt: str, events: list) -> tuple[CheckpointManager, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ck = CheckpointManager(
        folder,
        cfg=CheckpointConfig(every_steps=1, async_mode="none", keep=5),
        attempt=attempt,
        emit=lambda kind, **f: events.append((kind, f)),
    )
    ck.load_latest(model_parts=[model], optimizers=[opt])
    return ck, model


def test_a_save_writes_into_a_folder_named_by_its_attempt_and_moves_a_folder_in_its_way_aside_by_attempt(
    tmp_path, monkeypatch
):
    seen: list[str] = []
    orig = commit_mod.write_manifest
    monkeypatch.setattr(commit_mod, "write_manifest", lambda d, body: seen.append(d.name) or orig(d, body))
    (tmp_path / "step_1").mkdir(parents=True)  # a step_1 without a manifest in the way
    events: list = []
    ck, _ = _manager(tmp_path, "77.2", events)
    ck.save(1)
    ck.close()
    assert seen == ["step_1.77.2.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1", "step_1.uncommitted-77.2"]


def test_the_next_attempt_removes_earlier_attempts_folders_and_never_its_own(tmp_path):
    names = [
        "step_3.tmp",
        "step_4.76.0.tmp",
        "step_2.uncommitted-1733",
        "step_5.uncommitted-76.0",
        "step_6.77.2.tmp",
        "step_2.uncommitted-77.2",
        "step_2.uncommitted-77.2.99",
    ]
    for n in names:
        (tmp_path / n).mkdir(parents=True)
        (tmp_path / n / "__0_0.distcp").write_bytes(b"x")
    events: list = []
    _manager(tmp_path, "77.2", events)[0].close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[4:])  # this attempt's (77.2) stay
    removed = sorted(f["path"].rsplit("/", 1)[1] for k, f in events if k == "checkpoint_tmp_removed")
    assert removed == sorted(names[:4])


def test_a_dcp_save_that_fails_on_a_rank_is_described_by_that_ranks_own_error(tmp_path) -> None:
    """DCP wraps each rank's error in one CheckpointException whose first line names only the ranks
    ("CheckpointException ranks:dict_keys([1])": a chaos run's reference save failed so, its cause lost)."""
    import errno

    import torch
    import torch.distributed.checkpoint as dcp

    from checkpoint.errors import describe_error

    class Failing(dcp.FileSystemWriter):
        def __init__(self, path, err: OSError) -> None:
            super().__init__(path)
            self.err = err

        def write_data(self, plan, planner):
            raise self.err

    def failed(err: OSError) -> BaseException:
        try:
            dcp.save({"w": torch.ones(3)}, storage_writer=Failing(tmp_path / "ckpt", err))
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            return e
        raise AssertionError("the save did not fail")

    e = failed(OSError(errno.EIO, "Input/output error"))
    assert (
        describe_error(e, tmp_path)
        == "CheckpointException on rank(s) [0]: rank 0: OSError: [Errno 5] Input/output error"
    )
    # a full disk inside the wrapper is named as such, with the fix
    assert describe_error(failed(OSError(errno.ENOSPC, "disk")), tmp_path).startswith("no space left on device under ")
