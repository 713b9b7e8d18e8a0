"""Bytes the memory-bandwidth-bound work of a training step moves through HBM: the element-wise and
reduction ops between the matmuls (RMSNorm, residual adds, RoPE, the GQA repeat, SwiGLU's gate, the
attention output's copy, the loss's casts and log-softmax), which run at the memory's rate, not the
tensor cores'.

Counted as our block runs them in eager PyTorch (jobs/models/model.py), one kernel per op, each reading its
inputs and writing its output once, per token of one rank (tensor-parallel shards; the norms and residual
adds on 1/tp of the tokens under sequence parallelism):
  RMSNorm (x.float(), pow, mean, x * rsqrt, type_as, * weight): 36 bytes per element, two per block;
  residual adds: 6 bytes per element (two bf16 reads, one write), two per block;
  RoPE on q and k (four products, two sums in fp32, cat, cast): 38 bytes per rotated element;
  the GQA repeat of k and v to every head: 2 bytes read per kv element, 2 written per q element, twice;
  the attention output's transpose + reshape copy: 4 bytes per element;
  SwiGLU's silu(w1 x) * w3 x: 10 bytes per hidden element;
  the loss on the last stage: the logits' fp32 copy, log-softmax, its gradient and the cast back: 32
  bytes per logit (vocab / tp with loss parallel).
Backward moves about twice the forward's bytes (each op reads its saved input and the incoming gradient
and writes the outgoing one): a step is 3 x the forward's traffic, plus one forward per recomputed block.
Attention itself (flash / memory-efficient SDPA) is counted as matmul FLOPs. With `model.sdpa_backend=math`
torch's math backend materialises the scores (aten/src/ATen/native/transformers/attention.cpp,
`_scaled_dot_product_attention_math`, bf16 kept with `allow_fp16_bf16_reduction_math_sdp`), and every score of
every local head moves through HBM (`score_bytes_per_token`): forward, QK^T writes it (2 bytes), the causal mask's
add reads and writes it (4), `_safe_softmax` runs softmax (4), `eq` against -inf (2 + 1), `all` over the row (1)
and `where` (4), and PV reads the probabilities (2); backward, dV's GEMM reads them (2), dP is written (2), the
softmax backward reads both and writes dS (6), and dQ's and dK's GEMMs read dS (4). With `model.norm_kernel=fused`
each RMSNorm is torch's fused kernel on CUDA (`F.rms_norm` -> `_fused_rms_norm`, which shares the layer norm kernels
of aten/src/ATen/native/cuda/layer_norm_kernel.cu): forward it reads x and writes y once (2 elements), backward the
input-gradient kernel reads dy and x and writes dx and the weight-gradient kernel reads dy and x again (5); the fp32
rstd, 4 bytes a row, is left out. These two have their own forward and backward bytes (`two_way_bytes_per_token`). The rate is the GPU's HBM
bandwidth from its datasheet (`cluster.gpu_hbm_GBps`), an upper bound on what the ops reach: the time
is a lower bound. A fused or compiled block moves less (Megatron-LM's fused kernels, torch.compile).

Pure functions of plain numbers and `ModelConfig`; no torch.
"""

from __future__ import annotations

from jobs.config import ModelConfig
from jobs.planner.params import COMPUTE_BYTES

__all__ = ["block_bytes_per_token", "loss_bytes_per_token", "score_bytes_per_token", "two_way_bytes_per_token"]

NORM_BYTES = 36  # per element: x.float() 2+4, pow 4+4, mean 4, x*rsqrt 4+4, type_as 4+2, *weight 2+2
RESIDUAL_BYTES = 6
ROPE_BYTES = 38
REPEAT_BYTES = 2
COPY_BYTES = 4
SWIGLU_BYTES = 10
LOSS_BYTES = 32
# model.sdpa_backend=math, per score: (elements of the compute dtype read or written, bytes of bool) per pass
SCORE_FWD = (9, 2)  # QK^T 1, mask add 2, softmax 2, isneginf 1 (+ its bool), all (its bool), where 2, PV 1
SCORE_BWD = (7, 0)  # dV's GEMM 1, dP 1, softmax backward 3, dQ's and dK's GEMMs 2
# model.norm_kernel=fused, per element of each of the block's two norms: elements of the compute dtype moved
FUSED_NORM_FWD = 2  # x read, y written
FUSED_NORM_BWD = 5  # dy and x read, dx written (input gradient); dy and x read again (weight gradient)
FUSED_NORM_SOURCE = (
    "torch's fused RMSNorm, 2 + 5 elements a norm element forward + backward (aten/src/ATen/native/cuda/"
    "layer_norm_kernel.cu, _fused_rms_norm)"
)
SCORES_SOURCE = (
    "every score of the causal square computed at the GEMM rate (twice the causal FLOPs), 20 + 14 bytes a score "
    "through HBM forward + backward, the probabilities kept for backward (torch's _scaled_dot_product_attention_math)"
)


def _widths(m: ModelConfig, layer: int) -> tuple[int, int, int, int]:
    """(query width, key/value width, width RoPE rotates, FFN hidden width) of one block, unsharded. MLA
    rotates only the qk_rope_head_dim part of each query head and one shared key part (DeepSeek-V3 §2.1.1)."""
    if m.attention == "mla":
        q = m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim)
        kv, rope = q, (m.n_heads + 1) * m.qk_rope_head_dim
    else:
        q = m.dim
        kv = m.n_kv_heads * (m.dim // m.n_heads)
        rope = q + kv
    if m.n_routed_experts > 0 and layer >= m.n_dense_layers:
        f = (m.experts_per_token + m.n_shared_experts) * m.moe_ffn_dim
    else:
        f = m.ffn_dim
    return q, kv, rope, f


def block_bytes_per_token(
    m: ModelConfig, *, layer: int, tp: int, sequence_parallel: bool, compute_bytes: int = COMPUTE_BYTES
) -> float:
    """HBM bytes one block's forward moves per token on one tensor-parallel rank (see the module docstring);
    `compute_bytes` scales the bf16 parts for an fp32 run. Fused norms are in `two_way_bytes_per_token`."""
    q, kv, rope, f = _widths(m, layer)
    scale = compute_bytes / COMPUTE_BYTES
    n = m.dim / (tp if sequence_parallel and tp > 1 else 1)
    per = (2 * NORM_BYTES * n if m.norm_kernel == "eager" else 0.0) + 2 * RESIDUAL_BYTES * n * scale
    per += ROPE_BYTES * rope / tp
    if kv < q:
        per += 2 * REPEAT_BYTES * (kv + q) / tp * scale
    per += COPY_BYTES * q / tp * scale + SWIGLU_BYTES * f / tp * scale
    return per


def loss_bytes_per_token(m: ModelConfig, *, tp: int, loss_parallel: bool = True) -> float:
    """HBM bytes the loss moves per token, forward and backward, on the last stage."""
    return LOSS_BYTES * m.vocab_size / (tp if loss_parallel and tp > 1 else 1)


def score_bytes_per_token(
    m: ModelConfig, *, seq_len: int, tp: int, compute_bytes: int = COMPUTE_BYTES
) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token of the materialised attention scores on one tensor-parallel rank:
    each token's query meets all `seq_len` keys in each of its n_heads / tp heads (the math backend computes the
    masked half too); zero unless `model.sdpa_backend=math`."""
    if m.sdpa_backend != "math":
        return 0.0, 0.0
    scores = m.n_heads / tp * seq_len
    return tuple(scores * (n * compute_bytes + flags) for n, flags in (SCORE_FWD, SCORE_BWD))


def two_way_bytes_per_token(
    m: ModelConfig, *, seq_len: int, tp: int, sequence_parallel: bool, compute_bytes: int = COMPUTE_BYTES
) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token of one block's ops whose backward is not twice their forward: the
    materialised scores (`score_bytes_per_token`) and the two fused norms (`model.norm_kernel=fused`, over 1/tp
    of the tokens with sequence parallelism)."""
    fwd, bwd = score_bytes_per_token(m, seq_len=seq_len, tp=tp, compute_bytes=compute_bytes)
    if m.norm_kernel == "fused":
        n = 2 * m.dim / (tp if sequence_parallel and tp > 1 else 1) * compute_bytes
        fwd, bwd = fwd + FUSED_NORM_FWD * n, bwd + FUSED_NORM_BWD * n
    return fwd, bwd
