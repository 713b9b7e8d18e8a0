"""Retention and the abandoned timeline (checkpoint/retention.py) on committed-looking step folders."""

from __future__ import annotations

from pathlib import Path

from checkpoint.manifest import file_record, step_dirs, write_manifest
from checkpoint.retention import abandon_above, retain


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
    retain(tmp_path, keep=2, verify="size", emit=lambda k, **f: events.append((k, f)), newest=22)
    assert _steps(tmp_path) == [40, 30, 22, 20]
    assert [(k, f["step"]) for k, f in events] == [("checkpoint_deleted", 10)]


def test_without_the_newest_step_retention_counts_every_folder_newest_first(tmp_path):
    for s in (10, 20, 30, 40, 22):
        _commit(tmp_path, s)
    retain(tmp_path, keep=2, verify="size", emit=lambda *a, **k: None)
    assert _steps(tmp_path) == [40, 30]  # what the trainer did before: the rollback target 20 deleted


def test_retention_never_deletes_the_step_just_committed_even_with_keep_one_and_a_newer_sound_one(tmp_path):
    for s in (5, 9):
        _commit(tmp_path, s)
    retain(tmp_path, keep=1, verify="checksum", emit=lambda *a, **k: None, newest=5)
    assert _steps(tmp_path) == [9, 5]


def test_abandon_above_moves_the_later_folders_aside_under_the_attempt_and_twice_without_clobbering(tmp_path):
    for s in (10, 20, 30, 40):
        _commit(tmp_path, s)
    moved = abandon_above(tmp_path, step=20, attempt="123.0")
    assert [(s, a.relative_to(tmp_path).as_posix()) for s, _, a in moved] == [
        (40, "abandoned/step_40.123.0"), (30, "abandoned/step_30.123.0")]
    assert _steps(tmp_path) == [20, 10]
    _commit(tmp_path, 30)  # the redone step 30, abandoned again by a second rollback in the same attempt
    [(s, _, again)] = abandon_above(tmp_path, step=20, attempt="123.0")
    assert s == 30 and again.name.startswith("step_30.123.0.") and (again / "manifest.json").exists()
    assert len(list((tmp_path / "abandoned").iterdir())) == 3
    assert abandon_above(tmp_path, step=20, attempt="123.0") == []


def test_retention_reads_each_checkpoint_back_at_most_once_across_saves(tmp_path, monkeypatch):
    import collections

    import torch

    import checkpoint.manifest as manifest_mod
    from checkpoint import CheckpointConfig, CheckpointManager

    reads: collections.Counter = collections.Counter()
    orig = manifest_mod._crc32_path
    monkeypatch.setattr(manifest_mod, "_crc32_path", lambda p: reads.update([p.parent.name]) or orig(p))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    ck = CheckpointManager(tmp_path, cfg=CheckpointConfig(every_steps=1, async_mode="none", keep=2, verify="checksum"))
    ck.load_latest(model_parts=[model], optimizers=[opt])
    files = {}
    for step in range(1, 7):
        ck.save(step)
        ck._retaining.result()
        files[step] = len(list((tmp_path / f"step_{step}").iterdir())) - 1  # all but the manifest
    ck.close()
    assert _steps(tmp_path) == [6, 5]
    # Before: the newest keep=2 were read in full after every save (step 5: after saves 5 and 6, and so on).
    assert {d: n for d, n in reads.items()} == {f"step_{s}": files[s] for s in range(2, 7)}
