"""The watchdog's paths with real ranks under the local launcher: a peer's missed heartbeats, a failure path
that cannot write, a stop during start-up, a final save slower than the hang timeout, early signal handlers."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import exitcodes
from tests.conftest import REPO, wait_for_step

pytestmark = pytest.mark.multiproc


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]


def _start(run_dir: Path, overrides: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jobs.train", f"run.dir={run_dir}", *overrides], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _beat(run_dir: Path, rank: int, attempt: str = "local.0") -> dict | None:
    try:
        return json.loads((run_dir / "heartbeats" / attempt / f"rank{rank}.json").read_text())
    except (OSError, ValueError):
        return None


def _finish(proc: subprocess.Popen, stopped: list[int]) -> None:
    for pid in stopped:
        if Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_a_sigstopped_rank_is_named_hung_from_its_missed_heartbeats_in_seconds_not_the_hang_timeout(
        tmp_path: Path, data_path: str) -> None:
    hang_s, heartbeat_s, missed = 120.0, 0.5, 4
    run_dir = tmp_path / "run"
    proc = _start(run_dir, ["train.steps=100000", f"data.path={data_path}", "checkpoint.enabled=false",
                            "mesh=single", "launcher.tasks_per_node=4", "mesh.dp_shard=4",
                            f"failure.hang_timeout_s={hang_s}", f"failure.heartbeat_s={heartbeat_s}",
                            f"failure.missed_beats={missed}", "failure.restarts_in_allocation=0"])
    victim = []
    try:
        wait_for_step(run_dir, 2, proc)
        victim.append(_beat(run_dir, 2)["pid"])
        os.kill(victim[0], signal.SIGSTOP)  # its sockets stay open: no peer sees a connection reset
        stopped_at = time.monotonic()
        inc_path = run_dir / "incidents/local.0/incident.json"
        while not inc_path.exists() and time.monotonic() - stopped_at < 60:
            time.sleep(0.1)
        named_after_s = time.monotonic() - stopped_at
        assert inc_path.exists(), f"no incident {named_after_s:.1f} s after the SIGSTOP"
        # noticed after about (missed + 1) heartbeats (2.5 s), then up to 3.5 heartbeats to classify;
        # the bound leaves room for this 2-core machine's load and is still a tenth of the hang timeout
        assert named_after_s < 12.0, named_after_s
        inc = json.loads(inc_path.read_text())
        assert inc["cls"] == "hung_rank"
        assert [(s["rank"], s["pid"], s["state"]) for s in inc["suspects"]] == [(2, victim[0], "stopped")]
        proc.communicate(timeout=60)
        assert proc.returncode == exitcodes.REQUEUE
        ends = [(e["cause"], e["action"]) for e in _events(run_dir) if e["kind"] == "attempt_end"]
        assert ends == [("hung_rank", "requeue")]
    finally:
        _finish(proc, victim)


@pytest.mark.slow
def test_a_failure_path_that_cannot_write_still_exits_75_and_the_launcher_ends_the_attempt(
        tmp_path: Path, data_path: str) -> None:
    run_dir = tmp_path / "run"
    incidents = run_dir / "incidents"
    incidents.mkdir(parents=True)
    # Stacks, incident, claim and decision all live here: a read-only disk for the failure path.
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(incidents)], capture_output=True,
                       text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root / CAP_SYS_ADMIN): {p.stderr.strip()}")
    victim = []
    try:
        proc = _start(run_dir, ["train.steps=100000", f"data.path={data_path}", "checkpoint.enabled=false",
                                "mesh=single", "launcher.tasks_per_node=2", "mesh.dp_shard=2",
                                "failure.hang_timeout_s=120", "failure.heartbeat_s=0.5", "failure.missed_beats=4",
                                "failure.restarts_in_allocation=0"])
        try:
            wait_for_step(run_dir, 2, proc)
            victim.append(_beat(run_dir, 1)["pid"])
            os.kill(victim[0], signal.SIGSTOP)
            stopped_at = time.monotonic()
            # rank 0 notices in seconds, cannot write stacks, claim or decision (EROFS) and exits 75
            # anyway; the launcher then stops the stopped rank (SIGTERM, SIGKILL after its grace).
            out, err = proc.communicate(timeout=90)
            took = time.monotonic() - stopped_at
        finally:
            _finish(proc, victim)
        assert proc.returncode == exitcodes.REQUEUE, err[-3000:]
        assert took < 40, took
        assert "the failure path failed (OSError: [Errno 30] Read-only file system" in out + err
        assert list(incidents.iterdir()) == []
    finally:
        subprocess.run(["umount", str(incidents)], check=False)


@pytest.mark.slow
def test_usr2_while_a_peer_holds_up_the_start_ends_the_attempt_promptly_and_requeues(
        tmp_path: Path, data_path: str) -> None:
    run_dir = tmp_path / "run"
    # missed_beats so high that only the stop signal can end the wait (not the stopped peer's heartbeat)
    proc = _start(run_dir, ["train.steps=100", f"data.path={data_path}", "mesh=single", "launcher.tasks_per_node=2",
                            "mesh.dp_shard=2", "failure.init_timeout_s=300", "failure.missed_beats=1000",
                            "failure.heartbeat_s=0.5"])
    victim = []
    try:
        deadline = time.monotonic() + 120
        while _beat(run_dir, 1) is None:  # written when its watchdog starts, before the rendezvous
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.005)
        victim.append(_beat(run_dir, 1)["pid"])
        os.kill(victim[0], signal.SIGSTOP)  # rank 0 now waits for it in rendezvous, build or load
        time.sleep(2.0)
        assert _beat(run_dir, 0)["phase"] in ("rendezvous", "build", "load")
        os.kill(proc.pid, signal.SIGUSR2)  # the launcher forwards it to both ranks
        sent_at = time.monotonic()
        decision = run_dir / "incidents/local.0/decision.json"
        while not decision.exists() and time.monotonic() - sent_at < 30:
            time.sleep(0.05)
        decided_after_s = time.monotonic() - sent_at
        assert decision.exists(), "no decision 30 s after USR2 (the start-up wait is failure.init_timeout_s, 300 s)"
        assert decided_after_s < 10, decided_after_s
        proc.communicate(timeout=60)
    finally:
        _finish(proc, victim)
    assert proc.returncode == exitcodes.REQUEUE
    events = _events(run_dir)
    stops = [e for e in events if e["kind"] == "stop_requested"]
    assert [(e["rank"], e["signal"]) for e in stops] == [(0, "SIGUSR2")]
    assert stops[0]["action"] in ("exit during rendezvous", "exit during build", "exit during load")
    assert [(d["action"], d["cause"], d["exit_code"]) for d in events if d["kind"] == "decision"] == [
        ("requeue", "SIGUSR2", 75)]
    assert not [e for e in events if e["kind"] == "first_step"]


def _catches(pid: int, sig: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def test_a_slurm_rank_entry_installs_its_stop_handlers_before_its_imports(tmp_path: Path) -> None:
    """`python -m jobs.launch.slurm --rank-config PATH` (what srun starts on every rank): the handlers come
    first, so a USR2 during the imports (about 1 s; before: all of it was a window that killed the rank)
    is recorded, not fatal."""
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "jobs.launch.slurm", "--rank-config", str(tmp_path / "none.pkl")],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not _catches(proc.pid, signal.SIGUSR2):
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.001)
        handler_s = time.monotonic() - t0
        os.kill(proc.pid, signal.SIGUSR2)
        out, err = proc.communicate(timeout=120)
        total_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != -signal.SIGUSR2, err[-2000:]
    assert "none.pkl" in err  # it went on to its imports and failed on the missing config, as it should
    assert handler_s < 0.5 * total_s, (handler_s, total_s)



class _FreezableDir:
    """An ext4 image loop-mounted on a folder, which `fsfreeze` can hold: every write to it then blocks
    in the kernel until thawed, as on a parallel filesystem too busy to answer."""

    def __init__(self, where: Path, image: Path) -> None:
        self.where, self.image, self.frozen = where, image, False

    def __enter__(self) -> "_FreezableDir":
        self.where.mkdir(parents=True)
        subprocess.run(["truncate", "-s", "64M", str(self.image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", str(self.image)], check=True, capture_output=True)
        p = subprocess.run(["mount", "-o", "loop", str(self.image), str(self.where)], capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot loop-mount an ext4 image here (needs root and /dev/loop*): {p.stderr.strip()}")
        return self

    def freeze(self, on: bool) -> None:
        subprocess.run(["fsfreeze", "-f" if on else "-u", str(self.where)], check=True, timeout=30)
        self.frozen = on

    def __exit__(self, *exc) -> None:
        if self.frozen:
            self.freeze(False)
        subprocess.run(["umount", str(self.where)], check=False)


@pytest.mark.slow
def test_a_final_save_slower_than_the_hang_timeout_completes(tmp_path: Path, data_path: str) -> None:
    hang_s, held_s, steps = 4.0, 10.0, 20
    run_dir = tmp_path / "run"
    with _FreezableDir(run_dir / "checkpoints", tmp_path / "checkpoints.img") as ck:
        proc = _start(run_dir, [f"train.steps={steps}", f"checkpoint.every_steps={steps}", "train.log_every=1",
                                f"data.path={data_path}", "mesh=single", "launcher.tasks_per_node=2", "mesh.dp_shard=2",
                                f"failure.hang_timeout_s={hang_s}", "failure.heartbeat_s=0.5",
                                "failure.checkpoint_timeout_s=300", "failure.restarts_in_allocation=0"])
        try:
            wait_for_step(run_dir, steps - 8, proc)
            ck.freeze(True)  # the final save (at step 20, its only one) now cannot write until thawed
            time.sleep(held_s)
            phases = {_beat(run_dir, r)["phase"] for r in (0, 1)}
            ck.freeze(False)
            out, err = proc.communicate(timeout=120)
        finally:
            _finish(proc, [])
        assert proc.returncode == 0, (out + err)[-3000:]
        # both ranks were inside the held save (writing or waiting for the write), longer than the hang timeout
        assert phases <= {"checkpoint_save", "checkpoint_wait"}, phases
        events = _events(run_dir)
        assert not [e for e in events if e["kind"] in ("failure", "decision")]
        saved = [e for e in events if e["kind"] == "checkpoint_saved"]
        assert [e["step"] for e in saved] == [steps] and saved[0]["total_s"] > hang_s
        assert (run_dir / f"checkpoints/step_{steps}/manifest.json").exists()
        assert not (run_dir / f"checkpoints/step_{steps}.tmp").exists()
