"""Through `python -m jobs.train`: a resume with another train.global_batch reads on from the next unread sample
(the exact samples across the boundary), and a resume over a changed data file is refused with the override."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest

from jobs.data import SAMPLE_LOG_VAR, global_batch_indices
from jobs.events import read_events
from tests.conftest import run_train

RUN_S = 240  # one short single-process run: ~10 s on the loaded 2-core box
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(3 * RUN_S + 60)]

NUM_SAMPLES = 32
SINGLE = ["mesh=single", "launcher.tasks_per_node=1", "checkpoint.every_steps=2", f"data.num_samples={NUM_SAMPLES}"]


def test_a_changed_global_batch_resumes_at_the_next_sample_and_a_changed_file_is_refused(tmp_path):
    data, run_dir, log = tmp_path / "tokens.h5", tmp_path / "run", tmp_path / "samples.jsonl"
    common = [*SINGLE, f"data.path={data}"]
    env = {SAMPLE_LOG_VAR: str(log)}
    r = run_train([*common, "train.steps=2", "train.global_batch=8"], run_dir, timeout=RUN_S, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train([*common, "train.steps=3", "train.global_batch=16"], run_dir, timeout=RUN_S, env=env)
    assert r.returncode == 0, r.stderr[-3000:]

    rows = [json.loads(l) for l in log.read_text().splitlines()]
    assert [(x["data_step"], x["position"], len(x["sample"])) for x in rows] == [
        (0, 0, 8), (1, 8, 8), (2, 16, 16)]
    # 32 samples read = the file's first epoch, in the order an uninterrupted run reads it: none repeated or skipped
    read = [i for x in rows for i in x["sample"]]
    assert read == global_batch_indices(seed=0, step=0, global_batch=32, num_samples=NUM_SAMPLES).tolist()
    assert sorted(read) == list(range(NUM_SAMPLES))
    changed = read_events(run_dir / "events.jsonl", "data_cursor_changed")
    assert len(changed) == 1 and changed[0]["step"] == 2 and "train.global_batch changed (8 -> 16)" in changed[0]["note"]

    with h5py.File(data, "a") as f:  # the file appended to between attempts: 8 more rows
        whole = np.concatenate([f["tokens"][:], f["tokens"][:8]])
        del f["tokens"]
        f["tokens"] = whole
    r = run_train([*common, "train.steps=4", "train.global_batch=16"], run_dir, timeout=RUN_S, env=env)
    assert r.returncode == 2, r.stderr[-3000:]  # a config error: not requeued
    out = r.stdout + r.stderr
    assert "tokens.h5 (size" in out and "data.accept_changed_files=true" in out, out[-3000:]
    failure = read_events(run_dir / "events.jsonl", "failure")[-1]
    assert failure["cls"] == "config_error" and "data.accept_changed_files=true" in failure["error"]
    assert len(log.read_text().splitlines()) == 3  # nothing read past the refusal
