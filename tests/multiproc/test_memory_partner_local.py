"""Partner copies of the RAM tier with real ranks under the local launcher, 4 ranks on 2 simulated nodes: a whole
node lost (its two ranks killed with `kill -9`, its RAM folder removed from outside) -> the restart reads the lost
shards from their partners' copies on the other node at the newest RAM step, and the run ends bitwise equal to an
uninterrupted one."""

from __future__ import annotations

import json
import os
import shutil
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
from tests.conftest import REPO, assert_states_bitwise

RUN_S = 180  # the bound of each wait below (this case took 46 s on the loaded 2-core box, its reference alongside)
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(4 * RUN_S)]

STEPS = 8
# no filesystem checkpoint before the last step: what the restart resumes from can only be the RAM tier
COMMON = [
    f"train.steps={STEPS}",
    "train.log_every=1",
    "checkpoint.every_steps=0",
    "checkpoint.memory_every_steps=2",
    "mesh=single",
    "launcher.nodes=2",
    "launcher.tasks_per_node=2",
    "mesh.dp_shard=4",
]
HOST = os.uname().nodename
# The faulted run is held from outside to at most one step per HOLD_S on any machine (its ranks stay stopped while
# they are ahead of that, as a descheduled host's would; nothing it computes changes): the ranks are between two RAM
# saves (every 2 steps) long enough for the poll below to catch them there before the run ends.
HOLD_S = 0.25


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


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + RUN_S
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no {path} after {RUN_S} s"
        time.sleep(0.05)


def _losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_events(run_dir / "metrics.jsonl") if "loss" in m}  # the last line wins


def _places(root: Path) -> dict[str, Path]:
    """Where each copy lives: rank r's own on node r // 2, and its partner's copy (rank r + 2 mod 4) on the other."""
    out = {}
    for r in range(4):
        out[f"rank_{r}"] = root / f"{HOST}.node{r // 2}" / f"rank_{r}"
        out[f"partner_of_rank_{r}"] = root / f"{HOST}.node{1 - r // 2}" / f"partner_of_rank_{r}"
    return out


def _quiet_step(root: Path) -> int | None:
    """The step every copy (own and partner, all 8) holds as its newest committed one from the same save, when no
    save is under way anywhere (no temporary folder), else None."""
    newest = []
    for d in _places(root).values():
        if any(d.glob("*.tmp")) or not d.is_dir():
            return None
        held = []
        for s, sd in step_dirs(d):
            try:
                held.append((s, read_manifest(sd, step=s)["attempt"]))
            except Exception:  # noqa: BLE001 - a folder without its manifest is no commit
                return None
        if not held:
            return None
        newest.append(max(held))
    return newest[0][0] if len(set(newest)) == 1 else None


def _lose_node0(run_dir: Path, proc: subprocess.Popen, root: Path) -> int:
    """Stops all ranks (SIGSTOP) at a moment when no RAM save is under way and every copy holds the same newest
    step (else lets them run a little, but never past one step per HOLD_S from the first poll, and tries again);
    then node 0 is lost: its RAM folder removed, its two ranks SIGKILLed; the other node's ranks go on. Returns
    that step."""
    deadline, first = time.monotonic() + RUN_S, None
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the ranks were never between two RAM saves"
        pids = _rank_pids(run_dir, proc.pid)
        if len(pids) == 4:
            for pid in pids.values():
                os.kill(pid, signal.SIGSTOP)
            step = _quiet_step(root)
            if step is not None:
                break
            first = first or time.monotonic()
            if max(_losses(run_dir), default=0) <= (time.monotonic() - first) / HOLD_S:  # not ahead: run on
                for pid in pids.values():
                    os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)
    shutil.rmtree(root / f"{HOST}.node0")
    for r in (0, 1):
        os.kill(pids[r], signal.SIGKILL)
    for r in (2, 3):
        os.kill(pids[r], signal.SIGCONT)
    return step


def _final(run_dir: Path, tmp: Path) -> dict:
    out = tmp / f"{run_dir.name}-final.pt"
    convert(run_dir / f"checkpoints/step_{STEPS}", out)
    return torch.load(out, weights_only=False)


def test_a_lost_node_s_shards_come_from_their_partner_copies_at_the_newest_ram_step_bitwise(
    tmp_path: Path, data_path: str
) -> None:
    common = [*COMMON, f"data.path={data_path}"]
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref, proc = (
        subprocess.Popen(
            [sys.executable, "-m", "jobs.train", f"run.dir={d}", *common],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        for d in (ref_dir, run_dir)
    )
    try:  # the uninterrupted reference trains alongside (its own run dir and RAM root)
        _wait_for(run_dir / "metrics.jsonl", proc)
        root = memory_root("/dev/shm", run_id(run_dir))
        lost_at = _lose_node0(run_dir, proc, root)
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
    why = [
        (e["attempt"], e["kind"], e.get("summary") or e.get("reason"))
        for e in events
        if e["kind"] in ("failure", "decision")
    ]
    assert [d["action"] for d in events if d["kind"] == "decision"] == ["restart"], why
    # the restart: the newest RAM step, ranks 0 and 1 from the copies their partners (ranks 2, 3) held
    loaded = [e for e in events if e["kind"] == "checkpoint_loaded"]
    assert [(e["step"], e["tier"], e.get("partner_ranks")) for e in loaded] == [(lost_at, "partner", [0, 1])]
    assert 2 <= lost_at < STEPS
    saved = [e for e in events if e["kind"] == "checkpoint_saved" and e["tier"] == "memory"]
    assert saved and all(e["replicas"] == 1 for e in saved)
    # every step's loss and the final model and optimizer state: bitwise the uninterrupted run's
    assert _losses(run_dir) == _losses(ref_dir)
    assert_states_bitwise(_final(run_dir, tmp_path), _final(ref_dir, tmp_path))
    # jobs.status names the tier; the finished run left nothing in memory
    rows = [ln.split() for ln in status_text(run_dir).splitlines() if " local.0" in ln]
    assert [r[5] for r in rows] == ["-", "peer"], rows
    assert not root.exists() and not memory_root("/dev/shm", run_id(ref_dir)).exists()
