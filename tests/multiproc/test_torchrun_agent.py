"""torchrun's agent as the torchrun-style sbatch script runs it (`jobs.launch.slurm --agent`): SIGTERM is left to
the ranks, and the ranks' exit code is the agent's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.multiproc

# A rank as seen by its agent: on SIGTERM it "saves" for SAVE_S, then exits as meshjob's ranks do after an
# agreed stop (the decider, rank 0, with 75; the others with 0).
_RANK = """
import os, signal, sys, time
from pathlib import Path
out, got = Path(sys.argv[1]), []
signal.signal(signal.SIGTERM, lambda s, f: got.append(s))
(out / f"tmp{os.environ['RANK']}").write_text(str(os.getpid()))
(out / f"tmp{os.environ['RANK']}").rename(out / f"ready{os.environ['RANK']}")
while not got:
    time.sleep(0.05)
time.sleep(float(sys.argv[2]))
(out / f"saved{os.environ['RANK']}").write_text("")
sys.exit(75 if os.environ["RANK"] == "0" else 0)
"""


def _agent(tmp_path: Path, script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    rank = tmp_path / "rank.py"
    rank.write_text(script)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jobs.launch.slurm",
            "--agent",
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=0",
            str(rank),
            *args,
        ],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_sigterm_reaches_the_ranks_alone_and_their_save_is_not_cut_off(tmp_path: Path) -> None:
    # As Slurm does on `scontrol requeue`: SIGTERM to the agent and to every rank. torch's agent caught it and
    # SIGKILLed the ranks after its shutdown timeout (1 s here; 30 s by default), in the middle of a 3 s save.
    agent = _agent(tmp_path, _RANK, str(tmp_path), "3", env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "1"})
    try:
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("ready*"))) < 2:
            assert agent.poll() is None and time.monotonic() < deadline, agent.communicate()[0][-3000:]
            time.sleep(0.1)
        for pid in [agent.pid, *(int(p.read_text()) for p in tmp_path.glob("ready*"))]:
            os.kill(pid, signal.SIGTERM)
        out, _ = agent.communicate(timeout=120)
    finally:  # the agent ignores SIGTERM, and its ranks wait for one: nothing may outlive a failed test
        if agent.poll() is None:  # its ranks are its children, not reaped yet: their pids are still theirs
            for pid in [*(int(p.read_text()) for p in tmp_path.glob("ready*")), agent.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            agent.wait()
    assert sorted(p.name for p in tmp_path.glob("saved*")) == ["saved0", "saved1"], out[-3000:]
    assert agent.returncode == 75, out[-3000:]  # the decider's "requeue", not torchrun's 1


def test_the_ranks_do_not_requeue_reaches_slurm_as_76_not_1(tmp_path: Path) -> None:
    agent = _agent(tmp_path, "import os, sys; sys.exit(76 if os.environ['RANK'] == '0' else 75)")
    out, _ = agent.communicate(timeout=120)
    assert agent.returncode == 76, out[-3000:]


# A rank torchrun starts twice: the first start ends with 1 when told (torchrun restarts it); the second reports
# whether it started with USR2 blocked, waits, then installs its handlers and reports what it got.
_RESTARTED = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
n = os.environ["TORCHELASTIC_RESTART_COUNT"]
blocked = signal.SIGUSR2 in signal.pthread_sigmask(signal.SIG_BLOCK, [])
(out / f"start{n}").write_text(f"{os.getpid()} {blocked}")
if n == "0":
    while not (out / "crash").exists():
        time.sleep(0.05)
    sys.exit(1)
while not (out / "go").exists():
    time.sleep(0.05)
from jobs.failure.signals import StopSignals
(out / "got").write_text(str(StopSignals().install([signal.SIGUSR2, signal.SIGTERM]).name))
"""


def test_a_usr2_to_the_agent_is_recorded_for_the_ranks_it_restarts_and_one_to_a_starting_rank_waits(
    tmp_path: Path,
) -> None:
    # The agent as the rendered script starts it (its bash wrapper, `--agent --run-dir=...`). Before: the agent
    # ignored USR2 and so did the ranks it restarted until their handlers were in place: a USR2 sent while torchrun
    # restarted them was lost, and the job trained on into its time limit.
    from jobs.config import compose
    from jobs.launch.stop_notice import notice_path, read_notice
    from jobs.sbatch import render_for
    from tests.unit.test_torchrun_stop_notice import agent_line

    overrides = ["launcher=slurm", f"run.dir={tmp_path}"]
    wrapper, _ = agent_line(render_for(compose(overrides), overrides=overrides, style="torchrun", python="python"))
    (tmp_path / "rank.py").write_text(_RESTARTED)
    cmd = [sys.executable, "-u", "-m", "jobs.launch.slurm", "--agent", f"--run-dir={tmp_path}", "--standalone"]
    args = ["--nproc-per-node=1", "--max-restarts=1", str(tmp_path / "rank.py"), str(tmp_path)]
    log = tmp_path / "agent.log"
    with log.open("w") as out:  # a file, not a pipe: a rank left behind by a failure must not hold the test
        agent = subprocess.Popen(
            ["bash", "-c", wrapper, "torchrun", *cmd, *args],
            cwd=REPO,
            env={**os.environ, "SLURM_JOB_ID": "9", "SLURM_RESTART_COUNT": "2"},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait(tmp_path / "start0", agent)
        os.kill(agent.pid, signal.SIGUSR2)  # as Slurm signals the step: here only to the agent, as in a restart gap
        _wait(notice_path(tmp_path, "9", 2), agent, timeout_s=30)  # written within milliseconds
        (tmp_path / "crash").write_text("")
        _wait(tmp_path / "start1", agent)
        pid, blocked = (tmp_path / "start1").read_text().split()
        os.kill(int(pid), signal.SIGUSR2)  # to the restarted rank before its handlers: neither lost nor fatal
        time.sleep(0.2)
        (tmp_path / "go").write_text("")
        agent.wait(timeout=120)
    finally:  # nothing may outlive a failed test: the agent, and its ranks (a session of their own)
        for started in [*tmp_path.glob("start*")]:
            _kill(int(started.read_text().split()[0]), mark=str(tmp_path / "rank.py"))
        if agent.poll() is None:
            agent.kill()
        agent.wait()
    assert agent.returncode == 0, log.read_text()[-3000:]
    assert read_notice(notice_path(tmp_path, "9", 2))["signal"] == "SIGUSR2"
    assert blocked == "True" and (tmp_path / "got").read_text() == "SIGUSR2", log.read_text()[-3000:]


def _kill(pid: int, *, mark: str) -> None:
    """SIGKILL to `pid` if it is still the process whose command line holds `mark` (never a recycled pid)."""
    try:
        if mark in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
            os.kill(pid, signal.SIGKILL)
    except (OSError, ProcessLookupError):
        pass


def _wait(path: Path, proc: subprocess.Popen, *, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)
