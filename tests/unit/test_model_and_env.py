"""The model's shape arithmetic, the LR schedule, mesh-independent init, and DistEnv from Slurm's variables."""

from __future__ import annotations

import math
import shutil
import subprocess

import pytest
import torch

from jobs.config import compose
from jobs.launch.env import DistEnv, parse_hostlist
from jobs.models.model import Transformer, full_init_tensor, init_weights
from jobs.planner.arith import count_params
from jobs.trainer import lr_multiplier
from parallel.pipeline import stage_ids


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


def test_stage_ids_loop_and_v_orders() -> None:
    assert stage_ids(0, 2, 2, "interleaved_1f1b") == [0, 2]
    assert stage_ids(1, 4, 2, "interleaved_1f1b") == [1, 5]
    assert stage_ids(0, 2, 2, "zbv_zero_bubble") == [0, 3]


# What `scontrol show hostnames` of Slurm 22.05.8 printed for each hostlist on the local cluster: several
# bracket groups expand with the last one fastest, then the first, second, ... (Slurm's hostlist.c recurses
# from the rightmost group of the prefix); padding follows each range's lower bound.
_SLURM_HOSTNAMES = {
    "node[1-3,7]": ["node1", "node2", "node3", "node7"],
    "gpu[08-10],login1": ["gpu08", "gpu09", "gpu10", "login1"],
    "rack[1-2]-n[01-02]": ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"],
    "gpu[001-002,010],login1,rack[1-2]-n[1-2]": [
        "gpu001",
        "gpu002",
        "gpu010",
        "login1",
        "rack1-n1",
        "rack1-n2",
        "rack2-n1",
        "rack2-n2",
    ],
    "a[1-2]b[3-4]c[5-6]": ["a1b3c5", "a1b3c6", "a2b3c5", "a2b3c6", "a1b4c5", "a1b4c6", "a2b4c5", "a2b4c6"],
    "n[1-2][3-4]": ["n13", "n14", "n23", "n24"],
    "n[9-11],x[098-101]": ["n9", "n10", "n11", "x098", "x099", "x100", "x101"],
    "n[001-5]": ["n001", "n002", "n003", "n004", "n005"],
    "n[2,1],n1 vm,,node2": ["n2", "n1", "n1", "vm", "node2"],
}
# Hostlists `scontrol show hostnames` rejects ("Invalid hostlist" / "Invalid range").
_SLURM_INVALID = ["n[08-10]-ib,foo", "rack[1-2]-n[01-02]x", "n[3-1]", "n[a-b]", "n[]", "n[1-2]]"]


def _scontrol_hostnames(hostlist: str) -> subprocess.CompletedProcess:
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol not on PATH (the literal lists are checked without it)")
    try:
        return subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.skip("scontrol has no configuration here (it retries reading slurm.conf)")


@pytest.mark.parametrize("hostlist", list(_SLURM_HOSTNAMES))
def test_hostlist_parser_expands_bracket_groups_padding_and_lists_like_slurm(hostlist: str) -> None:
    assert parse_hostlist(hostlist) == _SLURM_HOSTNAMES[hostlist]


@pytest.mark.parametrize("hostlist", list(_SLURM_HOSTNAMES))
def test_hostlist_parser_agrees_with_the_real_scontrol(hostlist: str) -> None:
    real = _scontrol_hostnames(hostlist).stdout.split()
    assert real == _SLURM_HOSTNAMES[hostlist] == parse_hostlist(hostlist)


@pytest.mark.parametrize("hostlist", _SLURM_INVALID)
def test_hostlist_parser_rejects_what_slurm_rejects(hostlist: str) -> None:
    with pytest.raises(ValueError, match="invalid hostlist"):
        parse_hostlist(hostlist)


@pytest.mark.parametrize("hostlist", _SLURM_INVALID)
def test_the_real_scontrol_rejects_the_invalid_hostlists(hostlist: str) -> None:
    out = _scontrol_hostnames(hostlist)
    assert out.stdout == "" and "Invalid hostlist" in out.stderr


def test_distenv_from_slurm_variables() -> None:
    env = DistEnv.from_environ(
        {
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "8",
            "SLURM_NODEID": "1",
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NODELIST": "node[1-2]",
            "SLURM_JOB_NUM_NODES": "2",
            "SLURM_RESTART_COUNT": "2",
            "SLURMD_NODENAME": "node2",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size, env.node_rank) == (5, 1, 8, 4, 1)
    # No port derived from the job id (jobs 4242 and 24242 used to collide on 24242): 0 means rank 0
    # publishes the port the kernel gave its store (jobs.launch.rendezvous).
    assert env.master_addr == "node1" and env.master_port == 0
    assert env.restart_count == 2 and env.job_id == "4242" and env.hostname == "node2"
    assert env.attempt == "4242.2"


def test_distenv_without_a_launcher_says_how_to_start_ranks() -> None:
    with pytest.raises(RuntimeError, match="RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT not set"):
        DistEnv.from_environ({})
