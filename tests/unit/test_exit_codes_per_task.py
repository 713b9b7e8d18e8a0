"""Exit codes from each task, not from srun's highest code or one wording: the supervisor sees every
death srun reports (Out Of Memory, a bus error, USR2, a floating point exception), and the torchrun style's job ends
with its decision's code, not the highest of its agents' codes."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from jobs import exitcodes
from jobs.events import EventLog, read_events
from jobs.failure import policy
from jobs.failure.policy import Decision
from jobs.launch import supervise
from tests.unit.test_requeue_path import _job, slurm  # noqa: F401 - slurm: the stand-in fixture
from tests.unit.test_supervisor_decides import _cfg, run_dir  # noqa: F401 - run_dir: a fixture

# srun 22.05's lines for a task that ended badly (src/srun/libsrun/launch.c: "%s: task %s: %s" with strsignal, or
# "Out Of Memory" when the step's cgroup saw an OOM kill).
_LINES = {
    "srun: error: node2: task 1: Out Of Memory": 137,
    "srun: error: node2: task 1: Bus error": 128 + signal.SIGBUS,
    "srun: error: node2: task 1: User defined signal 2": 128 + signal.SIGUSR2,
    "srun: error: node2: task 1: Floating point exception (core dumped)": 128 + signal.SIGFPE,
    "srun: error: node2: task 1: Exited with exit code 76": 76,
    "srun: error: node2: task 1: Killed": 137,
}

_SRUN = """#!{python}
import os, sys
d = os.environ["FAKE_SLURM"]
n = len(os.listdir(os.path.join(d, "steps"))) if os.path.isdir(os.path.join(d, "steps")) else 0
os.makedirs(os.path.join(d, "steps"), exist_ok=True)
open(os.path.join(d, "steps", str(n)), "w").close()
if n == 0:
    print({line!r}, file=sys.stderr)
    sys.exit(0)
sys.exit(0)
"""


@pytest.mark.parametrize(("line", "code"), sorted(_LINES.items()))
def test_each_of_sruns_words_for_a_task_end_gives_its_exit_code(line: str, code: int) -> None:
    assert supervise.task_code(line.split("task 1: ", 1)[1]) == code


@pytest.mark.parametrize("line", [k for k in _LINES if "Exited" not in k and "Killed" not in k])
def test_a_rank_killed_in_any_way_srun_words_it_starts_the_supervisors_decision(
    run_dir: Path,  # noqa: F811 - the fixture imported above
    slurm: Path,  # noqa: F811
    line: str,
) -> None:
    # Before: `_RankExits` knew "Killed", "Terminated", "Aborted", "Segmentation fault" only: the step ended without
    # a decision and the supervisor returned srun's code, the job ended there.
    (slurm / "srun").write_text(_SRUN.format(python=sys.executable, line=line))
    run_dir.mkdir(parents=True)
    (run_dir / "incidents").write_text("")  # the ranks' failure path cannot claim (as in test_supervisor_decides)
    assert supervise.supervise(_cfg(run_dir), logs=("o", "e")) == exitcodes.OK
    (failure,) = read_events(run_dir / "events.jsonl", "failure")
    assert failure["summary"].startswith(line), failure
    assert [e["attempt"] for e in read_events(run_dir / "events.jsonl", "attempt_start")] == ["9.0", "9.0.1"]


def test_the_most_final_code_wins_over_a_killed_nodes_137() -> None:
    assert exitcodes.most_final([137, 76, 75]) == exitcodes.STOPPED
    assert exitcodes.most_final([0, -9]) == 137 and exitcodes.most_final([]) == exitcodes.FAILED


def test_the_torchrun_style_ends_with_the_decisions_code_not_sruns_highest(
    tmp_path: Path,
    slurm: Path,  # noqa: F811
    monkeypatch,
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    cfg = _cfg(tmp_path)
    EventLog(tmp_path / "events.jsonl", rank=0, attempt="9.0").emit("attempt_start", job_id="9")
    policy.claim(tmp_path, "9.0", rank=0)
    policy.publish(tmp_path, "9.0", Decision("stop", "budget spent", exitcodes.STOPPED, 10, 10, 0))
    # Before: the batch script ended with srun's 137 (node2's agent SIGKILLed), hiding "do not requeue".
    assert supervise.after_agents(cfg, step_code=137) == exitcodes.STOPPED
    assert supervise.after_agents(cfg, step_code=0) == exitcodes.STOPPED


def test_the_torchrun_style_decides_for_a_decider_that_died_before_publishing(
    tmp_path: Path,
    slurm: Path,  # noqa: F811
    monkeypatch,
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    EventLog(tmp_path / "events.jsonl", rank=0, attempt="9.0.1").emit("attempt_start", job_id="9")
    policy.claim(tmp_path, "9.0.1", rank=3)  # and died: torchrun's agents gave up, srun exited 1
    assert supervise.after_agents(_cfg(tmp_path), step_code=1) == exitcodes.REQUEUE
    (d,) = read_events(tmp_path / "events.jsonl", "decision")
    assert (d["attempt"], d["cause"], d["action"]) == ("9.0.1", "dead_rank", "requeue"), d
    assert _job(slurm)["restarts"] == 1
