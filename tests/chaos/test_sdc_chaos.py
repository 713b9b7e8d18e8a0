"""Silent data corruption on the real local cluster: bits flipped in one rank's gradient (the test seam
MESHJOB_TEST_FLIP_GRAD) are found by the re-run, the job is requeued without that rank's node, and the requeued
job, resumed from its last committed checkpoint (nothing is saved from the GPU just shown faulty), finishes bitwise
equal to an uninterrupted run (jobs/failure/sdc.py). Under data parallelism (dp_shard) and under pipeline parallelism
with one stage per node, where off the last stage the loss is 0 and the re-run compares what each stage sends on."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from jobs.failure.sdc import FLIP_VAR
from tests.chaos.chaos_helpers import DONE_S, REFERENCE_S, bound_s, events, losses, rank_node, wait_job_done
from tests.conftest import TrainRun, run_train
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
# The same two nodes as a two-stage pipeline (rank 0 holds stage 0, rank 1 the last stage), shorter: the fault at
# step 13, past the save at 10, and 7 steps trained after the recovery.
PP_ARGS = [
    "launcher.nodes=2",
    "launcher.tasks_per_node=1",
    "mesh=single",
    "mesh.pp=2",
    "train.steps=20",
    "checkpoint.every_steps=5",
    "train.log_every=1",
    "failure=debug",
    "failure.spike_grad_norm=1000",
]


@pytest.mark.timeout(bound_s(DONE_S))  # its own waits are the bound (tests/chaos/chaos_helpers.py)
def test_flipped_gradient_bits_quarantine_the_node_and_the_requeued_job_finishes_bitwise(
    run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, job, recs = _run_flipped(ARGS, "1:25:once", run_root, tmp_path, monkeypatch)
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
    _assert_requeued_without_the_rank_s_node(run_root, job, recs, ref, rank=1, fault_step=25, loaded=20)


@pytest.mark.timeout(bound_s(DONE_S))
def test_under_pipeline_parallel_flipped_bits_in_stage_0_name_stage_0_and_its_node_is_left_out(
    run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref, job, recs = _run_flipped(PP_ARGS, "0:13:once", run_root, tmp_path, monkeypatch)
    (check,) = events(run_root, "sdc_check")
    assert (check["step"], check["verdict"], check["differ"], check["suspects"], check["named_by"]) == (
        13,
        "sdc",
        [0],
        [0],
        "gradient",  # the last stage in its pipeline whose gradient differs: stage 0, not the last stage
    ), check
    # Stage 0's forward value is what it sent to stage 1 (off the last stage the loss is 0; before, it compared that
    # 0): the same bits twice, while its gradient was corrupt, then clean. The last stage computed the same twice.
    (sent, grad), (sent_again, grad_again) = check["values"]["0"]
    assert sent == sent_again > 0 and grad > 1e30 > grad_again, check["values"]
    assert check["values"]["1"][0] == check["values"]["1"][1] and check["values"]["1"][0][0] > 0, check["values"]
    _assert_requeued_without_the_rank_s_node(run_root, job, recs, ref, rank=0, fault_step=13, loaded=10)


def _run_flipped(
    args: list[str], flip: str, run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[TrainRun, str, list[dict[str, str]]]:
    """The job run uninterrupted by the local launcher, then submitted to the cluster with `flip` (FLIP_VAR) until
    it has left the queue COMPLETED: (the reference, the job id, sacct's records)."""
    ref = run_train(["launcher=local", *args], tmp_path / "ref", timeout=REFERENCE_S)
    assert ref.returncode == 0, ref.stderr[-3000:]
    monkeypatch.setenv(FLIP_VAR, flip)  # sbatch passes the submitting environment on to the job
    r = cli("jobs.train", "launcher=slurm", *args, f"run.dir={run_root}")
    assert r.returncode == 0, r.stdout + r.stderr
    job = submitted_job_id(r.stdout)
    recs = wait_job_done(job, timeout=DONE_S)
    assert [x["State"].split()[0] for x in recs][-1] == "COMPLETED", recs
    return ref, job, recs


def _assert_requeued_without_the_rank_s_node(
    run_root: Path, job: str, recs: list[dict[str, str]], ref: TrainRun, *, rank: int, fault_step: int, loaded: int
) -> None:
    """The sdc incident named `rank` alone, the job was requeued once without its node (quarantined), resumed from
    step `loaded` (the last committed before the fault: nothing of the faulty GPU's state was saved) and finished
    bitwise equal to the reference."""
    node = rank_node(run_root, f"{job}.0", rank)  # where `rank` ran in the first attempt
    incident = json.loads((run_root / f"incidents/{job}.0/incident.json").read_text())
    assert incident["cls"] == "sdc" and incident["evidence"]["differ"] == [rank], incident
    (failure,) = events(run_root, "failure")
    assert failure["cls"] == "sdc" and [(s["rank"], s["node"]) for s in failure["suspects"]] == [(rank, node)], failure
    (d,) = events(run_root, "decision")
    assert (d["cause"], d["action"], d["excluded"]) == ("sdc", "requeue", [node]), d
    assert [q["node"] for q in json.loads((run_root / "quarantine.json").read_text())] == [node]
    info = scontrol_job(job)
    assert (info["Restarts"], info["ExcNodeList"]) == ("1", node), info
    assert node not in _hostnames(recs[-1]["NodeList"]), recs  # the requeued job ran elsewhere
    assert [x["State"].split()[0] for x in recs] == ["REQUEUED", "COMPLETED"], recs
    assert [e["step"] for e in events(run_root, "checkpoint_loaded")] == [loaded]
    assert max(m["step"] for m in _metrics(run_root) if m["restart"] == 0) == fault_step - 1  # nothing after it
    assert losses(run_root) == losses(ref.run_dir)  # every step, bitwise
    assert _final(run_root) == _final(ref.run_dir)  # and every step's grad norm and LR


def _hostnames(nodelist: str) -> list[str]:
    """A Slurm node list (`node[2-3]`) as its node names."""
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _final(run_dir: Path) -> dict[int, tuple[float, float, float]]:
    """step -> (loss, grad norm, lr) of the last line logged for each step."""
    return {m["step"]: (m["loss"], m["grad_norm"], m["lr"]) for m in _metrics(run_dir) if "loss" in m}
