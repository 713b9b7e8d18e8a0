"""Each srun task's own exit record: the task srun starts watches its rank, records the rank's exit code
or the signal that killed it, and ends the same way; the supervisor decides from those records, with srun's text only
for a task that left none."""

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
from jobs.events import read_events
from jobs.launch import supervise
from jobs.launch.task_exits import read_records
from tests.unit.test_requeue_path import slurm  # noqa: F401 - slurm: the stand-in fixture
from tests.unit.test_supervisor_decides import _cfg, run_dir  # noqa: F401 - run_dir: a fixture

# A rank under its watcher: `watched` forks, the child does what argv[2] says (`exit:N`, `signal:NAME`).
_TASK = """
import os, resource, signal, sys
from jobs.launch.task_exits import watched
watched(sys.argv[1])
how, _, what = sys.argv[2].partition(":")
if how == "signal":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    sig = signal.Signals[what]
    if sig != signal.SIGKILL:
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {sig})
    os.kill(os.getpid(), sig)
sys.exit(int(what))
"""


def _task(folder: Path, how: str, *, task: int = 3) -> subprocess.CompletedProcess:
    env = {**os.environ, "SLURM_PROCID": str(task), "SLURMD_NODENAME": "node2"}
    return subprocess.run([sys.executable, "-c", _TASK, str(folder), how], env=env, capture_output=True, timeout=60)


@pytest.mark.parametrize("sig", [signal.SIGBUS, signal.SIGFPE, signal.SIGKILL, signal.SIGSEGV])
def test_the_srun_task_records_its_ranks_death_by_signal_and_dies_of_the_same_signal(tmp_path: Path, sig) -> None:
    r = _task(tmp_path, f"signal:{sig.name}")
    assert r.returncode == -sig, r.stderr  # srun sees the same death ("Bus error", "Killed") as without the watcher
    (rec,) = read_records(tmp_path).values()
    assert (rec["task"], rec["node"], rec["exit_code"], rec["signal"]) == (3, "node2", 128 + sig, sig.name)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["task3.json"]  # written atomically: no temporary left


def test_the_srun_task_exits_with_its_ranks_code_and_records_it(tmp_path: Path) -> None:
    r = _task(tmp_path, "exit:76")
    assert r.returncode == exitcodes.STOPPED, r.stderr
    assert read_records(tmp_path)[3]["exit_code"] == 76 and read_records(tmp_path)[3]["signal"] is None


def test_a_task_that_cannot_write_its_record_still_ends_with_its_ranks_code(tmp_path: Path) -> None:
    (tmp_path / "exits").write_text("")  # not a folder: a full or read-only disk
    r = _task(tmp_path / "exits", "exit:75")
    assert r.returncode == exitcodes.REQUEUE and b"exit record not written" in r.stderr


_STARTING_RANK = """
import os, sys, time
from pathlib import Path
from jobs.launch.task_exits import watched
out = Path(sys.argv[1])
watched(out / "exits")
(out / "pid.tmp").write_text(str(os.getpid()))
(out / "pid.tmp").rename(out / "pid")  # whole: the test polls for it and reads it at once
while not (out / "go").exists():  # a rank still importing: no handler yet
    time.sleep(0.02)
from jobs.failure.signals import StopSignals
import signal
stop = StopSignals().install([signal.SIGUSR2, signal.SIGTERM])
(out / "got").write_text(str(stop.name))
"""


def test_a_stop_signal_to_a_starting_rank_and_its_task_reaches_the_ranks_handler_once_installed(
    tmp_path: Path,
) -> None:
    # As Slurm signals a step: every process of the task. Before: a rank not yet past its first line died of USR2
    # (its default action), and a watcher would have died of it too.
    proc = subprocess.Popen(
        [sys.executable, "-c", _STARTING_RANK, str(tmp_path)], env={**os.environ, "SLURM_PROCID": "0"}
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    rank = int((tmp_path / "pid").read_text())
    for pid in (proc.pid, rank):
        os.kill(pid, signal.SIGUSR2)
    time.sleep(0.2)
    (tmp_path / "go").write_text("")
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "got").read_text() == "SIGUSR2"
    assert read_records(tmp_path / "exits")[0]["exit_code"] == 0


def test_kill_9_of_the_srun_task_ends_its_rank_too(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _STARTING_RANK, str(tmp_path)], env={**os.environ, "SLURM_PROCID": "0"}
    )
    deadline = time.monotonic() + 60
    while not (tmp_path / "pid").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    rank = int((tmp_path / "pid").read_text())
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(rank)  # not an orphan rank training on in the step with nobody to record its end
    assert read_records(tmp_path / "exits") == {}  # its watcher died: no record (srun's text is the fallback)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


# srun for the supervisor: runs each task of the step under the real watcher (`_TASK`), as `plan.json` says per step
# ("absent": the task never ran, its watcher gone with its node), prints nothing about them, exits with `srun_code`
# or the highest task code (as srun does).
_SRUN = """#!{python}
import json, os, subprocess, sys
d = os.environ["FAKE_SLURM"]
os.makedirs(os.path.join(d, "steps"), exist_ok=True)
n = len(os.listdir(os.path.join(d, "steps")))
open(os.path.join(d, "steps", str(n)), "w").close()
plan = json.load(open(os.path.join(d, "plan.json")))[min(n, 1)]
folder = sys.argv[sys.argv.index("--task-exits") + 1] if "--task-exits" in sys.argv else os.path.join(d, "nowhere")
codes = []
for task, how in enumerate(plan["tasks"]):
    if how == "absent":
        continue
    env = dict(os.environ, SLURM_PROCID=str(task), SLURMD_NODENAME=f"node{{task + 1}}")
    rc = subprocess.run([sys.executable, "-c", {task!r}, folder, how], env=env).returncode
    codes.append(128 - rc if rc < 0 else rc)
sys.exit(plan.get("srun_code", max(codes, default=1)))
"""


def _plan(slurm: Path, *steps: dict) -> None:  # noqa: F811
    (slurm / "srun").write_text(_SRUN.format(python=sys.executable, task=_TASK))
    (slurm / "plan.json").write_text(json.dumps(steps))


_DONE = {"tasks": ["exit:0", "exit:0"]}


def test_a_rank_killed_without_a_word_from_srun_is_decided_from_its_tasks_record(
    run_dir: Path,  # noqa: F811 - the fixture imported above
    slurm: Path,  # noqa: F811
) -> None:
    # Before: srun exited 135 without a task line the supervisor knew, so it took the step for one that never ran
    # (`step_launch_failure`) and requeued the job instead of restarting the ranks in the allocation.
    _plan(slurm, {"tasks": ["exit:0", "signal:SIGBUS"]}, _DONE)
    assert supervise.supervise(_cfg(run_dir), logs=("o", "e")) == exitcodes.OK
    ev = read_events(run_dir / "events.jsonl")
    assert [e["attempt"] for e in ev if e["kind"] == "attempt_start"] == ["9.0", "9.0.1"]
    (failure,) = [e for e in ev if e["kind"] == "failure"]
    assert failure["cls"] == "dead_rank", failure
    assert failure["summary"].startswith("task 1 on node2 (pid "), failure["summary"]
    assert "killed by SIGBUS (its exit record)" in failure["summary"]
    incident = json.loads((run_dir / "incidents" / "9.0" / "incident.json").read_text())
    assert incident["evidence"]["task_exit_codes"] == {"0": 0, "1": 128 + signal.SIGBUS}
    (d,) = [e for e in ev if e["kind"] == "decision"]
    assert d["action"] == "restart"


def test_a_task_with_neither_record_nor_srun_line_is_lost_and_decided_for(
    run_dir: Path,  # noqa: F811
    slurm: Path,  # noqa: F811
) -> None:
    # Task 1's node went with its watcher: no record; srun said nothing of it. Before: `step_launch_failure`.
    _plan(slurm, {"tasks": ["exit:0", "absent"], "srun_code": 137}, _DONE)
    assert supervise.supervise(_cfg(run_dir), logs=("o", "e")) == exitcodes.OK
    (failure,) = read_events(run_dir / "events.jsonl", "failure")
    assert (failure["cls"], failure["summary"].split(",")[0]) == (
        "dead_rank",
        "task(s) 1 left no exit record and srun named no end for them (lost with their node?)",
    )


def test_a_step_whose_tasks_all_recorded_0_finished_whatever_srun_exits(
    run_dir: Path,  # noqa: F811
    slurm: Path,  # noqa: F811
) -> None:
    # srun's own error after every rank ended (I/O forwarding, a slurmstepd message): before, exit 1 with no task
    # line read as "srun exited 1 before any rank ran", a `step_launch_failure`, and the finished job was requeued.
    _plan(slurm, {"tasks": ["exit:0", "exit:0"], "srun_code": 1})
    assert supervise.supervise(_cfg(run_dir), logs=("o", "e")) == exitcodes.OK
    assert read_events(run_dir / "events.jsonl", "decision") == []
    assert json.loads((slurm / "job.json").read_text())["restarts"] == 0


def test_a_tasks_record_of_a_bad_end_starts_the_bound_on_the_missing_decision() -> None:
    exits = supervise._RankExits(subprocess.Popen(["true"], stderr=subprocess.PIPE, text=True))
    exits.settled()
    exits.recorded({0: {"task": 0, "exit_code": 0, "time": 1.0}})
    assert exits.first_at is None  # a rank that ended well starts nothing
    exits.recorded({1: {"task": 1, "node": "node2", "pid": 7, "exit_code": 135, "signal": "SIGBUS", "time": 2.0}})
    assert exits.first == "task 1 on node2 (pid 7): killed by SIGBUS (its exit record)" and exits.first_at is not None


def test_a_tasks_record_overrides_sruns_words_and_the_most_final_code_is_the_steps() -> None:
    exits = supervise._RankExits(subprocess.Popen(["true"], stderr=subprocess.PIPE, text=True))
    exits.settled()
    exits.codes = {0: 137, 1: exitcodes.FAILED}  # srun: task 0 Killed; task 1 in words it could not tell
    end = exits.end(137, {1: {"task": 1, "exit_code": 76, "signal": None}}, ntasks=2)
    assert end.task_codes == {0: 137, 1: 76} and end.job_code == exitcodes.STOPPED  # not srun's 137


def test_the_srun_style_rank_entry_runs_its_rank_under_the_watcher(tmp_path: Path) -> None:
    # What the supervisor's srun starts on every task: `--rank-config PATH --task-exits DIR` (a config that is not
    # there: the rank fails at once, with 1).
    cmd = ["-m", "jobs.launch.slurm", "--rank-config", str(tmp_path / "none.pkl"), "--task-exits", str(tmp_path / "x")]
    proc = subprocess.Popen(
        [sys.executable, *cmd], env={**os.environ, "SLURM_PROCID": "5"}, stderr=subprocess.PIPE, text=True
    )
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == exitcodes.FAILED, err[-2000:]
    rec = read_records(tmp_path / "x")[5]
    assert (rec["exit_code"], rec["signal"]) == (exitcodes.FAILED, None)
    assert rec["pid"] != proc.pid  # the rank ran as the child of the task srun started


def test_records_read_before_are_not_read_again(tmp_path: Path) -> None:
    _task(tmp_path, "exit:0", task=0)
    first = read_records(tmp_path)
    (tmp_path / "task0.json").write_text("not read again")
    _task(tmp_path, "exit:75", task=1)
    assert {t: r["exit_code"] for t, r in read_records(tmp_path, known=first).items()} == {0: 0, 1: 75}


def test_a_missing_record_in_a_step_srun_saw_end_well_is_no_lost_task() -> None:
    exits = supervise._RankExits(subprocess.Popen(["true"], stderr=subprocess.PIPE, text=True))
    exits.settled()
    end = exits.end(0, {0: {"task": 0, "exit_code": 0, "signal": None}}, ntasks=2)  # task 1's write failed
    assert (end.gone, end.job_code) == (None, exitcodes.OK)  # a finished run is not restarted
    assert exits.end(137, {0: {"task": 0, "exit_code": 0}}, ntasks=2).gone.startswith("task(s) 1 left no exit record")
