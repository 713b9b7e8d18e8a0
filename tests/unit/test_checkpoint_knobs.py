"""checkpoint.lustre_stripe_count and checkpoint.writer_threads, executed: the `lfs setstripe` command a save
runs on its empty temporary folder (a stand-in `lfs` on PATH records it; this machine has none), the
warning when `lfs` is absent, and one shard file per writer thread that loads back bit for bit."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch

from checkpoint import CheckpointConfig, CheckpointManager
from checkpoint.manifest import read_manifest


def _model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 16)).square().mean().backward()
    opt.step()
    return model, opt


def _save(folder: Path, cfg: CheckpointConfig, step: int = 1):
    model, opt = _model()
    ck = CheckpointManager(folder, cfg=cfg)
    ck.load_latest(model_parts=[model], optimizers=[opt])
    ck.save(step)
    ck.close()
    return model, opt


@pytest.fixture
def lfs_log(tmp_path, monkeypatch) -> Path:
    """A stand-in `lfs` first on PATH; it records its arguments and what the folder held when it ran."""
    bin_dir, log = tmp_path / "bin", tmp_path / "lfs.log"
    bin_dir.mkdir()
    lfs = bin_dir / "lfs"
    lfs.write_text(f'#!/bin/sh\necho "$@" >> {log}\nls -A "$4" | wc -l >> {log}\n')
    lfs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_a_stripe_count_runs_lfs_setstripe_on_the_empty_temporary_folder_before_any_shard(tmp_path, lfs_log):
    ck = tmp_path / "checkpoints"
    _save(ck, CheckpointConfig(every_steps=1, async_mode="none", lustre_stripe_count=4))
    tmp = ck / f"step_1.pid{os.getpid()}.tmp"  # this process's temporary folder (no attempt given)
    assert lfs_log.read_text().split("\n") == [f"setstripe -c 4 {tmp}", "0", ""]
    assert read_manifest(ck / "step_1", step=1)["step"] == 1


def test_no_stripe_count_never_runs_lfs(tmp_path, lfs_log):
    _save(tmp_path / "checkpoints", CheckpointConfig(every_steps=1, async_mode="none"))
    assert not lfs_log.exists()


def test_a_stripe_count_without_lfs_warns_naming_the_knob_and_saves_unstriped(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr("shutil.which", lambda name, *a, **k: None if name == "lfs" else "/usr/bin/" + name)
    with caplog.at_level(logging.WARNING):
        _save(tmp_path, CheckpointConfig(every_steps=1, async_mode="none", lustre_stripe_count=4))
    assert "checkpoint.lustre_stripe_count=4 but `lfs` is not on PATH; striping left alone" in caplog.text
    assert read_manifest(tmp_path / "step_1", step=1)["step"] == 1


@pytest.mark.parametrize("async_mode", ["none", "thread"])
def test_writer_threads_write_one_shard_file_each_that_load_back_bitwise(tmp_path, async_mode):
    model, opt = _save(tmp_path, CheckpointConfig(every_steps=1, async_mode=async_mode, writer_threads=3))
    files = read_manifest(tmp_path / "step_1", step=1)["files"]
    assert sorted(n for n in files if n.endswith(".distcp")) == ["__0_0.distcp", "__0_1.distcp", "__0_2.distcp"]
    assert all(files[n]["size"] > 0 for n in files)
    torch.manual_seed(99)
    other = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    other_opt = torch.optim.AdamW(other.parameters(), lr=0.1)
    ck = CheckpointManager(tmp_path, cfg=CheckpointConfig(every_steps=1, async_mode="none"))
    assert ck.load_latest(model_parts=[other], optimizers=[other_opt]) == 1
    ck.close()
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), name
        assert torch.equal(opt.state[p]["exp_avg_sq"], other_opt.state[q]["exp_avg_sq"]), name
