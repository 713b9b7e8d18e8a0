"""The gate plans memory in the run's compute dtype: an fp32 run (CPU ranks, or train.mixed_precision=fp32 on GPUs)
saves fp32 activations, logits, receive buffers and gathered parameters, which `rank_memory(compute_bytes=4)`
counts (tests/multiproc/test_plan_vs_measured.py: within 0.85-1.20 of the measured fp32 peak on CPU). The gate
used to leave compute_bytes at its bf16 default, planning an fp32 run's activations at about half their size."""

from __future__ import annotations

import pytest

from jobs.config import compose
from jobs.planner import arith as P
from jobs.planner.gate import build_plan
from jobs.planner.measure import stage_shapes
from jobs.validate import validate

# the multiproc test's cases: the tiny model, fp32 on CPU, sequences of 128 so activations dominate
COMMON = [
    "model=tiny",
    "train.seq_len=128",
    "train.micro_batch=2",
    "train.global_batch=8",
    "checkpoint.enabled=false",
    "launcher.tasks_per_node=2",
    "mesh.dp_replicate=1",
]
MESHES = {
    "dp_shard2": ["mesh.pp=1", "mesh.dp_shard=2", "mesh.tp=1"],
    "pp2_1f1b": ["mesh.pp=2", "mesh.dp_shard=1", "mesh.tp=1"],
}


def _planned(cfg, pp_rank: int, compute_bytes: int) -> P.RankMemory:
    """tests/multiproc/test_plan_vs_measured.py's `_planned`, which it checks against the measured bytes."""
    d, t, dims = validate(cfg), cfg.train, validate(cfg).dims
    return P.rank_memory(
        cfg.model,
        stage_shapes(cfg, d)[pp_rank],
        tp=dims.tp,
        fsdp=dims.dp_shard,
        pp=dims.pp,
        microbatches=d.microbatches,
        stages_per_rank=d.stages_per_rank,
        schedule=cfg.mesh.pp_schedule,
        seq_len=t.seq_len,
        micro_batch=t.micro_batch,
        sequence_parallel=cfg.mesh.sequence_parallel and dims.tp > 1,
        loss_parallel=cfg.mesh.loss_parallel,
        activation_checkpointing=t.activation_checkpointing,
        ac_every=t.ac_every,
        pp_rank=pp_rank,
        compute_bytes=compute_bytes,
    )


@pytest.mark.parametrize("mesh", sorted(MESHES))
def test_the_gate_plans_an_fp32_cpu_run_in_fp32(mesh):
    cfg = compose(COMMON + MESHES[mesh] + ["cluster=local"])
    plan = build_plan(cfg, measure=False)
    for row in plan.roles:
        fp32, bf16 = _planned(cfg, row["pp_rank"], 4), _planned(cfg, row["pp_rank"], 2)
        assert fp32.activation_bytes > 1.5 * bf16.activation_bytes  # the dtype matters at this shape
        for key in ("activation_bytes", "logits_bytes", "unsharded_bytes", "p2p_bytes", "peak_bytes"):
            assert row[key] == fp32.as_dict()[key], key


def test_a_gpu_run_in_fp32_plans_more_activation_memory_than_in_bf16():
    gpu = [
        "model=tiny",
        "cluster=h100_ib",
        "launcher.nodes=1",
        "launcher.tasks_per_node=8",
        "train.global_batch=8",
        "checkpoint.interval=auto",
    ]
    bf16 = build_plan(compose(gpu + ["train.mixed_precision=bf16"]), measure=False)
    fp32 = build_plan(compose(gpu + ["train.mixed_precision=fp32"]), measure=False)
    for a, b in zip(bf16.roles, fp32.roles):
        assert b["activation_bytes"] > 1.5 * a["activation_bytes"]
        assert b["logits_bytes"] == a["logits_bytes"] * 12 // 10  # fp32: 12 bytes per logit, bf16 10
