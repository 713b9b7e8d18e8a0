"""Silent data corruption on the real local cluster: bits flipped in one rank's gradient (the test seam
MESHJOB_TEST_FLIP_GRAD) are found by the re-run, the job is requeued without that rank's node, and the requeued
job, resumed from its last committed checkpoint (nothing is saved from the GPU just shown faulty), finishes bitwise
equal to an uninterrupted run (jobs/failure/sdc.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jobs.failure.sdc import FLIP_VAR
from tests.chaos.chaos_helpers import DONE_S, REFERENCE_S, bound_s, events, losses, wait_job_done
from tests.conftest import run_train
from tests.slurm.slurm_helpers import cli, scontrol_job, submitted_job_id

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.usefixtures("slurm_cluster")]

# Two ranks on two nodes; healthy grad norms stay below 1, the flipped exponent bit makes them ~1e36.
ARGS = [
    "launcher.nodes=2",
    "launcher.tasks_per_node=1",
    "mesh=single",
    "mesh.dp_shard=2",
    "train.steps=40",
    "checkpoint.every_steps=10",
    "train.log_every=1",
    "failure=debug",
    "failure.spike_grad_norm=1000",
]


@pytest.mark.timeout(bound_s(DONE_S))  # its own waits are the bound (tests/chaos/chaos_helpers.py)
def test_flipped_gradient_bits_quarantine_the_node_and_the_requeued_job_finishes_bitwise(
    run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = run_train(["launcher=local", *ARGS], tmp_path / "ref", timeout=REFERENCE_S)
    assert ref.returncode == 0, ref.stderr[-3000:]
    monkeypatch.setenv(FLIP_VAR, "1:25:once")  # sbatch passes the submitting environment on to the job
    r = cli("jobs.train", "launcher=slurm", *ARGS, f"run.dir={run_root}")
    assert r.returncode == 0, r.stdout + r.stderr
    job = submitted_job_id(r.stdout)
    recs = wait_job_done(job, timeout=DONE_S)
    assert [x["State"].split()[0] for x in recs][-1] == "COMPLETED", recs
    # The re-run's evidence (tests/multiproc/test_sdc.py asserted it on the local launcher, a twin of this job).
    (check,) = events(run_root, "sdc_check")
    assert (check["step"], check["trigger"], check["verdict"], check["differ"], check["suspects"]) == (
        25,
        "spike",
        "sdc",
        [1],
        [1],
    ), check
    first_run, rerun = check["values"]["1"]
    assert first_run[1] > 1e30 and rerun[1] < 10  # rank 1's gradient: corrupt, then clean
    assert check["values"]["0"][0] == check["values"]["0"][1]  # rank 0 computed the same bits twice
    incident = json.loads((run_root / f"incidents/{job}.0/incident.json").read_text())
    assert incident["cls"] == "sdc" and incident["evidence"]["differ"] == [1], incident
    (failure,) = events(run_root, "failure")
    ((rank, node),) = [(s["rank"], s["node"]) for s in failure["suspects"]]
    assert failure["cls"] == "sdc" and rank == 1, failure
    (d,) = events(run_root, "decision")
    assert (d["cause"], d["action"], d["excluded"]) == ("sdc", "requeue", [node]), d
    assert [q["node"] for q in json.loads((run_root / "quarantine.json").read_text())] == [node]
    info = scontrol_job(job)
    assert (info["Restarts"], info["ExcNodeList"]) == ("1", node) and node not in recs[-1]["NodeList"], (info, recs)
    # Nothing of the faulty GPU's state was saved: the requeued job resumed from step 20, the last committed one.
    assert [e["step"] for e in events(run_root, "checkpoint_loaded")] == [20]
    assert max(m["step"] for m in _metrics(run_root) if m["restart"] == 0) == 24  # nothing after it trained
    assert losses(run_root) == losses(ref.run_dir)  # every step, bitwise
    assert _final(run_root) == _final(ref.run_dir)  # and every step's grad norm and LR


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _final(run_dir: Path) -> dict[int, tuple[float, float, float]]:
    """step -> (loss, grad norm, lr) of the last line logged for each step."""
    return {m["step"]: (m["loss"], m["grad_norm"], m["lr"]) for m in _metrics(run_dir) if "loss" in m}
