"""The planner prices the padded expert matmul where it remains (fp32, or rows torch._grouped_mm cannot take): the
routed activations grow by PADDED_LOAD; on the grouped GEMM (bf16, aligned rows) they do not."""

from __future__ import annotations

import pytest
import torch

from jobs.config import compose
from jobs.models.moe import MoE, grouped_mm_available
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


def _saved_bytes(moe: torch.nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd keeps for `moe`'s backward (its parameters and its input aside)."""
    skip = {p.untyped_storage().data_ptr() for p in moe.parameters()} | {x.untyped_storage().data_ptr()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        moe(x)
    return sum(seen.values())


def test_moe_activations_priced_equal_what_the_block_keeps_for_backward() -> None:
    """bf16 on the grouped GEMM (no padding), one process: the bytes one MoE block's FFN half keeps for backward,
    measured with saved_tensors_hooks, equal `moe_activation_bytes` (to 0.1%: the grouped GEMM's int32 offsets); the
    routed outputs the router's weights multiply are priced (+k x dim per token: 25% of the routed rows' other bytes
    at tiny_moe's dim 64, moe_ffn_dim 32; ~47% at DeepSeek-V3's 7168 and 2048)."""
    m = compose(["model=tiny_moe"]).model
    torch.manual_seed(0)
    moe = MoE(m).to(torch.bfloat16).train()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    tokens = 4 * 64
    x = torch.randn(4, 64, m.dim, dtype=torch.bfloat16, requires_grad=True)
    measured = _saved_bytes(moe, x)
    priced = memory.moe_activation_bytes(m, tokens=tokens, compute_bytes=2)
    outputs = 2 * tokens * m.experts_per_token * m.dim
    assert priced == pytest.approx(measured, rel=1e-3), (priced, measured)
    assert priced - outputs < 0.85 * measured  # without the outputs: 18% short
    ds = compose(["model=deepseek_v3"]).model
    assert ds.dim / (ds.dim + 4 * ds.moe_ffn_dim) == pytest.approx(0.467, abs=1e-3)
