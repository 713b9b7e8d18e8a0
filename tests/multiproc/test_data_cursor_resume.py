"""Through `python -m jobs.train`: a resume with another train.global_batch reads on from the next unread sample
(the global position the ledger records), and a resume over a changed data file is refused with the override."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from jobs.events import read_events
from tests.conftest import run_train

RUN_S = 240  # one short single-process run: ~10 s on the loaded 2-core box
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(3 * RUN_S + 60)]

NUM_SAMPLES = 32
SINGLE = ["mesh=single", "launcher.tasks_per_node=1", "checkpoint.every_steps=2", f"data.num_samples={NUM_SAMPLES}"]


def test_a_changed_global_batch_resumes_at_the_next_sample_and_a_changed_file_is_refused(tmp_path):
    data, run_dir = tmp_path / "tokens.h5", tmp_path / "run"
    common = [*SINGLE, f"data.path={data}"]
    r = run_train([*common, "train.steps=2", "train.global_batch=8"], run_dir, timeout=RUN_S)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_train([*common, "train.steps=3", "train.global_batch=16"], run_dir, timeout=RUN_S)
    assert r.returncode == 0, r.stderr[-3000:]

    # what the resume says it did (the ledger): data step 2 reads on from global sample 16, the first unread
    changed = read_events(run_dir / "events.jsonl", "data_cursor_changed")
    assert len(changed) == 1 and changed[0]["step"] == 2, changed
    assert "train.global_batch changed (8 -> 16): data step 2 reads on from global sample 16" in changed[0]["note"]
    # which samples a position names, across a batch-size change, is tests/unit/test_data_cursor.py's

    with h5py.File(data, "a") as f:  # the file appended to between attempts: 8 more rows
        whole = np.concatenate([f["tokens"][:], f["tokens"][:8]])
        del f["tokens"]
        f["tokens"] = whole
    r = run_train([*common, "train.steps=4", "train.global_batch=16"], run_dir, timeout=RUN_S)
    assert r.returncode == 2, r.stderr[-3000:]  # a config error: not requeued
    out = r.stdout + r.stderr
    assert "tokens.h5 (size" in out and "data.accept_changed_files=true" in out, out[-3000:]
    failure = read_events(run_dir / "events.jsonl", "failure")[-1]
    assert failure["cls"] == "config_error" and "data.accept_changed_files=true" in failure["error"]
    assert [e["step"] for e in read_events(run_dir / "events.jsonl", "checkpoint_saved")][-1] == 3  # nothing after
