"""`python -m jobs.calibrate` for real on 3 local ranks (an odd one: the pipeline probe runs on the
pair 0-1 while rank 2 only keeps step), and the planner predicting with the profile it wrote."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from jobs.config import compose
from jobs.planner.gate import build_plan
from jobs.planner.hardware import OPS
from tests.conftest import REPO

pytestmark = [pytest.mark.multiproc]


def test_calibrate_writes_every_figure_and_the_plan_predicts_with_them(tmp_path) -> None:
    out = tmp_path / "local_calibrated.yaml"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.calibrate",
            "model=tiny",
            "launcher.tasks_per_node=3",
            "calibrate.seconds=0.2",
            f"calibrate.out={out}",
            f"cluster.run_root={tmp_path / 'runs'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    prof = yaml.safe_load(out.read_text())
    assert "`python -m jobs.calibrate model=tiny" in prof["calibrated"]
    assert list(prof["matmul_tflops"]) == ["fp32"]  # tp 2 and 4 do not divide 3 ranks: not timed
    assert set(prof["collectives"]) == {f"{op}.intra" for op in OPS}
    # the host terms: FSDP2's hooks and copies cost milliseconds per unit on CPU ranks, the pipeline
    # schedule about as much per action; a probe that measured nothing would write 0
    assert (
        list(prof["fsdp_unit_host_s"]) == ["tp1"]
        and prof["fsdp_unit_host_s"]["tp1"] > 1e-5
        and prof["pp_action_host_s"] > 1e-5
    ), prof
    assert prof["optimizer_ns_per_param"] > 0 and prof["fs_write_GBps"] > 0 and prof["host_copy_GBps"] > 0
    cfg = compose(["model=tiny", "launcher.tasks_per_node=3", "mesh.pp=3", "mesh.dp_shard=1", "mesh.tp=1"])
    for key in (
        "calibrated",
        "matmul_tflops",
        "collectives",
        "fsdp_unit_host_s",
        "pp_action_host_s",
        "optimizer_ns_per_param",
    ):
        setattr(cfg.cluster, key, prof[key])
    step = build_plan(cfg, measure=False).step
    assert step["matmul_source"].startswith("cluster.matmul_tflops.fp32 calibrated (")
    # pp 3 of one block each (no FSDP: dp 1): 8 / 2 = 4 microbatches, a forward and a backward each
    assert step["host_s"] == pytest.approx(2 * 4 * prof["pp_action_host_s"])


def test_calibrate_on_two_ranks_times_every_collective(tmp_path) -> None:
    # Two ranks have no pairs beside the whole job: every collective was skipped as "the odd rank out" and
    # the fit raised KeyError (2026-12-03). tp 2 is timed, with FSDP2 over DTensor parameters.
    out = tmp_path / "two.yaml"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "jobs.calibrate",
            "model=tiny",
            "launcher.tasks_per_node=2",
            "calibrate.seconds=0.1",
            f"calibrate.out={out}",
            f"cluster.run_root={tmp_path / 'runs'}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    prof = yaml.safe_load(out.read_text())
    assert set(prof["collectives"]) == {f"{op}.intra" for op in OPS}
    assert all(v["alpha_s"] > 0 for v in prof["collectives"].values()), prof["collectives"]
    assert list(prof["matmul_tflops"]) == ["fp32", "fp32.tp2"] and set(prof["fsdp_unit_host_s"]) == {"tp1", "tp2"}
