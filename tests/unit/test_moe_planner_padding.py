"""The planner prices the padded expert matmul where it remains (fp32, or rows torch._grouped_mm cannot take): the
routed activations grow by PADDED_LOAD; on the grouped GEMM (bf16, aligned rows) they do not."""

from __future__ import annotations

import pytest
import torch

from jobs.config import compose
from jobs.models.moe import grouped_mm_available
from jobs.planner import memory
from jobs.planner.memory import PADDED_LOAD, expert_padding, layer_activation_bytes


@pytest.mark.parametrize(
    "overrides,tp,compute_bytes,padding",
    [
        ([], 1, 2, 1.0),  # bf16, rows of 128 and 64 bytes: the grouped GEMM
        ([], 2, 2, 1.0),  # tp2 splits the hidden dim: 32 bytes, still aligned
        ([], 1, 4, PADDED_LOAD),  # fp32 on CUDA: the padded bmm
        (["model.moe_ffn_dim=36"], 1, 2, PADDED_LOAD),  # 72-byte rows: the padded bmm
    ],
)
def test_expert_padding_follows_where_the_grouped_gemm_runs(
    overrides: list[str], tp: int, compute_bytes: int, padding: float
) -> None:
    m = compose(["model=tiny_moe", *overrides]).model
    assert expert_padding(m, tp=tp, compute_bytes=compute_bytes) == padding
    if compute_bytes == 2:  # the trainer's own test on bf16 operands of the same shapes
        x = torch.zeros(4, m.dim, dtype=torch.bfloat16)
        w = torch.zeros(2, m.dim, m.moe_ffn_dim // tp, dtype=torch.bfloat16)
        assert grouped_mm_available(x, w, w.transpose(1, 2).contiguous()) is (padding == 1.0)


def test_padded_routed_activations_cost_padded_load_times_the_routed_rows(monkeypatch) -> None:
    m = compose(["model=tiny_moe"]).model
    kw = dict(layer=1, seq_len=256, micro_batch=2, tp=1, compute_bytes=4)
    padded = layer_activation_bytes(m, **kw)
    monkeypatch.setattr(memory, "PADDED_LOAD", 1.0)
    unpadded = layer_activation_bytes(m, **kw)
    routed = 4 * 256 * 2 * m.experts_per_token * (m.dim + 4 * m.moe_ffn_dim)  # fp32 copies of input + SwiGLU
    assert padded - unpadded == int(routed * (PADDED_LOAD - 1))
