"""CheckpointManager on real files with 2 FSDP2 ranks: corruption fallback, full disk, env drift, async modes, retention, interval.

What these prove, and what they do not: the ranks run tests/multiproc/_harness.py (a small FSDP2 model and
loop that drives CheckpointManager directly), not jobs/trainer.py, and the harness reports a fabricated
step time (0.01 s) to the manager, so the interval test checks the arithmetic on measured save costs, not
a real run's cadence; the kills are placed by patches inside the harness (kill_before_rename, stall_write),
at exactly the instant named. The trainer's own async save killed from outside is
tests/multiproc/test_kill_during_async_save.py (local launcher) and the chaos tier (Slurm)."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

import checkpoint.statedict as statedict_mod
from checkpoint.manifest import MANIFEST, check_step_dir, read_manifest, step_dirs
from jobs.events import read_events
from tests.multiproc._harness import mesh_ckpt, train
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.multiproc

DP2 = {"dp_shard": 2}


def _run(run_dir: Path, steps: int, *, world: int = 2, mesh=DP2, env=None, allow_kill=False, patch=None, **ck):
    return run_ranks(
        train,
        world,
        run_dir=str(run_dir),
        mesh=mesh,
        steps=steps,
        ckpt=mesh_ckpt(**{"every_steps": 2, **ck}),
        allow_kill=allow_kill,
        env=env,
        patch=patch,
    )


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory):
    """An uninterrupted 4-step run with saves at 2 and 4: the reference losses."""
    run = tmp_path_factory.mktemp("four")
    return run, _run(run, 4).results[0]["losses"]


def _copy_run(src: Path, dst: Path) -> None:
    subprocess.run(["cp", "-a", f"{src}/checkpoints", str(dst)], check=True)


def _shard(step_dir: Path) -> Path:
    return sorted(step_dir.glob("__1_*.distcp"))[0]


@pytest.mark.parametrize("damage", ["truncate_shard", "delete_manifest", "flip_byte", "truncate_manifest"])
def test_damaged_newest_checkpoint_is_reported_skipped_and_kept(four_steps, tmp_path, damage):
    ref_run, ref_losses = four_steps
    _copy_run(ref_run, tmp_path)
    newest = tmp_path / "checkpoints/step_4"
    if damage == "truncate_shard":
        p = _shard(newest)
        os.truncate(p, p.stat().st_size // 2)
    elif damage == "delete_manifest":
        (newest / MANIFEST).unlink()
    elif damage == "flip_byte":
        p = _shard(newest)
        data = bytearray(p.read_bytes())
        data[len(data) // 2] ^= 0xFF
        p.write_bytes(bytes(data))
    else:
        m = newest / MANIFEST
        m.write_bytes(m.read_bytes()[:40])
    res = _run(tmp_path, 4)
    assert res.results[0]["start"] == 2
    assert res.results[0]["losses"] == {3: ref_losses[3], 4: ref_losses[4]}  # bitwise from step_2
    skipped = read_events(tmp_path / "events.jsonl", "checkpoint_skipped")
    assert [e["step"] for e in skipped] == [4]
    reason = {
        "truncate_shard": "truncated",
        "delete_manifest": "no manifest.json",
        "flip_byte": "crc32",
        "truncate_manifest": "not valid JSON",
    }[damage]
    assert reason in skipped[0]["reason"], skipped[0]["reason"]
    # The damaged folder was moved aside when step 4 was saved again, never deleted.
    aside = list((tmp_path / "checkpoints").glob("step_4.uncommitted-*"))
    assert len(aside) == 1
    assert read_manifest(tmp_path / "checkpoints/step_4", step=4)["step"] == 4


def _train_with_rank1_load_fault(rank, world, *, fault, **kw):
    """`train`, with rank 1 alone failing to load step_4: its `.metadata` read fails (EIO) or its
    optimizer state is refused after the read. Rank 0 sees nothing wrong."""
    if rank == 1 and fault == "metadata":

        class Reader(statedict_mod.FileSystemReader):
            def read_metadata(self, *a, **k):
                if str(self.path).endswith("step_4"):
                    raise OSError(errno.EIO, "Input/output error", f"{self.path}/.metadata")
                return super().read_metadata(*a, **k)

        statedict_mod.FileSystemReader = Reader
    elif rank == 1 and fault == "apply":
        orig, calls = statedict_mod.set_optimizer_state_dict, []

        def refuse_first(*a, **k):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("size mismatch for optim state (injected on rank 1)")
            return orig(*a, **k)

        statedict_mod.set_optimizer_state_dict = refuse_first
    return train(rank, world, **kw)


@pytest.mark.parametrize("fault", ["metadata", "apply"])
def test_a_load_failing_on_one_rank_makes_every_rank_fall_back_together(four_steps, tmp_path, fault):
    ref_run, ref_losses = four_steps
    _copy_run(ref_run, tmp_path)
    # Without agreement rank 1 moves on to step_2 while rank 0 sits in a collective of step_4 (or trains):
    # a hang, which the 60 s bound turns into a TimeoutError.
    res = run_ranks(
        _train_with_rank1_load_fault,
        2,
        fault=fault,
        run_dir=str(tmp_path),
        mesh=DP2,
        steps=4,
        ckpt=mesh_ckpt(every_steps=2),
        timeout=60.0,
    )
    assert [res.results[r]["start"] for r in (0, 1)] == [2, 2]
    assert res.results[0]["losses"] == {3: ref_losses[3], 4: ref_losses[4]}  # bitwise from step_2 on both ranks
    skipped = read_events(tmp_path / "events.jsonl", "checkpoint_skipped")
    assert [e["step"] for e in skipped] == [4]
    cause = {"metadata": "OSError: [Errno 5]", "apply": "RuntimeError: size mismatch"}[fault]
    assert "load failed on rank 1: " + cause in skipped[0]["reason"], skipped[0]["reason"]
    loaded = read_events(tmp_path / "events.jsonl", "checkpoint_loaded")
    assert [e["step"] for e in loaded] == [2]


@pytest.mark.parametrize("where", ["kill_before_rename", "kill_before_manifest", "kill_after_manifest"])
def test_kill_in_the_middle_of_a_save_falls_back_to_the_previous_checkpoint(four_steps, tmp_path, where):
    _, ref_losses = four_steps
    killed = _run(tmp_path, 4, allow_kill=True, patch=f"{where}:4", async_mode="none")
    assert killed.killed
    ck = tmp_path / "checkpoints"
    # The manifest is written inside the temporary folder and the rename commits both: wherever the
    # save dies, no step_4 exists (the old order left a step_4 without a manifest behind).
    [tmp] = ck.glob("step_4.*.tmp")  # step_<N>.<attempt>.tmp
    assert (tmp / ".metadata").exists() and not (ck / "step_4").exists()
    assert (tmp / MANIFEST).exists() == (where == "kill_after_manifest")
    res = _run(tmp_path, 4)
    assert res.results[0]["start"] == 2
    assert res.results[0]["losses"] == {3: ref_losses[3], 4: ref_losses[4]}
    ev = read_events(tmp_path / "events.jsonl")
    removed = [e for e in ev if e["kind"] == "checkpoint_tmp_removed"]
    assert removed and removed[0]["path"] == str(tmp)
    assert not [e for e in ev if e["kind"] == "checkpoint_skipped"]


def test_full_disk_fails_the_save_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    # One save of the harness is ~0.65 MB: room for step 2, not for step 4 beside it.
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root / CAP_SYS_ADMIN): {p.stderr.strip()}")
    try:
        with pytest.raises(RuntimeError) as exc:
            _run(mnt, 4, async_mode="thread")
        assert "CheckpointSaveError" in str(exc.value) and "no space left on device" in str(exc.value)
        ev = read_events(mnt / "events.jsonl")
        failed = [e for e in ev if e["kind"] == "checkpoint_failed"]
        assert failed and failed[0]["step"] == 4 and "no space left on device" in failed[0]["error"]
        assert read_manifest(mnt / "checkpoints/step_2", step=2)["step"] == 2
        assert not list((mnt / "checkpoints").glob("step_4.*tmp")) and not (mnt / "checkpoints/step_4").exists()
        res = _run(mnt, 2)  # the survivor loads (nothing left to train)
        assert res.results[0]["start"] == 2
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


@pytest.mark.parametrize("policy", ["warn", "refuse", "allow"])
def test_environment_drift_is_reported_and_acted_on_per_policy(four_steps, tmp_path, policy):
    ref_run, ref_losses = four_steps
    _copy_run(ref_run, tmp_path)
    env = {"TORCH_MESHJOB_DRIFT_PROBE": uuid.uuid4().hex}
    if policy == "refuse":
        with pytest.raises(RuntimeError, match="checkpoint.on_env_drift=warn"):
            _run(tmp_path, 6, env=env, on_env_drift=policy)
        assert not read_events(tmp_path / "events.jsonl", "checkpoint_loaded")
    else:
        res = _run(tmp_path, 6, env=env, on_env_drift=policy)
        assert res.results[0]["start"] == 4
    drift = read_events(tmp_path / "events.jsonl", "checkpoint_env_drift")
    assert len(drift) == 1 and drift[0]["policy"] == policy
    assert drift[0]["diff"]["env.TORCH_MESHJOB_DRIFT_PROBE"] == [None, env["TORCH_MESHJOB_DRIFT_PROBE"]]
    assert drift[0]["ranks"] == [0, 1]


@pytest.mark.parametrize(
    "mode", ["none", "thread", pytest.param("process", marks=pytest.mark.slow)]
)  # process: ~16 s spawn
def test_every_async_mode_commits_checkpoints_that_resume_bitwise(four_steps, tmp_path, mode):
    _, ref_losses = four_steps
    first = _run(tmp_path, 2, async_mode=mode)
    assert first.results[0]["losses"] == {1: ref_losses[1], 2: ref_losses[2]}
    saved = read_events(tmp_path / "events.jsonl", "checkpoint_saved")
    assert [e["step"] for e in saved] == [2] and saved[0]["async_mode"] == mode
    assert saved[0]["bytes"] == sum(f["size"] for f in read_manifest(tmp_path / "checkpoints/step_2")["files"].values())
    assert 0 < saved[0]["blocking_s"] <= saved[0]["total_s"]
    res = _run(tmp_path, 4, async_mode=mode)
    assert res.results[0]["start"] == 2 and res.results[0]["losses"] == {3: ref_losses[3], 4: ref_losses[4]}


def test_retention_keeps_the_newest_two_valid_and_never_deletes_damaged_ones(tmp_path):
    _run(tmp_path, 4)
    os.truncate(_shard(tmp_path / "checkpoints/step_2"), 10)  # damage the older one
    _run(tmp_path, 8)  # loads 4, saves 6 and 8
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_2", "step_6", "step_8"]  # step_4 retired by keep=2; damaged step_2 left for a human
    deleted = read_events(tmp_path / "events.jsonl", "checkpoint_deleted")
    assert [e["step"] for e in deleted] == [4]
    assert "checkpoint.keep=2" in deleted[0]["reason"]


def test_auto_interval_saves_first_to_measure_then_at_the_daly_interval(tmp_path):
    _run(tmp_path, 10, interval="auto", every_steps=0)
    ev = read_events(tmp_path / "events.jsonl")
    iv = [e for e in ev if e["kind"] == "checkpoint_interval"]
    saves = [e["step"] for e in ev if e["kind"] == "checkpoint_saved"]
    assert saves[0] == 1 and saves[-1] == 10
    # The harness reports 0.01 s steps and an MTBF of 3600 s: the interval is Daly(δ, 3600) / 0.01 s, with
    # δ the measured save cost; Daly 2006 eq. 37 and Young 1974, written out here, not taken from the code.
    first = iv[0]
    d, m = first["delta_s"], 3600.0
    young = math.sqrt(2 * d * m)
    daly = young * (1 + math.sqrt(d / (2 * m)) / 3 + d / (2 * m) / 9) - d
    assert first["interval_steps"] == max(1, round(daly / 0.01)), (first, daly)
    assert abs(first["interval_s"] - daly) < 1e-3 and abs(first["young_s"] - young) < 1e-3
    assert first["interval_steps"] > 10  # δ is far below MTBF: nothing between the first and the last save
    assert saves == [1, 10]
    assert json.dumps(first)  # plain JSON in the ledger


def _kill_when_stalled(marker: Path, timeout: float = 60.0) -> threading.Thread:
    def watch() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if marker.exists() and marker.read_text():
                os.kill(int(marker.read_text()), signal.SIGKILL)
                return
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def test_a_rank_killed_from_outside_while_its_save_is_in_flight_leaves_nothing_loadable_behind(four_steps, tmp_path):
    _, ref_losses = four_steps
    watcher = _kill_when_stalled(tmp_path / "stalled")
    # Rank 1's writer stops in the middle of step_4's shard (async, training goes on to step 5); the
    # test SIGKILLs it from outside, then the harness kills rank 0, which waits for it in a collective.
    killed = _run(tmp_path, 6, allow_kill=True, patch="stall_write:4")
    watcher.join()
    assert killed.exitcodes[1] == -signal.SIGKILL, killed.exitcodes
    ck = tmp_path / "checkpoints"
    assert [p.is_dir() for p in ck.glob("step_4.*.tmp")] == [True] and not (ck / "step_4").exists()
    assert [s for s, _ in step_dirs(ck)] == [2]
    for step, d in step_dirs(ck):
        assert check_step_dir(d, step=step, checksum=True) == [], d  # every step_N there is has a valid manifest
    res = _run(tmp_path, 4)
    assert res.results[0]["start"] == 2
    assert res.results[0]["losses"] == {3: ref_losses[3], 4: ref_losses[4]}  # bitwise from step_2
