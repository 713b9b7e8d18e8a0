"""The watchdog's hang path writes the hung-with rank's flight recorder before the rank exits (issue 25 item 6)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, wait_for_step
from tests.multiproc.test_failure_local import _rank_pid

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_a_rank_left_waiting_on_a_sigstopped_peer_dumps_its_flight_recorder_before_it_exits(
        tmp_path: Path, data_path: str) -> None:
    hang_s = 5.0
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.train", f"run.dir={run_dir}", "train.steps=100000", f"data.path={data_path}",
         "checkpoint.enabled=false", "mesh=single", "launcher.tasks_per_node=2", "mesh.dp_shard=2",
         f"failure.hang_timeout_s={hang_s}", "failure.heartbeat_s=0.5", "failure.restarts_in_allocation=0",
         "+cluster.env.TORCH_FR_BUFFER_SIZE=64"],  # gloo records too when the recorder has a buffer
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    victim = None
    try:
        wait_for_step(run_dir, 2, proc)
        victim = _rank_pid(run_dir, 1)
        os.kill(victim, signal.SIGSTOP)
        dump = run_dir / "nccl_traces" / "local.0" / "nccl_trace_rank_0"
        stopped_at = time.monotonic()
        while not dump.exists() and time.monotonic() - stopped_at < 2 * hang_s + 10:
            time.sleep(0.2)
        assert dump.exists(), f"no dump {time.monotonic() - stopped_at:.1f} s after the SIGSTOP"
        assert not (run_dir / "nccl_traces" / "local.0" / "nccl_trace_rank_1").exists()  # the stopped rank could not
        entries = pickle.loads(dump.read_bytes())["entries"]
        assert entries and all(e["profiling_name"].startswith("gloo:") for e in entries)
        assert entries[-1]["state"] != "completed"  # the collective rank 0 waits in when the watchdog fires
        proc.communicate(timeout=60)
    finally:
        if victim is not None and Path(f"/proc/{victim}").exists():
            os.kill(victim, signal.SIGCONT)
            os.kill(victim, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
