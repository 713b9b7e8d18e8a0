"""The model's shape arithmetic, the LR schedule, mesh-independent init, and DistEnv from Slurm's variables."""

from __future__ import annotations

import math

import pytest
import torch

from jobs.config import compose
from jobs.launch.env import DistEnv, _parse_hostlist, port_from_job_id
from jobs.model import Transformer, full_init_tensor, init_weights
from jobs.planner.arith import count_params
from jobs.trainer import lr_multiplier
from parallel.pipeline import layer_ranges, stage_ids


@pytest.mark.parametrize("model", ["tiny", "llama3_8b"])
def test_the_planners_param_count_matches_the_built_model(model: str) -> None:
    cfg = compose([f"model={model}"]).model
    with torch.device("meta"):
        built = sum(p.numel() for p in Transformer(cfg).parameters())
    assert count_params(cfg).total == built


def test_init_is_a_function_of_seed_and_name_only() -> None:
    cfg = compose([]).model
    a, b = Transformer(cfg), Transformer(cfg)
    init_weights(a, seed=3)
    init_weights(b, seed=3)
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), n
    w = full_init_tensor("layers.1.attention.wo.weight", torch.Size([64, 64]), cfg, 3)
    assert torch.equal(w, dict(a.named_parameters())["layers.1.attention.wo.weight"])
    assert abs(w.std().item() - 0.02 / math.sqrt(4)) < 2e-3  # depth-scaled init of layer 1
    assert torch.equal(dict(a.named_parameters())["norm.weight"], torch.ones(64))


def test_lr_warms_up_linearly_then_decays_by_cosine_to_the_floor() -> None:
    f = lambda s: lr_multiplier(s, warmup_steps=4, total_steps=24, min_lr_ratio=0.1)  # noqa: E731
    assert [f(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert f(14) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the decay
    assert f(24) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)


def test_layers_split_evenly_with_the_remainder_on_early_stages() -> None:
    assert [list(r) for r in layer_ranges(5, 2)] == [[0, 1, 2], [3, 4]]
    assert [len(r) for r in layer_ranges(8, 8)] == [1] * 8


def test_stage_ids_loop_and_v_orders() -> None:
    assert stage_ids(0, 2, 2, "interleaved_1f1b") == [0, 2]
    assert stage_ids(1, 4, 2, "interleaved_1f1b") == [1, 5]
    assert stage_ids(0, 2, 2, "zbv_zero_bubble") == [0, 3]


def test_hostlist_expansion_handles_ranges_padding_and_lists() -> None:
    assert _parse_hostlist("node[1-3,7]") == ["node1", "node2", "node3", "node7"]
    assert _parse_hostlist("gpu[08-10],login1") == ["gpu08", "gpu09", "gpu10", "login1"]


def test_distenv_from_slurm_variables() -> None:
    env = DistEnv.from_environ({
        "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODEID": "1",
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_NUM_NODES": "2",
        "SLURM_RESTART_COUNT": "2", "SLURMD_NODENAME": "node2",
    })
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (5, 1, 8, 4, 1)
    assert env.master_addr == "node1" and env.master_port == port_from_job_id(4242)
    assert env.restart_count == 2 and env.job_id == "4242" and env.hostname == "node2"


def test_distenv_without_a_launcher_says_how_to_start_ranks() -> None:
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        DistEnv.from_environ({})
