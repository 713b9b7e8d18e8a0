"""The watchdog's paths with real ranks under the local launcher: a failure path that cannot write, a stop during
start-up, early signal handlers. (A peer named from its missed heartbeats and a final save held longer than the
hang timeout are tests/chaos/test_watchdog_paths.py's: the same rank-side watchdog, and neither launcher watches
heartbeats itself; the local launcher's end of a hung attempt is tests/multiproc/test_failure_local.py's.)"""

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
    return subprocess.Popen(
        [sys.executable, "-m", "jobs.train", f"run.dir={run_dir}", *overrides],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


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
def test_a_failure_path_that_cannot_write_still_exits_75_and_the_launcher_ends_the_attempt(
    tmp_path: Path, data_path: str
) -> None:
    run_dir = tmp_path / "run"
    incidents = run_dir / "incidents"
    incidents.mkdir(parents=True)
    # Stacks, incident, claim and decision all live here: a read-only disk for the failure path.
    p = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(incidents)], capture_output=True, text=True
    )
    if p.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here (needs root / CAP_SYS_ADMIN): {p.stderr.strip()}")
    victim = []
    try:
        proc = _start(
            run_dir,
            [
                "train.steps=100000",
                f"data.path={data_path}",
                "checkpoint.enabled=false",
                "mesh=single",
                "launcher.tasks_per_node=2",
                "mesh.dp_shard=2",
                "failure.hang_timeout_s=120",
                "failure.heartbeat_s=0.5",
                "failure.missed_beats=4",
                "failure.restarts_in_allocation=0",
            ],
        )
        try:
            wait_for_step(run_dir, 2, proc)
            reporter = _beat(run_dir, 0)["pid"]
            victim.append(_beat(run_dir, 1)["pid"])
            os.kill(victim[0], signal.SIGSTOP)
            stopped_at = time.monotonic()
            # rank 0 notices in seconds, cannot write stacks, claim or decision (EROFS) and exits 75
            # anyway; the launcher reaps it and stops the stopped rank (SIGTERM, SIGKILL after its 10 s grace).
            # Once rank 0 is reaped, rank 1 may run again (SIGCONT), so that the launcher's SIGTERM ends it
            # without waiting out the grace (a rank that stays stopped until the SIGKILL is
            # tests/multiproc/test_failure_local.py's SIGSTOP case); the exit code is rank 0's either way.
            deadline = time.monotonic() + 60
            while Path(f"/proc/{reporter}").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            os.kill(victim[0], signal.SIGCONT)
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
    tmp_path: Path, data_path: str
) -> None:
    run_dir = tmp_path / "run"
    # missed_beats so high that only the stop signal can end the wait (not the stopped peer's heartbeat)
    proc = _start(
        run_dir,
        [
            "train.steps=100",
            f"data.path={data_path}",
            "mesh=single",
            "launcher.tasks_per_node=2",
            "mesh.dp_shard=2",
            "failure.init_timeout_s=300",
            "failure.missed_beats=1000",
            "failure.heartbeat_s=0.5",
        ],
    )
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
        reporter = _beat(run_dir, 0)["pid"]
        os.kill(proc.pid, signal.SIGUSR2)  # the launcher forwards it to both ranks
        sent_at = time.monotonic()
        decision = run_dir / "incidents/local.0/decision.json"
        while not decision.exists() and time.monotonic() - sent_at < 30:
            time.sleep(0.05)
        decided_after_s = time.monotonic() - sent_at
        assert decision.exists(), "no decision 30 s after USR2 (the start-up wait is failure.init_timeout_s, 300 s)"
        assert decided_after_s < 10, decided_after_s
        # Once the launcher has reaped rank 0 (exit 75) it stops the stopped rank 1: SIGTERM, then SIGKILL after a
        # 10 s grace (tests/multiproc/test_failure_local.py's SIGSTOP case waits that out); here the test kills it
        # at once, which changes neither the decision nor the ledger (a SIGKILLed rank writes nothing).
        deadline = time.monotonic() + 60
        while Path(f"/proc/{reporter}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(victim[0], signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        _finish(proc, victim)
    assert proc.returncode == exitcodes.REQUEUE
    events = _events(run_dir)
    stops = [e for e in events if e["kind"] == "stop_requested"]
    assert [(e["rank"], e["signal"]) for e in stops] == [(0, "SIGUSR2")]
    assert stops[0]["action"] in ("exit during rendezvous", "exit during build", "exit during load")
    assert [(d["action"], d["cause"], d["exit_code"]) for d in events if d["kind"] == "decision"] == [
        ("requeue", "SIGUSR2", 75)
    ]
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.launch.slurm", "--rank-config", str(tmp_path / "none.pkl")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
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
