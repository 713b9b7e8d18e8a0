"""Under torchrun a USR2 has a process to take it at every moment: the agent blocks it, records each one
it gets for the ranks of its allocation, and the ranks it starts inherit it blocked until their handlers are in
place; rank 0 of an attempt takes a recorded notice as arrived."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from jobs.config import compose
from jobs.failure.signals import StopSignals
from jobs.launch import slurm as slurm_launch
from jobs.launch.env import DistEnv
from jobs.launch.stop_notice import notice_path, read_notice
from jobs.sbatch import render_for

# The agent's first lines as `jobs.launch.slurm --agent` has them, then a rank it starts while the test signals.
_AGENT = """
import os, signal, subprocess, sys, time
from pathlib import Path
from jobs.launch.stop_notice import record_notices
out = Path(sys.argv[1])
record_notices(out / "rendezvous" / "9.0.stop_notice")
(out / "agent").write_text("")
while not (out / "rendezvous" / "9.0.stop_notice").exists():  # no rank: torchrun restarting them
    time.sleep(0.02)
rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], str(out)])
sys.exit(rank.wait())
"""
_RANK = """
import os, signal, sys, time
from pathlib import Path
out = Path(sys.argv[1])
(out / "rank").write_text(str(os.getpid()))
while not (out / "go").exists():  # importing: no handler yet
    time.sleep(0.02)
from jobs.failure.signals import StopSignals
stop = StopSignals().install([signal.SIGUSR2, signal.SIGTERM])
(out / "got").write_text(str(stop.name))
"""


def _wait_for(path: Path, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
        time.sleep(0.02)


def test_a_usr2_while_no_rank_is_there_is_recorded_and_one_to_a_starting_rank_waits_for_its_handler(
    tmp_path: Path,
) -> None:
    # Before: the agent ignored USR2 (`trap ""`) and its new ranks inherited that: one sent while torchrun restarted
    # them reached no process that took it, and the ranks trained on into the time limit (TIMEOUT, never requeued).
    agent = subprocess.Popen([sys.executable, "-c", _AGENT, str(tmp_path), _RANK])
    try:
        _wait_for(tmp_path / "agent", agent)
        os.kill(agent.pid, signal.SIGUSR2)  # Slurm signals the step: only the agent is there
        _wait_for(tmp_path / "rank", agent)
        os.kill(int((tmp_path / "rank").read_text()), signal.SIGUSR2)  # a second one, the rank not ready for it
        time.sleep(0.2)
        (tmp_path / "go").write_text("")
        assert agent.wait(timeout=60) == 0  # neither the agent nor the rank died of it
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
    notice = read_notice(tmp_path / "rendezvous" / "9.0.stop_notice")
    assert notice is not None and (notice["signal"], notice["count"]) == ("SIGUSR2", 1)
    assert (tmp_path / "got").read_text() == "SIGUSR2"


def _env(rank: int, restart_in_allocation: int) -> DistEnv:
    return DistEnv(
        rank=rank,
        local_rank=rank,
        world_size=2,
        local_world_size=2,
        node_rank=0,
        nodes=1,
        master_addr="a",
        master_port=1,
        restart_in_allocation=restart_in_allocation,
        job_id="9",
        restart_count=2,
    )


def test_rank_0_of_a_restarted_attempt_takes_its_allocations_recorded_notice_as_arrived(tmp_path: Path) -> None:
    cfg = compose(["launcher=slurm", f"run.dir={tmp_path}"])
    before = StopSignals()
    slurm_launch._recorded_notice(cfg, _env(0, 1), before)
    assert before.name is None
    other = notice_path(tmp_path, "9", 1)  # the allocation before the last requeue: not this one's
    other.parent.mkdir(parents=True)
    other.write_text('{"signal": "SIGUSR2"}')
    slurm_launch._recorded_notice(cfg, _env(0, 1), before)
    assert before.name is None
    notice_path(tmp_path, "9", 2).write_text('{"signal": "SIGUSR2", "host": "node1"}')
    stops = {r: StopSignals() for r in (0, 1)}
    for r, stop in stops.items():
        slurm_launch._recorded_notice(cfg, _env(r, 1), stop)
    assert {r: s.name for r, s in stops.items()} == {0: "SIGUSR2", 1: None}  # rank 0's flag is agreed at a step


def test_the_rendered_torchrun_script_names_the_run_dir_to_its_agents() -> None:
    overrides = ["launcher=slurm", "run.dir=/work/meshjob/runs/x"]
    text = render_for(compose(overrides), overrides=overrides, style="torchrun", python="python", workdir="/w")
    assert agent_line(text) == ('trap "" USR2 TERM; exec "$@"', '--run-dir="$RUN_DIR"')


def agent_line(script: str) -> tuple[str, str]:
    """The rendered script's agent wrapper (bash -c '...') and the agent's first own option."""
    (found,) = re.findall(r"bash -c '([^']*)' torchrun \"\$PYTHON\" -u -m jobs\.launch\.slurm --agent (\S+)", script)
    return found
