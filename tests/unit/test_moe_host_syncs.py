"""One MoE layer's forward and backward stops the host at most once (torchtitan's count): on the grouped-GEMM path
never, on the padded path once (the counts that size the padding). Counted through the one seam every host read goes
through (parallel.ep.to_host) and the ops that read device data on the host on CUDA (tests/multiproc/_moe.py);
tests/multiproc/test_moe_ep.py counts the ep dispatch, tests/gpu/test_gpu_moe.py the same on CUDA.

It used to stop ~7 times per layer and microbatch: two `bincount`s, `.tolist()`, `repeat_interleave` without
`output_size`, the count exchange through host memory."""

from __future__ import annotations

import pytest
import torch

from jobs.config import compose
from jobs.models.model import Transformer, init_weights
from jobs.models.moe import MoE, grouped_mm_available
from tests.multiproc._moe import HostSyncs


def _layer(overrides: list[str]) -> MoE:
    cfg = compose(["model=tiny_moe", "model.moe_aux_loss_coef=0.01", *overrides]).model
    model = Transformer(cfg)
    init_weights(model, seed=0)
    layer = model.layers["1"].feed_forward
    assert isinstance(layer, MoE)
    return layer.train()


@pytest.mark.parametrize(
    "dtype,expected",
    [
        (torch.bfloat16, {}),  # torch._grouped_mm: the counts stay on the device
        (torch.float32, {"to_host": 1}),  # the padded bmm: its counts read once
    ],
    ids=["bf16_grouped_mm", "fp32_padded"],
)
def test_one_moe_layer_forward_and_backward_syncs_the_host_at_most_once(dtype: torch.dtype, expected: dict) -> None:
    layer = _layer([]).to(dtype)
    x = torch.randn(2, 16, layer.experts.w1.shape[1], generator=torch.Generator().manual_seed(0)).to(dtype)
    x.requires_grad_()
    assert grouped_mm_available(x, layer.experts.w1, layer.experts.w2, layer.experts.w3) is (dtype == torch.bfloat16)
    syncs = HostSyncs()
    with syncs:
        layer(x).float().square().mean().backward()
    assert dict(syncs.calls) == expected
    assert int(layer.router.tokens_per_expert.sum()) == 2 * 16 * 2  # counted on the device: every token's top-2
