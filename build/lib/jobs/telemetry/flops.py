"""Model FLOPs per token from the model config, and the achieved TFLOP/s and MFU of a step (pure functions)."""

from __future__ import annotations

from jobs.config import ModelConfig
from jobs.planner.arith import flops_per_token

__all__ = ["model_flops_per_token", "achieved"]


def model_flops_per_token(m: ModelConfig, *, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward, without recomputation: the planner's formula
    (`jobs.planner.arith.flops_per_token`), so the MFU a run logs and the MFU `jobs.plan` predicts
    count the same work: 6N + 6·L·T·H·(d_qk + d_v)/2 (N the active matmul parameters, the embedding
    lookup and norms excluded; causal attention halved, as the Llama 3 paper's MFU; MLA's 192/128 head
    dims). PaLM's appendix B convention (12·L·H·Q·T, not halved) counts the attention term twice this."""
    return flops_per_token(m, seq_len=seq_len)


def achieved(*, flops_per_token: float, tokens_per_step: int, world_size: int, step_time_s: float,
             peak_tflops: float | None) -> dict[str, float]:
    """{"tflops_per_rank"[, "mfu"]}: model FLOPs of one step spread over the world, per second;
    MFU only when a peak is given (a GPU's dense bf16 peak, `cluster.gpu_bf16_tflops`)."""
    tflops = flops_per_token * tokens_per_step / world_size / step_time_s / 1e12
    out = {"tflops_per_rank": tflops}
    if peak_tflops:
        out["mfu"] = tflops / peak_tflops
    return out
