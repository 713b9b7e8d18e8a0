"""Model FLOPs per token from the model config, and the achieved TFLOP/s and MFU of a step (pure functions)."""

from __future__ import annotations

from jobs.config import ModelConfig
from jobs.planner.arith import attention_head_dims, flops_per_token

__all__ = [
    "model_flops_per_token",
    "attention_flops_per_token",
    "achieved",
    "mfu_text",
    "MFU_CONVENTION",
    "MFU_CONVENTION_WHOLE",
]

# Every MFU figure we print or log uses this convention, and says so next to the number. torchtitan
# (torchtitan/models/utils.py, get_dense_model_nparams_and_flops: 6·N + 12·L·H·Q·T, "we follow the convention
# and do not account for sparsity in causal attention"), nanoGPT and PaLM's appendix B count the attention
# term whole, twice ours; the Llama 3 paper's 38-43% MFU halves it, as we do. The same run has a higher MFU
# in their convention (the gap grows with seq_len / dim).
MFU_CONVENTION = "causal attention halved"  # as Llama 3's MFU
MFU_CONVENTION_WHOLE = "attention whole"  # torchtitan's, PaLM appendix B's, nanoGPT's


def attention_flops_per_token(m: ModelConfig, *, seq_len: int) -> float:
    """The causal attention term of one token's training FLOPs as we count it: 6·L·T·H·(d_qk + d_v)/2
    (QK^T and AV, 2·H·(d_qk + d_v)·T forward, x3 for training, halved by the causal mask)."""
    qk, v = attention_head_dims(m)
    return 6.0 * m.n_layers * seq_len * m.n_heads * (qk + v) / 2.0


def model_flops_per_token(m: ModelConfig, *, seq_len: int, causal_halved: bool = True) -> float:
    """Training FLOPs per token, forward + backward, without recomputation: the planner's formula
    (`jobs.planner.arith.flops_per_token`), so the MFU a run logs and the MFU `jobs.plan` predicts
    count the same work: 6N + 6·L·T·H·(d_qk + d_v)/2 (N the active matmul parameters, the embedding
    lookup and norms excluded; causal attention halved, as the Llama 3 paper's MFU; MLA's 192/128 head
    dims). `causal_halved=False`: the attention term counted whole (torchtitan's and PaLM's appendix B
    convention, 12·L·H·Q·T for GQA), for comparing with their MFU figures."""
    ours = flops_per_token(m, seq_len=seq_len)
    return ours if causal_halved else ours + attention_flops_per_token(m, seq_len=seq_len)


def achieved(
    *, flops_per_token: float, tokens_per_step: int, world_size: int, step_time_s: float, peak_tflops: float | None
) -> dict[str, float]:
    """{"tflops_per_rank"[, "mfu"]}: model FLOPs of one step spread over the world, per second;
    MFU only when a peak is given (a GPU's dense bf16 peak, `cluster.gpu_bf16_tflops`)."""
    tflops = flops_per_token * tokens_per_step / world_size / step_time_s / 1e12
    out = {"tflops_per_rank": tflops}
    if peak_tflops:
        out["mfu"] = tflops / peak_tflops
    return out


def mfu_text(mfu: float) -> str:
    """ "MFU 41.2% (causal attention halved)": an MFU figure never without its convention."""
    return f"MFU {mfu:.1%} ({MFU_CONVENTION})"
