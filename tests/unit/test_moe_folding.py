"""MoE parallel folding: the MoE layers' mesh (pp, dp_replicate, edp, ep, etp) covers the attention mesh's ranks
exactly, a degree that does not fold is refused naming mesh.ep and the degrees that do, ep with tp validates (the
experts tensor-parallel over the attention's tp ranks, etp = tp), and jobs.plan and the run's first log lines print
both meshes."""

from __future__ import annotations

import math

import pytest

from jobs.config import compose
from jobs.planner.gate import build_plan
from jobs.planner.render import render
from jobs.validate import validate
from parallel.config import MeshConfig
from parallel.dims import ParallelDims, fold_moe_mesh


@pytest.mark.parametrize(
    "shape",
    [
        dict(pp=16, dp_replicate=1, dp_shard=128, cp=1, tp=1, ep=64),  # DeepSeek-V3 report §3.2: PP16 EP64 (2,048 GPUs)
        dict(pp=2, dp_replicate=2, dp_shard=4, cp=2, tp=2, ep=8),  # ep folded over dp_shard * cp, experts tp-sharded
        dict(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1, ep=2),  # what jobs.train builds: ep within dp_shard
    ],
)
def test_the_moe_mesh_covers_the_attention_meshs_ranks_exactly(shape: dict) -> None:
    moe = fold_moe_mesh(**shape)
    assert math.prod(moe.values()) == math.prod(shape[a] for a in ("pp", "dp_replicate", "dp_shard", "cp", "tp"))
    assert moe["ep"] == shape["ep"] and moe["etp"] == shape["tp"] and moe["pp"] == shape["pp"]
    assert moe["edp"] * moe["ep"] == shape["dp_shard"] * shape["cp"]


def test_an_ep_that_does_not_fold_is_refused_with_the_degrees_that_do() -> None:
    with pytest.raises(
        ValueError,
        match=r"mesh\.ep\(4\) must divide mesh\.dp_shard\(2\) \* mesh\.cp\(3\) = 6: .* "
        r"set mesh\.ep to one of 1, 2, 3, 6$",
    ):
        fold_moe_mesh(pp=1, dp_replicate=1, dp_shard=2, cp=3, tp=1, ep=4)
    cfg = compose(["model=tiny_moe", "mesh=single", "mesh.dp_shard=2", "mesh.ep=4", "launcher.tasks_per_node=2"])
    with pytest.raises(ValueError, match=r"mesh\.ep\(4\) must divide mesh\.dp_shard\(2\)"):
        build_plan(cfg, measure=False)


def test_the_trained_meshes_are_described_as_the_run_logs_them() -> None:
    dims = ParallelDims.from_config(MeshConfig(dp_shard=4, ep=2), world_size=4)
    assert dims.describe_meshes() == "attention dp_shard4 | MoE edp2 * ep2 (folded over the same 4 ranks)"
    dense = ParallelDims.from_config(MeshConfig(dp_shard=2, tp=2), world_size=4)
    assert dense.describe_meshes() == "dp_shard2 * tp2 (every layer: mesh.ep=1)"


def test_jobs_plan_prints_both_meshes_of_the_deepseek_v3_job() -> None:
    cfg = compose(["+experiment=deepseek_v3_2048gpu"])
    text = render(build_plan(cfg, measure=False))
    assert "meshes: attention pp16 * dp_shard128 | MoE pp16 * edp2 * ep64 (folded over the same 2048 ranks)" in text


def test_jobs_train_folds_ep_over_cp_and_refuses_a_fold_that_does_not_fit() -> None:
    dims = ParallelDims.from_config(MeshConfig(cp=2, ep=2), world_size=2)
    assert dims.describe() == "cp2 (ep2 within dp_shard*cp)"
    assert dims.describe_meshes() == "attention cp2 | MoE edp1 * ep2 (folded over the same 2 ranks)"
    with pytest.raises(
        ValueError, match=r"mesh\.ep\(4\) must divide mesh\.dp_shard\(1\) \* mesh\.cp\(2\) = 2: .* one of 1, 2$"
    ):
        ParallelDims.from_config(MeshConfig(cp=2, ep=4), world_size=2)


def test_ep_with_tp_validates_and_jobs_plan_prints_the_experts_tp_axis() -> None:
    over = ["model=tiny_moe", "mesh=single", "mesh.dp_shard=2", "mesh.tp=2", "mesh.ep=2", "launcher.tasks_per_node=4"]
    d = validate(compose(over))
    assert (d.dims.dp_shard, d.dims.tp, d.dims.ep) == (2, 2, 2)
    text = render(build_plan(compose(over), measure=False))
    assert "meshes: attention dp_shard2 * tp2 | MoE edp1 * ep2 * etp2 (folded over the same 4 ranks)" in text
    assert "ep2: planned analytically, training built (parallel/ep.py)" in text
    validate(compose(["model=tiny_moe", "mesh=single", "mesh.tp=2", "launcher.tasks_per_node=2"]))  # tp alone
