"""Model FLOPs per token from the model config, and the achieved TFLOP/s and MFU of a step (pure functions)."""

from __future__ import annotations

from jobs.config import ModelConfig
from jobs.planner.arith import count_params

__all__ = ["model_flops_per_token", "achieved"]


def model_flops_per_token(m: ModelConfig, *, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward, without recomputation: 6N + 12·L·H·Q·T.

    N: parameters one token uses in matmuls, the embedding lookup excluded (the untied output head
    counts); L layers, H query heads, Q head dim, T sequence length. Source: Chowdhery et al. 2022,
    "PaLM", appendix B (the model-FLOPs definition of MFU), as in Megatron-LM's and nanoGPT's
    `estimate_mfu`. The attention term is not halved for the causal mask (PaLM's convention;
    `jobs.planner.arith.flops_per_token` halves it, as the Llama 3 paper does).
    """
    pc = count_params(m)
    n = pc.active - pc.embedding
    head_dim = m.dim // m.n_heads
    return 6.0 * n + 12.0 * m.n_layers * m.n_heads * head_dim * seq_len


def achieved(*, flops_per_token: float, tokens_per_step: int, world_size: int, step_time_s: float,
             peak_tflops: float | None) -> dict[str, float]:
    """{"tflops_per_rank"[, "mfu"]}: model FLOPs of one step spread over the world, per second;
    MFU only when a peak is given (a GPU's dense bf16 peak, `cluster.gpu_bf16_tflops`)."""
    tflops = flops_per_token * tokens_per_step / world_size / step_time_s / 1e12
    out = {"tflops_per_rank": tflops}
    if peak_tflops:
        out["mfu"] = tflops / peak_tflops
    return out
