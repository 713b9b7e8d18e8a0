"""Silent data corruption on real gloo ranks (local launcher): a data spike re-runs the same and rolls back;
replica hashes name the replica whose gradient diverged (jobs/failure/sdc.py; the seam MESHJOB_TEST_FLIP_GRAD).
Bits flipped in one rank's gradient, re-run, found to differ, an `sdc` incident naming that rank and its node,
and the requeued run bitwise equal to an uninterrupted one: tests/chaos/test_sdc_chaos.py (the same ranks under
the Slurm launcher, which also quarantines the node; this file's local twin of it was removed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs import exitcodes
from jobs.failure.sdc import FLIP_VAR
from jobs.failure.spike import CORRUPT_VAR
from tests.conftest import run_train

pytestmark = pytest.mark.multiproc

# Healthy grad norms of the tiny model stay below 1 here; a flipped exponent bit makes them ~1e36.
COMMON = [
    "train.steps=12",
    "mesh=single",
    "launcher.tasks_per_node=2",
    "checkpoint.every_steps=5",
    "train.log_every=1",
    "failure.heartbeat_s=0.5",
]
DP_SHARD = ["mesh.dp_shard=2", "failure.spike_grad_norm=1000"]


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "events.jsonl").read_text().splitlines()]


def _kind(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in _events(run_dir) if e["kind"] == kind]


def _final(run_dir: Path) -> dict[int, tuple[float, float, float]]:
    """step -> (loss, grad norm, lr) of the last line logged for each step."""
    lines = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {m["step"]: (m["loss"], m["grad_norm"], m["lr"]) for m in lines if "loss" in m}


def test_a_data_spike_repeats_on_its_rerun_and_is_rolled_back(tmp_path: Path, data_path: str):
    # NaN parameters before data step 6 (the data's fault, as far as the run can tell): the re-run gives NaN again.
    run = run_train(
        [*COMMON, *DP_SHARD, "failure.spike_skip_steps=2", f"data.path={data_path}"],
        tmp_path / "run",
        env={CORRUPT_VAR: "nan:6"},
    )
    assert run.returncode == exitcodes.OK, run.stderr[-3000:]
    assert [(c["step"], c["trigger"], c["verdict"], c["differ"]) for c in _kind(run.run_dir, "sdc_check")] == [
        (7, "spike", "data", [])
    ]
    assert [r["record"]["cls"] for r in _kind(run.run_dir, "rollback")] == ["non_finite_loss"]
    assert _kind(run.run_dir, "failure") == [] and max(_final(run.run_dir)) == 12


def test_replica_hashes_name_the_replica_whose_gradient_diverged(tmp_path: Path, data_path: str):
    # bit23 doubles or halves one gradient element: no spike can see it (no sdc_check of trigger "spike"), only
    # the hashes do, and the re-run they ask for names the rank.
    common = [*COMMON, "mesh.dp_replicate=2", "failure.replica_hash_every=4", f"data.path={data_path}"]
    run = run_train(common, tmp_path / "at_check", env={FLIP_VAR: "1:8:bit23"})
    assert run.returncode == exitcodes.REQUEUE, run.stderr[-3000:]
    (rh,) = _kind(run.run_dir, "replica_hash")
    assert (rh["step"], rh["grads_disagree"], rh["params_disagree"]) == (8, [[0, 1]], [])
    (check,) = _kind(run.run_dir, "sdc_check")
    assert (check["trigger"], check["verdict"], check["suspects"]) == ("replica_hash", "sdc", [1])
    (failure,) = _kind(run.run_dir, "failure")
    assert failure["cls"] == "sdc" and [s["rank"] for s in failure["suspects"]] == [1]
    # A flip between two checks leaves the parameters diverged: found at the next check; two replicas have no
    # majority, so nobody is named and nothing is saved (the run resumes from its last checkpoint, step 5).
    run = run_train(common, tmp_path / "between", env={FLIP_VAR: "1:6:bit23"})
    assert run.returncode == exitcodes.REQUEUE, run.stderr[-3000:]
    (rh,) = _kind(run.run_dir, "replica_hash")
    assert (rh["step"], rh["params_disagree"]) == (8, [[0, 1]])
    (failure,) = _kind(run.run_dir, "failure")
    assert failure["cls"] == "sdc" and failure["suspects"] == [] and _kind(run.run_dir, "sdc_check") == []
    assert sorted(e["step"] for e in _kind(run.run_dir, "checkpoint_saved")) == [5]


def test_under_pipeline_parallel_the_rerun_compares_what_each_stage_sends(tmp_path: Path, data_path: str):
    """Off the last stage the local loss is 0: stage 0's forward value is the sum of squares of what it sent on,
    computed alike twice by a healthy forward; its flipped gradient names it (the last stage whose gradient differs)."""
    run = run_train(
        [*COMMON, "mesh.pp=2", "failure.spike_grad_norm=1000", f"data.path={data_path}"],
        tmp_path / "pp",
        env={FLIP_VAR: "0:8"},
    )
    assert run.returncode == exitcodes.REQUEUE, run.stderr[-3000:]
    (check,) = _kind(run.run_dir, "sdc_check")
    assert (check["step"], check["verdict"], check["differ"], check["suspects"], check["named_by"]) == (
        8,
        "sdc",
        [0],
        [0],
        "gradient",
    ), check
    (sent_first, grad_first), (sent_again, grad_again) = check["values"]["0"]
    assert sent_first == sent_again > 0 and grad_first > 1e30 > grad_again, check["values"]
    (failure,) = _kind(run.run_dir, "failure")
    assert failure["cls"] == "sdc" and [s["rank"] for s in failure["suspects"]] == [0]
    # The state before step 8 sits on the GPU just shown faulty: nothing of it is saved (before: step_7 was).
    assert sorted(e["step"] for e in _kind(run.run_dir, "checkpoint_saved")) == [5]
