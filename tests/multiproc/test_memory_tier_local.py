"""The RAM checkpoint tier with real ranks under the local launcher: a rank killed with `kill -9` comes back from
node-local memory at a step newer than the filesystem's newest; a corrupted RAM shard sends the next restart to the
filesystem tier; the run ends bitwise equal to an uninterrupted one and leaves nothing in memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checkpoint.config import memory_root
from checkpoint.convert import convert
from checkpoint.manifest import read_manifest, step_dirs
from jobs.events import read_events
from jobs.launch.rundir import run_id
from jobs.status import status_text
from tests.conftest import REPO, assert_states_bitwise, wait_for_step

RUN_S = 180  # one 14-step run of 2 ranks: ~15 s on the loaded 2-core box; the bound for each wait below
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(4 * RUN_S)]

STEPS = 14
COMMON = [f"train.steps={STEPS}", "train.log_every=1", "checkpoint.every_steps=3", "checkpoint.memory_every_steps=1",
          "mesh=single", "launcher.tasks_per_node=2", "mesh.dp_shard=2"]


def _rank_pids(run_dir: Path, launcher: int) -> dict[int, int]:
    """{rank: pid} of the launcher's live ranks (its children, named by their heartbeat files)."""
    children = {int(p) for p in Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()}
    out = {}
    for beat in run_dir.glob("heartbeats/*/rank*.json"):
        try:
            pid = json.loads(beat.read_text())["pid"]
        except (OSError, ValueError, KeyError):
            continue
        if pid in children:
            out[int(beat.stem.removeprefix("rank"))] = pid
    return out


def _complete_ram_step(root: Path) -> int | None:
    """The newest step both ranks hold committed in the RAM tier from the same save (what a restart would load),
    when no RAM save is under way (one committed step per rank, no temporary folder: the saves are asynchronous,
    and a moment between a save's commit and the deletion of the older step would leave a second RAM candidate)."""
    held = []
    for r in (0, 1):
        steps = {}
        if any((root / f"rank_{r}").glob("*.tmp")) or len(step_dirs(root / f"rank_{r}")) != 1:
            return None
        for s, d in step_dirs(root / f"rank_{r}"):
            try:
                steps[s] = read_manifest(d, step=s)["attempt"]
            except Exception:  # noqa: BLE001 - a folder without its manifest is no commit
                continue
        held.append(steps)
    common = [s for s in set(held[0]) & set(held[1]) if held[0][s] == held[1][s]]
    return max(common) if common else None


def _newest_fs_step(run_dir: Path) -> int:
    return max((s for s, d in step_dirs(run_dir / "checkpoints") if (d / "manifest.json").exists()), default=0)


def _freeze_then_kill_rank1(run_dir: Path, proc: subprocess.Popen, root: Path, *, corrupt: bool) -> tuple[int, int]:
    """Stops both ranks (SIGSTOP) at a moment when RAM holds a complete step newer than the filesystem's newest
    (else lets them run a little and tries again); optionally flips a byte of rank 0's shard of that step; then
    SIGKILLs rank 1 and lets rank 0 go on. Returns (that RAM step, the newest filesystem step)."""
    deadline = time.monotonic() + RUN_S
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the ranks never held a RAM step newer than the filesystem's"
        pids = _rank_pids(run_dir, proc.pid)
        if len(pids) == 2:
            for pid in pids.values():
                os.kill(pid, signal.SIGSTOP)
            ram, fs = _complete_ram_step(root), _newest_fs_step(run_dir)
            if ram is not None and ram > fs:
                break
            for pid in pids.values():
                os.kill(pid, signal.SIGCONT)
        time.sleep(0.2)
    if corrupt:
        shard = next((root / "rank_0" / f"step_{ram}").glob("*.distcp"))
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
        shard.write_bytes(bytes(data))
    os.kill(pids[1], signal.SIGKILL)
    os.kill(pids[0], signal.SIGCONT)
    return ram, fs


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + RUN_S
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {path} after {RUN_S} s"
        time.sleep(0.05)


def _final(run_dir: Path, tmp: Path) -> dict:
    out = tmp / f"{run_dir.name}-final.pt"
    convert(run_dir / f"checkpoints/step_{STEPS}", out)
    return torch.load(out, weights_only=False)


def _newest_fs_commit_before(events: list[dict], *, loaded_index: int) -> int:
    """The newest filesystem step whose `checkpoint_saved` precedes the `loaded_index`-th `checkpoint_loaded`."""
    newest, loads = 0, 0
    for e in events:
        if e["kind"] == "checkpoint_loaded":
            if loads == loaded_index:
                return newest
            loads += 1
        elif e["kind"] == "checkpoint_saved" and e.get("tier") == "filesystem":
            newest = max(newest, e["step"])
    raise AssertionError(f"fewer than {loaded_index + 1} checkpoint_loaded events")


def _losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_events(run_dir / "metrics.jsonl") if "loss" in m}  # the last line wins


def test_a_killed_rank_restarts_from_ram_and_a_corrupted_ram_shard_falls_back_to_the_filesystem_bitwise(
        tmp_path: Path, data_path: str) -> None:
    common = [*COMMON, f"data.path={data_path}"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref, proc = (subprocess.Popen([sys.executable, "-m", "jobs.train", f"run.dir={d}", *common], cwd=REPO,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}) for d in (ref_dir, run_dir))
    try:  # the uninterrupted reference trains alongside (its own run dir and RAM root)
        _wait_for(run_dir / "checkpoints/step_3/manifest.json", proc)  # the first filesystem checkpoint committed
        root = memory_root("/dev/shm", run_id(run_dir)) / f"{os.uname().nodename}.node0"  # the one (simulated) node
        ram1, fs1 = _freeze_then_kill_rank1(run_dir, proc, root, corrupt=False)
        wait_for_step(run_dir, ram1 + 3, proc, timeout=RUN_S)  # the first attempt got at most to ram1 + 1
        ram2, fs2 = _freeze_then_kill_rank1(run_dir, proc, root, corrupt=True)
        out, err = proc.communicate(timeout=RUN_S)
        ref_err = ref.communicate(timeout=RUN_S)[1]
    finally:
        for p, d in ((proc, run_dir), (ref, ref_dir)):
            if p.poll() is None:
                for pid in _rank_pids(d, p.pid).values():
                    os.kill(pid, signal.SIGKILL)
                p.kill()
                p.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert ref.returncode == 0, ref_err[-3000:]

    events = read_events(run_dir / "events.jsonl")
    assert [d["action"] for d in events if d["kind"] == "decision"] == ["restart", "restart"]
    # the first restart: RAM, newer than anything on the filesystem; the second: the damaged RAM step is skipped
    assert fs1 >= 3 and ram1 > fs1 and ram2 > fs2
    loaded = [(e["step"], e["tier"]) for e in events if e["kind"] == "checkpoint_loaded"]
    # an async filesystem save under way at the freeze may commit after it (rank 1 had written its shard): the
    # fallback is the newest filesystem commit before the load, at least the one seen at the freeze, older than RAM's
    fs_seen = _newest_fs_commit_before(events, loaded_index=1)
    assert fs2 <= fs_seen < ram2 and loaded == [(ram1, "memory"), (fs_seen, "filesystem")]
    skipped = [e for e in events if e["kind"] == "checkpoint_skipped"]
    assert [(e["step"], e["tier"]) for e in skipped] == [(ram2, "memory")] and "crc32" in skipped[0]["reason"]
    # every step's loss and the final model and optimizer state: bitwise the uninterrupted run's
    assert _losses(run_dir) == _losses(ref_dir)
    assert_states_bitwise(_final(run_dir, tmp_path), _final(ref_dir, tmp_path))
    # jobs.status names the tier each attempt resumed from; the finished run left nothing in memory
    rows = [ln.split() for ln in status_text(run_dir).splitlines() if " local.0" in ln]
    assert [r[5] for r in rows] == ["-", "ram", "fs"], rows
    assert not root.parent.exists() and not memory_root("/dev/shm", run_id(ref_dir)).exists()
