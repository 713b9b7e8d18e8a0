"""Retention and the abandoned timeline (checkpoint/retention.py) on committed-looking step folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointConfig, CheckpointManager
from checkpoint.manifest import file_record, step_dirs, write_manifest
from checkpoint.retention import abandon_above, manifest_crc, retain


def _commit(folder: Path, step: int) -> Path:
    d = folder / f"step_{step}"
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(bytes([step % 256]) * 64)
    write_manifest(d, {"step": step, "files": {".metadata": file_record(d / ".metadata")}})
    return d


def _steps(folder: Path) -> list[int]:
    return [s for s, _ in step_dirs(folder)]


def test_retention_neither_counts_nor_deletes_folders_above_the_step_just_committed(tmp_path):
    # An abandoned timeline's 30 and 40 left in place (a crash during the rollback), then 22 committed after
    # the rollback to 20: keep=2 keeps 22 and the target 20, deletes 10, leaves 30 and 40 alone.
    for s in (10, 20, 30, 40, 22):
        _commit(tmp_path, s)
    events: list[tuple[str, dict]] = []
    retain(tmp_path, keep=2, emit=lambda k, **f: events.append((k, f)), newest=22)
    assert _steps(tmp_path) == [40, 30, 22, 20]
    assert [(k, f["step"]) for k, f in events] == [("checkpoint_deleted", 10)]


def test_without_the_newest_step_retention_counts_every_folder_newest_first(tmp_path):
    for s in (10, 20, 30, 40, 22):
        _commit(tmp_path, s)
    retain(tmp_path, keep=2, emit=lambda *a, **k: None)
    assert _steps(tmp_path) == [40, 30]  # what the trainer did before: the rollback target 20 deleted


def test_retention_never_deletes_the_step_just_committed_even_with_keep_one_and_a_newer_sound_one(tmp_path):
    for s in (5, 9):
        _commit(tmp_path, s)
    retain(tmp_path, keep=1, emit=lambda *a, **k: None, newest=5)
    assert _steps(tmp_path) == [9, 5]


def test_abandon_above_moves_the_later_folders_aside_under_the_attempt_and_twice_without_clobbering(tmp_path):
    for s in (10, 20, 30, 40):
        _commit(tmp_path, s)
    moved = abandon_above(tmp_path, step=20, attempt="123.0")
    assert [(s, a.relative_to(tmp_path).as_posix()) for s, _, a in moved] == [
        (40, "abandoned/step_40.123.0"),
        (30, "abandoned/step_30.123.0"),
    ]
    assert _steps(tmp_path) == [20, 10]
    _commit(tmp_path, 30)  # the redone step 30, abandoned again by a second rollback in the same attempt
    [(s, _, again)] = abandon_above(tmp_path, step=20, attempt="123.0")
    assert s == 30 and again.name.startswith("step_30.123.0.") and (again / "manifest.json").exists()
    assert len(list((tmp_path / "abandoned").iterdir())) == 3
    assert abandon_above(tmp_path, step=20, attempt="123.0") == []


def _rchar() -> int:
    """Bytes this process (every thread) has read so far by read-like system calls (/proc/self/io)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


@pytest.mark.parametrize("mode", ["none", "thread"])
def test_a_save_and_its_retention_read_no_checkpoint_bytes_back(tmp_path, monkeypatch, mode):
    # Before: retention re-read each new checkpoint in full once after its save (12.6 MB each here).
    import checkpoint.manifest as manifest_mod

    summed: list[int] = []
    orig = manifest_mod._crc32_fd
    monkeypatch.setattr(manifest_mod, "_crc32_fd", lambda fd: summed.append(fd) or orig(fd))
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 1024)).sum().backward()
    opt.step()  # the optimizer state exists: params + two moments, ~12.6 MB a checkpoint
    ck = CheckpointManager(tmp_path, cfg=CheckpointConfig(every_steps=1, async_mode=mode, keep=2, verify="checksum"))
    ck.load_latest(model_parts=[model], optimizers=[opt])
    read = 0
    for step in range(1, 6):
        before = _rchar()
        ck.save(step)
        ck.wait()
        ck.committer.wait_retention()  # retention (a thread of its own) included
        read += _rchar() - before
    ck.close()
    assert _steps(tmp_path) == [5, 4]  # retention ran and deleted 1, 2 and 3
    nbytes = sum(f.stat().st_size for f in (tmp_path / "step_5").iterdir())
    assert nbytes > 12e6 and summed == []
    assert read < 256 << 10, (read, nbytes)  # the manifests only (a few KB each), never a shard


def test_a_checkpoint_the_load_skipped_is_neither_counted_nor_deleted_by_retention(tmp_path):
    # Sizes check out on all three; the load found step 30's crc32 wrong. keep=2 keeps 40 and 20, deletes 10.
    for s in (10, 20, 30, 40):
        _commit(tmp_path, s)
    events: list[tuple[str, dict]] = []
    damaged = {(30, manifest_crc(tmp_path / "step_30"))}
    retain(tmp_path, keep=2, emit=lambda k, **f: events.append((k, f)), newest=40, damaged=damaged)
    assert _steps(tmp_path) == [40, 30, 20]
    assert [(k, f["step"]) for k, f in events] == [("checkpoint_deleted", 10)]
    # Another commit of step 30 (another manifest crc32) is not the damaged one: counted again.
    retain(tmp_path, keep=2, emit=lambda *a, **k: None, newest=40, damaged={(30, "0badc0de")})
    assert _steps(tmp_path) == [40, 30]
