"""Context parallel's arithmetic (zig-zag chunks, the ring's block list) and its config checks."""

from __future__ import annotations

import pytest
import torch

from jobs.config import compose
from jobs.validate import validate
from parallel.cp import ring_blocks, zigzag_positions


def test_zigzag_gives_rank_i_chunks_i_and_2cp_minus_1_minus_i_covering_the_sequence_once() -> None:
    assert zigzag_positions(8, cp=2, cp_rank=0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, cp=2, cp_rank=1).tolist() == [2, 3, 4, 5]
    allpos = torch.cat([zigzag_positions(48, cp=4, cp_rank=r) for r in range(4)])
    assert sorted(allpos.tolist()) == list(range(48))


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_ring_computes_each_causal_block_once_and_every_rank_the_same_work(cp: int) -> None:
    blocks = [b for r in range(cp) for b in ring_blocks(cp, r)]
    pairs = sorted((q, k) for _, q, k, _ in blocks)
    assert pairs == sorted((q, k) for q in range(2 * cp) for k in range(q + 1))  # exact causal coverage, no repeats
    assert all(kind == ("causal" if q == k else "full") for _, q, k, kind in blocks)
    for r in range(cp):  # 2 causal (half-cost) + 2cp-1 full blocks on every rank: balanced
        kinds = [kind for *_, kind in ring_blocks(cp, r)]
        assert (kinds.count("causal"), kinds.count("full")) == (2, 2 * cp - 1)


def test_contiguous_chunks_would_be_unbalanced() -> None:
    """Why zig-zag: with rank r holding one contiguous chunk r, rank cp-1 would compute cp blocks and rank 0 one."""
    cp = 4
    work = [sum(1 for k in range(cp) if k <= r) for r in range(cp)]
    assert work == [1, 2, 3, 4]


def _compose(*extra: str):
    base = {"mesh.pp": "1", "mesh.tp": "2", "mesh.cp": "2", "mesh.dp_shard": "2"}
    base.update(e.split("=", 1) for e in extra)
    return compose([f"{k}={v}" for k, v in base.items()])


def test_a_cp_mesh_validates_and_fsdp_shards_over_dp_shard_times_cp() -> None:
    d = validate(_compose("mesh.cp_impl=ring"))
    assert (d.dims.cp, d.dims.dp, d.dims.fsdp_enabled) == (2, 2, True)
    assert d.dims.describe() == "dp_shard2 * cp2 * tp2"
    assert validate(compose(["mesh.pp=1", "mesh.tp=1", "mesh.cp=8", "mesh.dp_shard=1"])).dims.fsdp_enabled


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["mesh.cp_impl=ulysses"], "mesh.cp_impl='ulysses' is not one of allgather, ring"),
        (["train.seq_len=30"], "train.seq_len(30) % (2 * mesh.cp(2)) = 2 != 0"),
        (
            ["train.seq_len=20", "mesh.tp=4", "mesh.dp_shard=1"],
            "train.seq_len(20) / mesh.cp(2) = 10 is not divisible by mesh.tp(4)",
        ),
        (["train.compile=true", "mesh.tp=1", "mesh.dp_shard=4"], "train.compile=true with mesh.cp(2) > 1"),
    ],
)
def test_cp_config_errors_name_the_override(extra: list[str], needle: str) -> None:
    with pytest.raises(ValueError) as e:
        validate(_compose(*extra))
    assert needle in str(e.value)
