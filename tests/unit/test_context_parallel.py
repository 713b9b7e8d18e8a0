"""Context parallel's arithmetic (zig-zag chunks, the ring's block list), the ring's per-block kernel choice and
calls, and its config checks."""

from __future__ import annotations

import pytest
import torch

from jobs.config import compose
from jobs.planner.gate import validate_for_planning
from jobs.validate import validate
from parallel.config import RING_KERNEL_NAMES, ring_kernel, ring_kernel_note
from parallel.cp import (
    RING_KERNELS,
    block_backward,
    block_forward,
    ring_blocks,
    zigzag_positions,
)


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


@pytest.mark.parametrize(
    "device,dtype,head_dim,capability,kernel",
    [
        ("cpu", "float32", 64, (0, 0), "flash_cpu"),
        ("cpu", "bfloat16", 100, (0, 0), "flash_cpu"),  # torch's CPU flash kernel takes any head dim
        ("cuda", "bfloat16", 128, (9, 0), "flash"),
        ("cuda", "float16", 256, (8, 0), "flash"),
        ("cuda", "bfloat16", 512, (9, 0), "efficient"),  # past FlashAttention-2's 256
        ("cuda", "float32", 64, (9, 0), "efficient"),  # flash has no fp32 kernel
        ("cuda", "bfloat16", 64, (7, 5), "efficient"),  # flash needs sm80+
        ("cuda", "bfloat16", 60, (9, 0), "unfused"),  # neither takes a head dim off a multiple of 8
        ("mps", "float32", 64, (0, 0), "unfused"),
    ],
)
def test_the_ring_picks_its_per_block_kernel_by_device_dtype_and_head_dim(device, dtype, head_dim, capability, kernel):
    assert ring_kernel(device, dtype, head_dim, capability=capability) == kernel
    assert kernel == "unfused" or kernel in RING_KERNELS  # parallel/config.py's names are parallel/cp.py's kernels
    assert set(RING_KERNELS) == set(RING_KERNEL_NAMES)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
@pytest.mark.parametrize("causal", [True, False])
def test_the_cuda_block_kernels_are_called_as_their_schemas_say_on_meta_tensors(kernel: str, causal: bool) -> None:
    """torch's meta functions check each call's arguments and give the outputs' shapes: the log-sum-exp has one row
    per query (the memory-efficient kernel pads it to a multiple of 32: 48 -> 64, cut off and padded again)."""
    dtype = torch.bfloat16 if kernel == "flash" else torch.float32
    q, k, v = (torch.empty(2, 4, 48, 64, device="meta", dtype=dtype) for _ in range(3))
    out, lse, saved = block_forward(kernel, q, k, v, causal)
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.shape == (2, 4, 48) and lse.dtype == torch.float32
    grads = block_backward(kernel, out, q, k, v, out, lse, causal, saved)
    assert [tuple(g.shape) for g in grads] == [(2, 4, 48, 64)] * 3


def test_the_planner_says_whether_the_rings_blocks_are_flash_attention_on_cuda() -> None:
    mesh = ["mesh.pp=1", "mesh.cp=2", "mesh.tp=1", "mesh.dp_shard=2", "launcher.tasks_per_node=4"]

    def cp_note(*extra: str) -> str:
        return next(n for n in validate_for_planning(compose([*mesh, *extra]))[1] if n.startswith("cp2:"))

    assert cp_note("mesh.cp_impl=ring").endswith("; the ring's blocks run flash attention on CUDA")
    assert "the ring's blocks are NOT flash on CUDA: the memory-efficient kernel" in cp_note(
        "mesh.cp_impl=ring", "train.mixed_precision=fp32"
    )
    assert "ring's blocks" not in cp_note("mesh.cp_impl=allgather")
    assert "head dim 60 is not a multiple of 8" in ring_kernel_note(fp32=False, head_dim=60)


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
