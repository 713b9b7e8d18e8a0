"""On CUDA: the all-gather context parallel attention builds no mask (its causal structure follows from the chunk
layout: a lower-right causal SDPA per query chunk, flash / memory-efficient kernels) and equals plain causal attention.
Not yet run on a GPU."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from jobs.device import backend_for
from parallel.cp import ContextParallelAttention
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.gpu


class _BoolTensors(TorchDispatchMode):
    """Records the shapes of the boolean tensors any op makes (a materialised attention mask is one)."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.bool:
                self.shapes.append(tuple(t.shape))
        return out


def _one_rank(rank: int, world_size: int) -> dict:
    torch.cuda.set_device(rank)
    dist.init_process_group(backend_for("cuda"), rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    attn = ContextParallelAttention(
        init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))["cp"], impl="allgather", seq_len=256
    )
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 256, 8, 64, device="cuda", generator=g, dtype=torch.bfloat16)  # (b, seq, heads, d)
    k, v = (torch.randn(2, 256, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    seen = _BoolTensors()
    with seen:
        out = attn(q, k, v)
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), *(t.repeat_interleave(2, dim=2).transpose(1, 2) for t in (k, v)), is_causal=True
    ).transpose(1, 2)
    err = float((out.float() - ref.float()).abs().max())
    dist.destroy_process_group()
    return {"bool_shapes": seen.shapes, "max_err": err, "blocks": dict(attn.blocks)}


def test_allgather_context_parallel_builds_no_mask_on_cuda_and_equals_causal_attention() -> None:
    got = run_ranks(_one_rank, 1, init_pg=False, timeout=300).results[0]
    assert got["bool_shapes"] == [], got["bool_shapes"]
    assert got["max_err"] < 2e-2, got
    assert got["blocks"] == {"causal": 2, "full": 1}, got
