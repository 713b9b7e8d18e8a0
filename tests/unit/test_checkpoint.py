"""Checkpoint pieces without processes: manifest validation, fingerprint diff, config checks, RNG/train state, single-process manager."""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import threading
import time
import zlib

import numpy as np
import pytest
import torch

import checkpoint.commit as commit_mod
import checkpoint.statedict as statedict_mod
from checkpoint import CheckpointConfig, CheckpointManager, TrainState, diff_fingerprint, env_fingerprint
from checkpoint.manifest import (
    MANIFEST,
    ManifestError,
    check_files,
    file_record,
    read_manifest,
    step_dirs,
    verify_share,
    write_manifest,
)
from checkpoint.state import capture_rng, restore_rng


def _committed(tmp_path, step=3):
    d = tmp_path / f"step_{step}"
    d.mkdir()
    (d / ".metadata").write_bytes(b"meta")
    (d / "__0_0.distcp").write_bytes(b"x" * 1000)
    files = {n: file_record(d / n) for n in (".metadata", "__0_0.distcp")}
    write_manifest(d, {"step": step, "files": files, "world_size": 1})
    return d, files


def test_each_rank_checks_the_shards_it_reads_back_so_a_restart_reads_each_byte_from_storage_once():
    names = [".metadata", "__1_1.distcp", "__0_0.distcp", "__1_0.distcp", "__0_1.distcp", "manifest-extra"]
    # the same world size: a rank checks its own shards (its load reads those, then from its node's page cache)
    assert verify_share(names, rank=0, world_size=2) == [".metadata", "__0_0.distcp", "__0_1.distcp"]
    assert verify_share(names, rank=1, world_size=2) == ["__1_0.distcp", "__1_1.distcp", "manifest-extra"]
    # saved by 4 ranks, loaded by 2: the shards of ranks 2 and 3 and the other files shared out, each checked once
    four = [".metadata"] + [f"__{r}_{i}.distcp" for r in range(4) for i in range(2)]
    shares = [verify_share(four, rank=r, world_size=2) for r in range(2)]
    assert shares[0] == [".metadata", "__0_0.distcp", "__0_1.distcp", "__2_1.distcp", "__3_1.distcp"]
    assert shares[1] == ["__1_0.distcp", "__1_1.distcp", "__2_0.distcp", "__3_0.distcp"]
    assert sorted(shares[0] + shares[1]) == sorted(four)


def test_manifest_round_trips_and_detects_each_kind_of_damage(tmp_path):
    d, files = _committed(tmp_path)
    m = read_manifest(d, step=3)
    assert m["files"] == files and files["__0_0.distcp"] == {"size": 1000, "crc32": f"{zlib.crc32(b'x' * 1000):08x}"}
    assert check_files(d, m["files"], sorted(files), checksum=True) == []
    with pytest.raises(ManifestError, match="says step 3"):
        read_manifest(d, step=4)
    # a flipped byte keeps the size: only the checksum notices
    (d / "__0_0.distcp").write_bytes(b"x" * 999 + b"y")
    assert check_files(d, m["files"], sorted(files), checksum=False) == []
    assert "crc32" in check_files(d, m["files"], sorted(files), checksum=True)[0]
    (d / "__0_0.distcp").write_bytes(b"x" * 10)
    assert "10 bytes, manifest says 1000" in check_files(d, m["files"], sorted(files), checksum=True)[0]
    (d / "__0_0.distcp").unlink()
    assert check_files(d, m["files"], ["__0_0.distcp"], checksum=True) == ["__0_0.distcp missing"]
    # an edited manifest fails its own checksum; a truncated one is not JSON; a missing one is uncommitted
    body = json.loads((d / MANIFEST).read_text())
    body["step"] = 3
    body["world_size"] = 2
    (d / MANIFEST).write_text(json.dumps(body))
    with pytest.raises(ManifestError, match="checksum mismatch"):
        read_manifest(d)
    (d / MANIFEST).write_text('{"step": 3, "fi')
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(d)
    (d / MANIFEST).unlink()
    with pytest.raises(ManifestError, match="no manifest.json"):
        read_manifest(d)


def test_step_dirs_lists_committed_names_newest_first_and_ignores_temp_ones(tmp_path):
    for name in ("step_2", "step_10", "step_3.tmp", "step_4.uncommitted-1", "other"):
        (tmp_path / name).mkdir()
    assert [s for s, _ in step_dirs(tmp_path)] == [10, 2]
    assert step_dirs(tmp_path / "absent") == []


def test_fingerprint_diff_names_what_changed_and_ignores_hosts():
    a = env_fingerprint(hosts=["n1"], environ={"NCCL_ALGO": "Ring", "HOME": "/x"})
    assert a["env"] == {"NCCL_ALGO": "Ring"} and a["torch"] == torch.__version__
    # the installed torch distribution's own version string (a local build tag such as +cpu included)
    assert a["distributions"]["torch"] == importlib.metadata.version("torch")
    assert a["distributions"]["numpy"] == importlib.metadata.version("numpy")
    b = json.loads(json.dumps(a))
    b["hosts"] = ["n7", "n8"]
    assert diff_fingerprint(a, b) == {}
    b["env"]["NCCL_ALGO"] = "Tree"
    b["distributions"]["numpy"] = "0.0.1"
    b["torch"] = "9.9"
    d = diff_fingerprint(a, b)
    assert d["env.NCCL_ALGO"] == ["Ring", "Tree"] and d["torch"] == [a["torch"], "9.9"]
    assert d["distributions.numpy"] == [a["distributions"].get("numpy"), "0.0.1"]
    assert "hosts" not in d and "distributions_sha256" not in d


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("keep", 1, r"checkpoint.keep\(1\) must be >= 2"),
        ("async_mode", "fork", "checkpoint.async_mode='fork'"),
        ("interval", "daily", "checkpoint.interval='daily'"),
        ("on_env_drift", "ignore", "checkpoint.on_env_drift='ignore'"),
        ("every_steps", -1, r"checkpoint.every_steps\(-1\)"),
        ("writer_threads", 0, r"checkpoint.writer_threads\(0\)"),
        ("verify", "none", "checkpoint.verify='none'"),
    ],
)
def test_checkpoint_config_rejects_bad_values_naming_the_override(field, value, message):
    with pytest.raises(ValueError, match=message):
        CheckpointConfig(**{field: value})


def test_auto_interval_needs_an_mtbf(tmp_path):
    with pytest.raises(ValueError, match="failure.mtbf_job_hours"):
        CheckpointManager(tmp_path, cfg=CheckpointConfig(interval="auto"))


def test_rng_capture_restore_replays_every_generator():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = capture_rng()
    first = (random.random(), float(np.random.rand()), float(torch.rand(())))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    assert restore_rng(state) == ["python", "torch", "numpy"]
    assert (random.random(), float(np.random.rand()), float(torch.rand(()))) == first


def test_train_state_keeps_a_bounded_loss_tail():
    st = TrainState(tail_len=3)
    for s in range(1, 6):
        st.record(step=s, loss=float(s), tokens=10)
    assert st.state_dict() == {"step": 5, "tokens_seen": 50, "loss_tail": [3.0, 4.0, 5.0], "health": {}, "data": {}}
    other = TrainState()
    other.load_state_dict(st.state_dict())
    assert other.step == 5 and other.loss_tail == [3.0, 4.0, 5.0]


class _Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(4, 4), "1": torch.nn.Linear(4, 4)})

    def forward(self, x):
        return self.layers["1"](torch.relu(self.layers["0"](x)))


def _step(model_parts, opts, x):
    mods = {name: m for part in model_parts for name, m in part.layers.items()}
    mods["1"](torch.relu(mods["0"](x))).square().mean().backward()
    for o in opts:
        o.step()
        o.zero_grad()


def test_two_stages_on_one_rank_resume_into_one_model(tmp_path):
    """A rank holding two pipeline stages (two model parts, two optimizers) saves; one model loads it."""
    torch.manual_seed(0)
    full = _Two()
    a, b = _Two(), _Two()
    a.load_state_dict(full.state_dict()), b.load_state_dict(full.state_dict())
    del a.layers["1"], b.layers["0"]  # stage 0 keeps layers.0, stage 1 keeps layers.1 (FQNs kept)
    opts = [torch.optim.AdamW(p.parameters(), lr=0.1) for p in (a, b)]
    x = torch.randn(8, 4)
    cfg = CheckpointConfig(every_steps=1, async_mode="none")
    ck = CheckpointManager(tmp_path, cfg=cfg, manifest_extra={"mesh": "pp2 (2 stages, 1 rank)"})
    assert ck.load_latest(model_parts=[a, b], optimizers=opts, train_state=TrainState()) == 0
    _step([a, b], opts, x)
    ck.save(1)
    ck.close()
    files = read_manifest(tmp_path / "step_1", step=1)["files"]
    assert ".metadata" in files and "__0_0.distcp" in files

    torch.manual_seed(123)
    one = _Two()
    one_opt = torch.optim.AdamW(one.parameters(), lr=0.1)
    ck2 = CheckpointManager(tmp_path, cfg=cfg, manifest_extra={"mesh": "pp1"})
    st = TrainState()
    assert ck2.load_latest(model_parts=[one], optimizers=[one_opt], train_state=st) == 1
    ck2.close()
    for name, p in one.named_parameters():
        src = (a if name.startswith("layers.0") else b).get_parameter(name)
        assert torch.equal(p, src), name
        assert torch.equal(
            one_opt.state[p]["exp_avg"], opts[0 if name.startswith("layers.0") else 1].state[src]["exp_avg"]
        )
    # and the next step on one model equals the next step on the two stages
    _step([a, b], opts, x)
    _step([one], [one_opt], x)
    for name, p in one.named_parameters():
        assert torch.equal(p, (a if name.startswith("layers.0") else b).get_parameter(name)), name


def _flip_middle_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _rotting(monkeypatch, steps: set[int]) -> None:
    """A byte of rank 0's shard flipped (same size) right after the commit of each of `steps`."""
    orig_write = commit_mod.write_manifest

    def write_then_rot(step_dir, body):
        orig_write(step_dir, body)
        if body["step"] in steps:
            _flip_middle_byte(step_dir / "__0_0.distcp")

    monkeypatch.setattr(commit_mod, "write_manifest", write_then_rot)


def _save_steps(folder, steps, events, model, opt, x, **cfg) -> None:
    ck = CheckpointManager(
        folder,
        cfg=CheckpointConfig(every_steps=1, async_mode="none", keep=2, **cfg),
        emit=lambda kind, **f: events.append((kind, f)),
    )
    ck.load_latest(model_parts=[model], optimizers=[opt])
    for step in steps:
        _step([model], [opt], x)
        ck.save(step)
    ck.close()


def test_a_checkpoint_with_a_flipped_byte_is_never_loaded_and_retention_trusts_the_commits_crc32(tmp_path, monkeypatch):
    """Retention reads no checkpoint back (it trusts the crc32 taken from the bytes as written): damage after
    the commit is the load's to find. keep=2 is the fallback for one damaged checkpoint."""
    _rotting(monkeypatch, {3})
    torch.manual_seed(0)
    model, x = _Two(), torch.randn(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    events: list[tuple[str, dict]] = []
    _save_steps(tmp_path, (1, 2, 3), events, model, opt, x)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]  # 3 counted by its sizes
    # The load skips 3 (crc32) and loads 2; the next save keeps 4 and 2: the skipped 3 is not counted (nor deleted).
    fresh = _Two()
    _save_steps(tmp_path, (4,), events, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1), x)
    assert [(f["step"], "crc32" in f["reason"]) for k, f in events if k == "checkpoint_skipped"] == [(3, True)]
    assert [f["step"] for k, f in events if k == "checkpoint_loaded"] == [2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3", "step_4"]


def test_the_newest_keep_checkpoints_all_damaged_after_their_commit_load_none_rather_than_a_damaged_one(
    tmp_path, monkeypatch
):
    """The limit of trusting the commit's crc32 (before, retention re-read each new checkpoint once, from the
    page cache, and kept step 1 here): with both of the newest keep=2 flipped, none loads, and no damaged one."""
    _rotting(monkeypatch, {2, 3})
    torch.manual_seed(0)
    model, x = _Two(), torch.randn(8, 4)
    events: list[tuple[str, dict]] = []
    _save_steps(tmp_path, (1, 2, 3), events, model, torch.optim.AdamW(model.parameters(), lr=0.1), x)
    assert [f["step"] for k, f in events if k == "checkpoint_deleted"] == [1]
    fresh = _Two()
    ck = CheckpointManager(tmp_path, cfg=CheckpointConfig(), emit=lambda kind, **f: events.append((kind, f)))
    assert ck.load_latest(model_parts=[fresh], optimizers=[torch.optim.AdamW(fresh.parameters())]) == 0
    ck.close()
    assert [f["step"] for k, f in events if k == "checkpoint_skipped"] == [3, 2]
    assert all("crc32" in f["reason"] for k, f in events if k == "checkpoint_skipped")
    kinds = [k for k, _ in events]
    assert "checkpoint_loaded" not in kinds and kinds[-1] == "checkpoint_none"


def _one_layer():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    return model, opt


def _train_step(model, opt):
    model(torch.ones(2, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_save_returns_before_the_staging_copy_and_the_optimizer_step_waits_for_it(tmp_path, monkeypatch):
    import checkpoint.writer as writer_mod

    orig_copy = writer_mod._copy_state_dict

    def slow_copy(*a, **k):
        time.sleep(0.5)
        return orig_copy(*a, **k)

    monkeypatch.setattr(writer_mod, "_copy_state_dict", slow_copy)
    model, opt = _one_layer()
    ck = CheckpointManager(tmp_path, cfg=CheckpointConfig(every_steps=1, async_mode="thread"))
    ck.load_latest(model_parts=[model], optimizers=[opt])
    _train_step(model, opt)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    t0 = time.perf_counter()
    ck.save(1)
    assert time.perf_counter() - t0 < 0.3  # the 0.5 s copy runs behind save()
    _train_step(model, opt)  # changes the parameters: must wait for the copy first
    assert not torch.equal(model.weight, at_save["weight"])
    ck.close()
    fresh, fresh_opt = _one_layer()
    fresh.weight.data.zero_()
    assert (
        CheckpointManager(tmp_path, cfg=CheckpointConfig()).load_latest(model_parts=[fresh], optimizers=[fresh_opt])
        == 1
    )
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_save[k]), k  # step 1's values, not step 2's


def test_the_state_dict_structure_is_built_once_and_each_save_has_the_current_lr(tmp_path, monkeypatch):
    calls = []
    orig = statedict_mod.get_model_state_dict
    monkeypatch.setattr(statedict_mod, "get_model_state_dict", lambda *a, **k: calls.append(1) or orig(*a, **k))
    model, opt = _one_layer()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    ck = CheckpointManager(tmp_path, cfg=CheckpointConfig(every_steps=1, async_mode="thread", keep=5))
    ck.load_latest(model_parts=[model], optimizers=[opt], lr_schedulers=[sched])
    calls.clear()
    lrs = {}
    for step in (1, 2, 3):
        _train_step(model, opt)
        sched.step()
        lrs[step] = opt.param_groups[0]["lr"]
        ck.save(step)
    ck.close()
    assert len(calls) == 1 and len(set(lrs.values())) == 3
    for step in (1, 3):
        fresh, fresh_opt = _one_layer()
        monkeypatch.setattr(commit_mod, "step_dirs", lambda folder, s=step: [(s, folder / f"step_{s}")])
        CheckpointManager(tmp_path, cfg=CheckpointConfig()).load_latest(model_parts=[fresh], optimizers=[fresh_opt])
        assert fresh_opt.param_groups[0]["lr"] == lrs[step], step


def test_each_file_is_fsynced_once_and_summed_as_written_not_read_back(tmp_path, monkeypatch):
    import stat

    import checkpoint.manifest as manifest_mod

    synced: list[str] = []
    orig_fsync = os.fsync

    def spy_fsync(fd):
        synced.append("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file")
        return orig_fsync(fd)

    def no_read_back(*a, **k):
        raise AssertionError("a file of the save was read back for its crc32")

    model, opt = _one_layer()
    ck = CheckpointManager(tmp_path, cfg=CheckpointConfig(every_steps=1, async_mode="none"))
    ck.load_latest(model_parts=[model], optimizers=[opt])
    _train_step(model, opt)
    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(manifest_mod, "_crc32_fd", no_read_back)
    ck.save(1)
    ck.close()
    monkeypatch.undo()
    files = read_manifest(tmp_path / "step_1", step=1)["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp"]
    # DCP's shard and .metadata, then the manifest; the temporary folder and its parent
    assert synced.count("file") == 3 and synced.count("dir") == 2, synced
    assert check_files(tmp_path / "step_1", files, sorted(files), checksum=True) == []


def test_torch_save_skips_the_zip_crc32_only_while_a_checkpoint_is_written(tmp_path, monkeypatch):
    seen = []
    orig_save = torch.save

    def spy_save(*a, **k):
        if k.get("_use_new_zipfile_serialization", True):  # the legacy format (pickled RNG state) has no zip crc32
            seen.append(torch.serialization.get_crc32_options())
        return orig_save(*a, **k)

    monkeypatch.setattr(torch, "save", spy_save)
    model, opt = _one_layer()
    ck = CheckpointManager(tmp_path, cfg=CheckpointConfig(every_steps=1, async_mode="thread"))
    ck.load_latest(model_parts=[model], optimizers=[opt])
    _train_step(model, opt)
    ck.save(1)
    ck.close()
    assert seen and not any(seen)
    assert torch.serialization.get_crc32_options() is True


def test_retention_runs_behind_the_commit_and_close_waits_for_it(tmp_path, monkeypatch):
    release, started = threading.Event(), threading.Event()
    monkeypatch.setattr(commit_mod.Committer, "_retain", lambda self, newest: started.set() or release.wait(30))
    model, opt = _one_layer()
    ck = CheckpointManager(tmp_path, cfg=CheckpointConfig(every_steps=1, async_mode="thread"))
    ck.load_latest(model_parts=[model], optimizers=[opt])
    _train_step(model, opt)
    ck.save(1)
    waiter = threading.Thread(target=ck.wait)
    waiter.start()
    waiter.join(timeout=5)
    blocked = waiter.is_alive()
    release.set()
    waiter.join()
    assert started.wait(5) and not blocked  # the commit was done while retention still ran
    ck.close()
    assert read_manifest(tmp_path / "step_1", step=1)["step"] == 1


def test_the_auto_interval_counts_what_an_async_save_takes_from_the_steps_it_overlaps(tmp_path):
    # B8 (scripts/bench/goodput.py) on 2 cores: each async save took 0.65 s from the steps around it but
    # blocked for 0.02 s, and the interval, computed from the 0.02 s, saved every 8 steps instead of ~40.
    model, opt = _one_layer()
    ck = CheckpointManager(
        tmp_path, cfg=CheckpointConfig(interval="auto", async_mode="thread"), mtbf_s=3600.0, total_steps=1000
    )
    ck.load_latest(model_parts=[model], optimizers=[opt])
    for step in range(1, 11):
        ck.due(step, step_time_s=0.1)  # steps no save overlaps: 0.1 s
    ck.save(10)
    ck.wait()  # committed; the step after it still paid for the write it overlapped
    ck.due(11, step_time_s=0.9)
    ck.save(11)
    assert ck.last_plan["delta_s"] >= 0.8  # the previous save's blocking part + 0.8 s taken from step 11
    ck.close()
