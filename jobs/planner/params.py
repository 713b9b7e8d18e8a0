"""The planner's parameter arithmetic: parameters per block and model, head dims, K/V bytes, FLOPs per token, and
the bytes per element of each training state.

Pure functions of plain numbers and `ModelConfig`; no torch, no Hydra, no I/O (the rules of `jobs.planner.arith`).
"""

from __future__ import annotations

from dataclasses import dataclass

from jobs.config import ModelConfig

__all__ = [
    "BlockParams",
    "ParamCount",
    "block_params",
    "count_params",
    "flops_per_token",
    "attention_head_dims",
    "kv_bytes_per_token",
    "PARAM_BYTES",
    "GRAD_BYTES",
    "OPTIM_BYTES",
    "COMPUTE_BYTES",
    "REDUCE_BYTES",
    "HEURISTIC_BYTES_PER_PARAM",
]

PARAM_BYTES = 4  # fp32 sharded parameters (FSDP2 keeps the master copy in the parameter dtype)
GRAD_BYTES = 4  # fp32 sharded gradients
OPTIM_BYTES = 8  # AdamW exp_avg + exp_avg_sq, fp32
COMPUTE_BYTES = 2  # bf16 activations and all-gathered parameters (MixedPrecisionPolicy param_dtype)
REDUCE_BYTES = 4  # fp32 gradient reduce-scatter / all-reduce (MixedPrecisionPolicy reduce_dtype)
HEURISTIC_BYTES_PER_PARAM = (
    16  # the planning rule of thumb: 4 + 4 + 8 (Rajbhandari et al. 2020, ZeRO, §3.1 uses 16Ψ for mixed-precision Adam)
)


# --------------------------------------------------------------------------------------------- params


@dataclass(frozen=True, slots=True)
class BlockParams:
    """One transformer block's parameters, split by how they are sharded."""

    attention: int  # attention projections (tensor-parallel)
    ffn: int  # dense FFN, or the shared experts of an MoE block (tensor-parallel)
    experts: int  # routed experts (expert-parallel); 0 for a dense block
    router: int  # MoE gate (replicated over tp)
    norms: int  # RMSNorm weights (replicated over tp)
    active: int  # parameters one token uses: everything but the routed experts it is not sent to

    @property
    def total(self) -> int:
        return self.attention + self.ffn + self.experts + self.router + self.norms


@dataclass(frozen=True, slots=True)
class ParamCount:
    total: int  # every parameter of the model
    active: int  # parameters one token uses (= total for a dense model)
    embedding: int  # token embedding
    output: int  # output head (untied)
    final_norm: int  # the last RMSNorm
    blocks: tuple[BlockParams, ...]  # one entry per layer


def attention_head_dims(m: ModelConfig) -> tuple[int, int]:
    """(query/key dims, value dims) of one attention head. GQA: dim / n_heads for both. MLA: the
    decoupled query/key head is qk_nope_head_dim + qk_rope_head_dim (DeepSeek-V3: 128 + 64 = 192) and
    the value head v_head_dim (128), not dim / n_heads (= 56 for DeepSeek-V3's 7168 / 128)
    ("DeepSeek-V3 Technical Report", arXiv 2412.19437, §2.1.1 and §4.2: d_h = 128, d_h^R = 64)."""
    if m.attention == "mla":
        if min(m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank) <= 0:
            raise ValueError(
                f"model.attention=mla needs model.qk_nope_head_dim({m.qk_nope_head_dim}), model.qk_rope_head_dim"
                f"({m.qk_rope_head_dim}), model.v_head_dim({m.v_head_dim}) and model.kv_lora_rank({m.kv_lora_rank}) > 0"
            )
        return m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    if m.attention != "gqa":
        raise ValueError(f"model.attention={m.attention!r} is not one of gqa, mla")
    hd = m.dim // m.n_heads
    return hd, hd


def kv_bytes_per_token(m: ModelConfig, *, tp: int = 1, compute_bytes: int = COMPUTE_BYTES) -> int:
    """Bytes of one token's keys and values on one tp rank: what context parallelism all-gathers.
    GQA: 2 * n_kv_heads * head_dim; MLA: the per-head keys (192) and values (128) of all n_heads
    (the decompressed K/V the attention kernel reads)."""
    qk, v = attention_head_dims(m)
    heads = m.n_heads if m.attention == "mla" else m.n_kv_heads
    return compute_bytes * heads * (qk + v) // max(tp, 1)


def _attention_params(m: ModelConfig) -> tuple[int, int]:
    """(projection parameters, norm parameters inside attention) for GQA or MLA."""
    qk, v = attention_head_dims(m)
    if m.attention == "mla":
        if m.q_lora_rank:
            q = m.dim * m.q_lora_rank + m.q_lora_rank * m.n_heads * qk
            q_norm = m.q_lora_rank
        else:
            q, q_norm = m.dim * m.n_heads * qk, 0
        kv_a = m.dim * (m.kv_lora_rank + m.qk_rope_head_dim)
        kv_b = m.kv_lora_rank * m.n_heads * (m.qk_nope_head_dim + v)
        wo = m.n_heads * v * m.dim
        return q + kv_a + kv_b + wo, q_norm + m.kv_lora_rank
    return m.dim * qk * (2 * m.n_heads + 2 * m.n_kv_heads), 0


def block_params(m: ModelConfig, layer: int) -> BlockParams:
    """Parameters of block `layer` (dense before `model.n_dense_layers` or when there are no experts)."""
    attn, attn_norms = _attention_params(m)
    norms = 2 * m.dim + attn_norms
    if m.n_routed_experts <= 0 or layer < m.n_dense_layers:
        ffn = 3 * m.dim * m.ffn_dim
        return BlockParams(attn, ffn, 0, 0, norms, attn + ffn + norms)
    expert = 3 * m.dim * m.moe_ffn_dim
    shared = m.n_shared_experts * expert
    routed = m.n_routed_experts * expert
    router = m.n_routed_experts * m.dim
    active = attn + shared + m.experts_per_token * expert + router + norms
    return BlockParams(attn, shared, routed, router, norms, active)


_COUNTS: dict[tuple, ParamCount] = {}  # count_params by the model config's values: a plan calls it per role


def count_params(m: ModelConfig) -> ParamCount:
    """Parameters of the full model from its shapes (untied embedding and head, no multi-token head)."""
    key = tuple(vars(m).items())
    if key not in _COUNTS:
        if len(_COUNTS) > 256:
            _COUNTS.clear()
        _COUNTS[key] = _count_params(m)
    return _COUNTS[key]


def _count_params(m: ModelConfig) -> ParamCount:
    blocks = tuple(block_params(m, i) for i in range(m.n_layers))
    emb = out = m.vocab_size * m.dim
    total = emb + out + m.dim + sum(b.total for b in blocks)
    active = emb + out + m.dim + sum(b.active for b in blocks)
    return ParamCount(total, active, emb, out, m.dim, blocks)


def flops_per_token(m: ModelConfig, *, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), without recomputation: the one
    formula of the trainer's MFU (`jobs.telemetry.model_flops_per_token`) and the planner.

    6 x the active matmul parameters (the embedding lookup and the norms excluded, the untied output
    head included; Kaplan et al. 2020, §2.1) plus causal attention: per layer and token, QK^T and AV
    cost 2·H·(d_qk + d_v)·T forward, halved by the causal mask (as the Llama 3 paper's MFU), x3 for
    training: 6·L·T·H·(d_qk + d_v)/2. For GQA d_qk = d_v = dim/H, so H·(d_qk + d_v) = 2·dim; for MLA
    the head dims are 192 and 128 (`attention_head_dims`)."""
    pc = count_params(m)
    matmul = pc.active - pc.embedding - sum(b.norms for b in pc.blocks) - pc.final_norm
    qk, v = attention_head_dims(m)
    return 6.0 * matmul + 6.0 * m.n_layers * seq_len * m.n_heads * (qk + v) / 2.0
