"""On CUDA: the routed experts run as grouped GEMMs (`torch._grouped_mm`, bf16) equal to the padded batched matmul,
and one MoE layer's forward and backward never stops the host on that path (once on the padded path), counted by
torch.cuda.set_sync_debug_mode. The CPU tier counts the same through its seam (tests/unit/test_moe_host_syncs.py).
Not yet run on a GPU."""

from __future__ import annotations

import warnings

import pytest
import torch

from jobs.config import compose
from jobs.models.model import Transformer, init_weights
from jobs.models.moe import MoE, grouped_mm_available, grouped_swiglu, padded_swiglu

pytestmark = pytest.mark.gpu


def _layer(overrides: list[str], dtype: torch.dtype) -> MoE:
    cfg = compose(["model=tiny_moe", "model.moe_aux_loss_coef=0.01", *overrides]).model
    model = Transformer(cfg)
    init_weights(model, seed=0)
    return model.layers["1"].feed_forward.to(device="cuda", dtype=dtype).train()


def test_grouped_gemm_equals_the_padded_bmm_on_cuda_in_bf16() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.tensor([37, 0, 130, 5, 64, 1, 0, 19], device="cuda")
    rows = int(counts.sum())
    x = torch.randn(rows, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    w1, w3 = (torch.randn(8, 64, 32, device="cuda", generator=g).bfloat16().requires_grad_() for _ in range(2))
    w2 = torch.randn(8, 32, 64, device="cuda", generator=g).bfloat16().requires_grad_()
    assert grouped_mm_available(x, w1, w2, w3)
    grad = torch.randn(rows, 64, device="cuda", generator=g).bfloat16()
    outs = {}
    for path in ("grouped", "padded"):
        for t in (x, w1, w2, w3):
            t.grad = None
        if path == "grouped":
            y = grouped_swiglu(x, counts, w1, w2, w3)
        else:
            y = padded_swiglu(x, counts, counts.tolist(), w1, w2, w3)
        y.backward(grad)
        outs[path] = [y.float(), *(t.grad.float() for t in (x, w1, w2, w3))]
    for a, b in zip(outs["grouped"], outs["padded"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "dtype,overrides,syncs",
    [(torch.bfloat16, [], 0), (torch.float32, [], 1)],
    ids=["bf16_grouped_mm", "fp32_padded"],
)
def test_one_moe_layer_syncs_the_host_at_most_once_on_cuda(
    dtype: torch.dtype, overrides: list[str], syncs: int
) -> None:
    layer = _layer(overrides, dtype)
    x = torch.randn(2, 64, 64, device="cuda", dtype=dtype, requires_grad=True)
    assert grouped_mm_available(x, layer.experts.w1, layer.experts.w2, layer.experts.w3) is (syncs == 0)
    layer(x).float().square().mean().backward()  # warm-up: lazy CUDA init and allocations outside the count
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            layer(x).float().square().mean().backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    stalls = [w for w in seen if "synchroniz" in str(w.message)]
    assert len(stalls) == syncs, [str(w.message) for w in stalls]
