"""Sweep points are pruned on the login node by the config checks and by the planner's analytic checks."""

from __future__ import annotations

from jobs.config import compose
from jobs.launch.sweep import why_infeasible

H100 = [
    "launcher=slurm",
    "cluster=h100_ib",
    "launcher.nodes=1",
    "launcher.tasks_per_node=8",
    "run.dir=/lustre/meshjob/runs/sweep-test",
    "train.global_batch=8",
    "train.micro_batch=1",
    "train.seq_len=4096",
    "train.steps=10000",
    "checkpoint.interval=auto",
]


def test_a_point_that_fits_is_kept() -> None:
    assert why_infeasible(compose([*H100, "model=llama3_8b", "mesh.pp=1", "mesh.tp=1", "mesh.dp_shard=-1"])) is None


def test_a_point_that_does_not_fit_in_gpu_memory_is_pruned_by_the_planner() -> None:
    # Llama 3 70B sharded 8 ways holds ~70.6e9 * 16 B / 8 = 141 GB of params+grads+AdamW per GPU > 80 GB.
    # signal_delay_s: the stop path of a 70B async save (the save in flight, then a whole write) needs more than 120 s
    why = why_infeasible(
        compose(
            [*H100, "model=llama3_70b", "mesh.pp=1", "mesh.tp=1", "mesh.dp_shard=-1", "launcher.signal_delay_s=600"]
        )
    )
    assert why is not None and why.startswith("memory: peak") and "cluster.gpu_mem_gib(80.0)" in why


def test_a_point_with_a_bad_mesh_is_pruned_with_the_arithmetic() -> None:
    why = why_infeasible(compose([*H100, "mesh.pp=2", "mesh.tp=8", "mesh.dp_shard=1"]))
    assert why is not None and "= 16 != world size 8" in why
