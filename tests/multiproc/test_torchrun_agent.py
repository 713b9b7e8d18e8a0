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
