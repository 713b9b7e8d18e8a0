"""A rank in a fresh interpreter (a Slurm or torchrun rank) imports torch and the trainer with the garbage collector
off and freezes what they made, as a forked local rank finds them: its collections scan only what it makes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.config import compose
from jobs.launch.prepare import prepare_inputs
from tests.conftest import REPO
from tests.multiproc._ranks import free_port

pytestmark = pytest.mark.multiproc

# The rank's own entry point, `python -m jobs.launch.slurm --rank OVERRIDES`, with the full collections counted.
_RANK = r"""
import gc, runpy, sys
full = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2 and full.append(1))
sys.argv = ["jobs.launch.slurm", "--rank", *sys.argv[1:]]
try:
    runpy.run_module("jobs.launch.slurm", run_name="__main__", alter_sys=True)
except SystemExit as e:
    print(e.code, len(full))
"""


def test_a_fresh_rank_runs_one_full_collection_to_its_first_step_not_one_per_import_burst(
    tmp_path: Path, data_path: str
) -> None:
    overrides = [f"run.dir={tmp_path / 'run'}", f"data.path={data_path}", "mesh=single", "launcher.tasks_per_node=1"]
    prepare_inputs(compose(overrides))
    env = dict(
        os.environ,
        TORCHELASTIC_RUN_ID="collector",  # torchrun's contract: this process is the whole world
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    p = subprocess.run(
        [sys.executable, "-c", _RANK, *overrides, "train.steps=1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    code, full = map(int, p.stdout.split()[-2:])
    assert code == 0, p.stderr[-3000:]
    # The one the CPU memory tracker runs as it starts tracking step 1 (jobs/telemetry/memory.py). Without the
    # freeze: 6 (the imports' own, and young collections promoting ~450k objects until a full one scans them all)
    assert full == 1, p.stderr[-3000:]
