"""The planner's arithmetic: parameters, memory per rank, activations, communication, bubble, checkpoint cost.

Pure functions of plain numbers and `ModelConfig`; no torch, no Hydra, no I/O. `jobs.planner.gate` composes
them into a plan and checks it against a cluster profile; the tests pin them to published figures.
Conventions: bytes are bytes (GiB = 2**30 only when printed), bandwidths are GB/s = 1e9 bytes/s per
GPU per direction, times are seconds. Training precision is the one the recipe targets: fp32 sharded
parameters, gradients and AdamW moments (16 bytes/parameter in all), bf16 compute (activations,
all-gathered parameters), fp32 gradient reduction.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from jobs.config import ModelConfig
from parallel.config import checkpointed_layers

__all__ = [
    "BlockParams",
    "ParamCount",
    "block_params",
    "count_params",
    "bubble_fraction",
    "layers_in_flight",
    "checkpointed_layers",
    "layer_activation_bytes",
    "logits_bytes",
    "activation_bytes",
    "StageShape",
    "RankMemory",
    "rank_memory",
    "stage_elems",
    "shard_elems",
    "checkpointed_layer_bytes",
    "heuristic_bytes_per_rank",
    "CommItem",
    "comm_per_step",
    "axis_spans_nodes",
    "flops_per_token",
    "attention_head_dims",
    "kv_bytes_per_token",
    "checkpoint_bytes",
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
HEURISTIC_BYTES_PER_PARAM = 16  # the planning rule of thumb: 4 + 4 + 8 (Rajbhandari et al. 2020, ZeRO, §3.1 uses 16Ψ for mixed-precision Adam)


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


# ------------------------------------------------------------------------------------------- pipeline


def bubble_fraction(*, pp: int, microbatches: int, stages_per_rank: int = 1, schedule: str = "1f1b") -> float:
    """Idle share of a step: (p-1)/(m+p-1) for GPipe and 1F1B (Huang et al. 2019, GPipe §2.2);
    (p-1)/(v·m+p-1) with v stages per rank for the interleaved schedule (Narayanan et al. 2021, §2.2.2).
    Zero-bubble V (Qi et al. 2024) is planned as interleaved with v=2, an upper bound."""
    if pp <= 1:
        return 0.0
    if microbatches < 1:
        raise ValueError(f"microbatches({microbatches}) must be >= 1")
    v = stages_per_rank if schedule in ("interleaved_1f1b", "zbv_zero_bubble") else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def layers_in_flight(*, pp: int, microbatches: int, layers_on_rank: int, stages_per_rank: int, schedule: str,
                     pp_rank: int = 0) -> float:
    """Layer-microbatches whose activations pp rank `pp_rank` holds at its peak.

    gpipe: all m forwards before any backward, on every rank; 1f1b: rank r runs min(m, p - r)
    warm-up forwards before its first backward (Narayanan et al. 2021, §2.2.1; torch's Schedule1F1B),
    so the last stage holds one microbatch; interleaved: torch's warm-up on rank r,
    (v-1)·p + 2(p-1-r), plus the steady state's one forward, chunk-microbatches of
    layers_on_rank / v layers each; zbv: min(m, p) on every rank (not modelled per rank);
    no pipeline: one microbatch at a time (gradient accumulation).
    """
    if pp <= 1:
        return float(layers_on_rank)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank({pp_rank}) is not in [0, pp({pp}))")
    if schedule == "gpipe":
        return float(microbatches * layers_on_rank)
    if schedule == "interleaved_1f1b":
        v = stages_per_rank
        chunks = min(microbatches * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)
        return chunks * layers_on_rank / v
    if schedule == "zbv_zero_bubble":
        return float(min(microbatches, pp) * layers_on_rank)
    return float(min(microbatches, pp - pp_rank) * layers_on_rank)


# ---------------------------------------------------------------------------------------- activations


def layer_activation_bytes(
    m: ModelConfig,
    *,
    layer: int,
    seq_len: int,
    micro_batch: int,
    tp: int,
    cp: int = 1,
    sequence_parallel: bool = True,
    ep: int = 1,
    compute_bytes: int = COMPUTE_BYTES,
) -> int:
    """Bytes one block saves for backward for one microbatch, without activation checkpointing.

    Counts the tensors autograd keeps in our block under DTensor TP: the RMSNorm inputs in fp32
    (sequence-sharded with SP), the all-gathered input of each column-parallel linear (DTensor keeps
    the gathered tensor), q/k before RoPE, q and the head-repeated k/v that SDPA saves, the SDPA
    output (flash/memory-efficient attention: no seq² scores), and the SwiGLU intermediates. The
    per-token MoE term is k routed copies of (input + SwiGLU intermediates) plus the shared experts;
    with balanced routing an expert-parallel rank receives as many token copies as it sends, so ep
    does not divide it. Context parallel divides the sequence. `compute_bytes`: 2 for bf16 compute,
    4 for an fp32 run (the norm inputs and the logsumexp are fp32 either way).
    """
    s = seq_len // cp
    sb = s * micro_batch
    h = m.dim
    t = max(tp, 1)
    sharded = t if sequence_parallel else 1  # what the residual stream / norms are divided by
    cb = compute_bytes
    norm_in = 2 * 4 * sb * h // sharded  # attention_norm and ffn_norm inputs, fp32
    gathered_in = 2 * cb * sb * h  # inputs of wq/wk/wv and w1/w3 (or the MoE input)
    if m.attention == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        latents = cb * sb * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) * 2
        heads = cb * sb * m.n_heads * (3 * qk + 2 * m.v_head_dim) // t
        attn = latents + heads
    else:
        hd = h // m.n_heads
        hkv = m.n_kv_heads * hd
        pre_rope = cb * sb * (h + hkv) // t
        sdpa_in = cb * sb * 3 * h // t  # q, and k/v repeated to n_heads (repeat_interleave)
        sdpa_out = cb * sb * h // t + 4 * sb * m.n_heads // t  # output + logsumexp
        attn = pre_rope + sdpa_in + sdpa_out
    if m.n_routed_experts > 0 and layer >= m.n_dense_layers:
        f = m.moe_ffn_dim
        routed = cb * sb * m.experts_per_token * (h + 4 * f) // t
        shared = cb * sb * m.n_shared_experts * 4 * f // t
        router = 4 * sb * m.n_routed_experts
        ffn = routed + shared + router
    else:
        ffn = cb * sb * 4 * m.ffn_dim // t  # w1 out, w3 out, silu(w1 out), their product
    return norm_in + gathered_in + attn + ffn


def checkpointed_layer_bytes(*, seq_len: int, micro_batch: int, dim: int, tp: int, cp: int = 1, sequence_parallel: bool = True,
                             compute_bytes: int = COMPUTE_BYTES) -> int:
    """Bytes one block keeps per microbatch under full activation checkpointing: its input only."""
    sharded = tp if sequence_parallel and tp > 1 else 1
    return compute_bytes * (seq_len // cp) * micro_batch * dim // sharded


def logits_bytes(*, seq_len: int, micro_batch: int, vocab_size: int, tp: int, cp: int = 1, loss_parallel: bool = True,
                 compute_bytes: int = COMPUTE_BYTES) -> int:
    """Transient peak of the loss on the last stage for one microbatch: bf16 logits, their fp32
    copy, fp32 log-softmax saved for backward, and the fp32 gradient (10 bytes per logit); in an
    fp32 run (compute_bytes=4) the logits, log-softmax and gradient, 12 bytes per logit."""
    v = vocab_size // tp if loss_parallel and tp > 1 else vocab_size
    per_logit = 10 if compute_bytes == COMPUTE_BYTES else 12
    return per_logit * (seq_len // cp) * micro_batch * v


def activation_bytes(
    m: ModelConfig,
    layers: list[int],
    *,
    in_flight: float,
    seq_len: int,
    micro_batch: int,
    tp: int,
    activation_checkpointing: str,
    ac_every: int = 2,
    cp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = True,
    compute_bytes: int = COMPUTE_BYTES,
) -> int:
    """Saved activations of a rank holding `layers` with `in_flight` layer-microbatches at its peak.

    A checkpointed block keeps its input (`checkpointed_layer_bytes`), another its full set
    (`layer_activation_bytes`); in flight is spread over the rank's blocks evenly. Under any
    checkpointing one block's full set is live again while it is recomputed in backward (the
    largest checkpointed one).
    """
    ckpt = set(checkpointed_layers(layers, mode=activation_checkpointing, every=ac_every))
    kept, recompute = [], 0
    for i in layers:
        full = layer_activation_bytes(m, layer=i, seq_len=seq_len, micro_batch=micro_batch, tp=tp, cp=cp,
                                      sequence_parallel=sequence_parallel, ep=ep, compute_bytes=compute_bytes)
        if i in ckpt:
            recompute = max(recompute, full)
            full = checkpointed_layer_bytes(seq_len=seq_len, micro_batch=micro_batch, dim=m.dim, tp=tp, cp=cp,
                                            sequence_parallel=sequence_parallel, compute_bytes=compute_bytes)
        kept.append(full)
    return int(in_flight * sum(kept) / max(len(layers), 1)) + recompute


# ------------------------------------------------------------------------------------- memory per rank


@dataclass(frozen=True, slots=True)
class StageShape:
    """What one pipeline stage holds: its block indices and whether it has the embedding / the head."""

    layers: tuple[int, ...]
    first: bool
    last: bool


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Peak bytes on one rank, by what holds them (all bytes)."""

    params_elems: int  # this rank's shard of the parameters, in elements
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    unsharded_bytes: int  # FSDP working set: all-gathered bf16 parameters and unsharded fp32 grads
    activation_bytes: int  # saved activations at the schedule's peak (+ one recomputed block under AC)
    logits_bytes: int  # loss transient on the last stage
    activation_bytes_no_ac: int  # the same schedule without activation checkpointing
    activation_bytes_full_ac: int  # the same schedule with full activation checkpointing
    p2p_bytes: int = 0  # pipeline receive buffers, allocated for every microbatch up front

    @property
    def states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        return self.states_bytes + self.unsharded_bytes + self.activation_bytes + self.logits_bytes + self.p2p_bytes

    def as_dict(self) -> dict[str, int]:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["peak_bytes"] = self.peak_bytes
        return d


def _block_local(b: BlockParams, *, tp: int, ep: int) -> tuple[int, int]:
    """(dense, expert) elements of one block on one tp/ep rank, before FSDP: projections and shared
    experts sharded over tp, routed experts over tp and ep, norms and router replicated."""
    return (b.attention + b.ffn) // tp + b.router + b.norms, b.experts // (tp * ep)


def stage_elems(m: ModelConfig, stages: list[StageShape], *, tp: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of the stages one rank holds, after tensor and expert parallelism,
    before FSDP sharding (dense parts shard over dp_shard·cp, experts over dp_shard·cp / ep)."""
    pc = count_params(m)
    dense = experts = 0
    for st in stages:
        for i in st.layers:
            d, e = _block_local(pc.blocks[i], tp=tp, ep=ep)
            dense, experts = dense + d, experts + e
        if st.first:
            dense += pc.embedding // tp
        if st.last:
            dense += pc.output // tp + pc.final_norm
    return dense, experts


def shard_elems(m: ModelConfig, stages: list[StageShape], *, tp: int, fsdp: int, ep: int = 1) -> int:
    """Parameters of the largest FSDP shard of those stages (dp_shard rank 0: chunks round up)."""
    dense, experts = stage_elems(m, stages, tp=tp, ep=ep)
    return -(-dense // fsdp) + (-(-experts // max(fsdp // ep, 1)) if experts else 0)


def rank_memory(
    m: ModelConfig,
    stages: list[StageShape],
    *,
    tp: int,
    fsdp: int,
    pp: int,
    microbatches: int,
    stages_per_rank: int,
    schedule: str,
    seq_len: int,
    micro_batch: int,
    cp: int = 1,
    ep: int = 1,
    sequence_parallel: bool = True,
    loss_parallel: bool = True,
    activation_checkpointing: str = "none",
    ac_every: int = 2,
    pp_rank: int = 0,
    params_elems: int | None = None,
    compute_bytes: int = COMPUTE_BYTES,
) -> RankMemory:
    """Peak memory of the rank holding `stages`, FSDP-sharded `fsdp` ways (dp_shard · cp; experts
    ep · their own dp ways, the same product). `params_elems` replaces the analytic shard size with
    one measured on the real sharded model (the fake-backend path). `pp_rank` sets how many
    microbatches are in flight (`layers_in_flight`); `compute_bytes` is 2 for bf16 compute, 4 for fp32."""
    blocks_on_rank = [i for st in stages for i in st.layers]
    if params_elems is None:
        params_elems = shard_elems(m, stages, tp=tp, fsdp=fsdp, ep=ep)
    unsharded = _fsdp_working_set(m, stages, tp=tp, ep=ep, fsdp=fsdp, pp=pp, microbatches=microbatches,
                                  compute_bytes=compute_bytes)
    in_flight = layers_in_flight(
        pp=pp, microbatches=microbatches, layers_on_rank=len(blocks_on_rank), stages_per_rank=stages_per_rank,
        schedule=schedule, pp_rank=pp_rank,
    )
    act = functools.partial(
        activation_bytes, m, blocks_on_rank, in_flight=in_flight, seq_len=seq_len, micro_batch=micro_batch, tp=tp,
        cp=cp, ep=ep, sequence_parallel=sequence_parallel, ac_every=ac_every, compute_bytes=compute_bytes,
    )
    p2p = _p2p_bytes(m, stages, tp=tp, pp=pp, cp=cp, microbatches=microbatches, seq_len=seq_len,
                     micro_batch=micro_batch, sequence_parallel=sequence_parallel, compute_bytes=compute_bytes)
    loss = (
        logits_bytes(seq_len=seq_len, micro_batch=micro_batch, vocab_size=m.vocab_size, tp=tp, cp=cp,
                     loss_parallel=loss_parallel, compute_bytes=compute_bytes)
        if any(st.last for st in stages)
        else 0
    )
    return RankMemory(
        params_elems=params_elems,
        params_bytes=params_elems * PARAM_BYTES,
        grads_bytes=params_elems * GRAD_BYTES,
        optimizer_bytes=params_elems * OPTIM_BYTES,
        unsharded_bytes=unsharded,
        activation_bytes=act(activation_checkpointing=activation_checkpointing),
        logits_bytes=loss,
        activation_bytes_no_ac=act(activation_checkpointing="none"),
        activation_bytes_full_ac=act(activation_checkpointing="full"),
        p2p_bytes=p2p,
    )


def _p2p_bytes(m: ModelConfig, stages: list[StageShape], *, tp: int, pp: int, cp: int, microbatches: int,
               seq_len: int, micro_batch: int, sequence_parallel: bool, compute_bytes: int) -> int:
    """Pipeline receive buffers on the rank holding `stages`: torch's PipelineStage allocates one per
    microbatch for the activations coming in (every stage but the first) and for the gradients coming
    back (every stage but the last)."""
    hop = compute_bytes * (seq_len // cp) * micro_batch * m.dim // (tp if sequence_parallel and tp > 1 else 1)
    return 0 if pp <= 1 else microbatches * hop * sum(int(not st.first) + int(not st.last) for st in stages)


def _fsdp_working_set(m: ModelConfig, stages: list[StageShape], *, tp: int, ep: int, fsdp: int, pp: int,
                      microbatches: int, compute_bytes: int) -> int:
    """FSDP2's unsharded bytes on the rank holding `stages`. With a pipeline the stage stays unsharded
    from the first forward to the last backward (reshard_after_forward=False) and gradients accumulate
    unsharded until the last microbatch's reduce-scatter. Without one, a block is gathered just before
    it runs (the next one is prefetched) and the root (embedding, head) stays gathered."""
    if fsdp <= 1:
        return 0
    dense, experts = stage_elems(m, stages, tp=tp, ep=ep)  # this rank's elements before FSDP sharding
    if pp > 1:
        return (dense + experts) * (compute_bytes + REDUCE_BYTES)
    pc = count_params(m)
    blocks_on_rank = [i for st in stages for i in st.layers]
    biggest = max((sum(_block_local(pc.blocks[i], tp=tp, ep=ep)) for i in blocks_on_rank), default=0)
    root = (pc.embedding + pc.output) // tp + pc.final_norm
    unsharded = biggest * 2 * compute_bytes + root * compute_bytes
    # gradients: one block's until its reduce-scatter, or, when microbatches accumulate without
    # sync (set_requires_gradient_sync(False) until the last one), the whole model's, unsharded
    return unsharded + (dense + experts if microbatches > 1 else biggest + root) * REDUCE_BYTES


def heuristic_bytes_per_rank(total_params: int, *, model_shards: int) -> int:
    """The 16 bytes/parameter rule: params + grads + AdamW spread evenly over the ranks that shard
    the model (pp · tp · dp_shard · cp; dp_replicate holds copies)."""
    return HEURISTIC_BYTES_PER_PARAM * total_params // model_shards


# ------------------------------------------------------------------------------------- communication


@dataclass(frozen=True, slots=True)
class CommItem:
    """One kind of collective on one mesh axis, per rank per optimizer step."""

    collective: str  # all_gather | reduce_scatter | all_reduce | send_recv | all_to_all
    axis: str  # mesh axis name (pp, dp_replicate, dp_shard, cp, tp, ep)
    what: str  # what it moves
    count: int  # calls per step
    bytes: int  # bytes each rank sends per step (ring algorithms: (n-1)/n of the buffer, x2 for all-reduce)
    group: int  # ranks in one group of this axis

    def as_dict(self) -> dict[str, object]:
        return {k: getattr(self, k) for k in self.__slots__}


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def comm_per_step(
    m: ModelConfig,
    stages: list[StageShape],
    *,
    pp: int,
    dp_replicate: int,
    fsdp: int,
    tp: int,
    cp: int,
    ep: int,
    microbatches: int,
    seq_len: int,
    micro_batch: int,
    sequence_parallel: bool,
    activation_checkpointing: str,
    ac_every: int = 2,
    nvlink_domain: int = 0,
    compute_bytes: int = COMPUTE_BYTES,
) -> list[CommItem]:
    """Collectives per optimizer step for the rank holding `stages`, by axis.

    FSDP (counts from CommDebugMode, notes torch-2.13-cpu.md §9): with a pipeline the stage stays
    gathered (reshard_after_forward=False), so one all-gather per fully_shard unit per step; without
    one, each microbatch gathers every block for forward and again for backward and the root once.
    Gradients reduce-scatter once per unit per step (the pipeline schedule and the trainer sync on
    the last microbatch only). A unit without parameters of its own (the root of a middle stage)
    issues nothing. HSDP adds an all-reduce of the shard over dp_replicate.
    TP (notes §3): with SP, per block and microbatch 2 all-gathers + 2 reduce-scatters forward (again
    when recomputing) and the mirror image backward, plus one of each for the embedding and for the
    head; without SP, 2 all-reduces forward and one per column-parallel linear (5) backward.
    PP: one activation send forward and one gradient send backward per microbatch per stage boundary.
    CP: all-gather based, as Llama 3 (`_cp_items`). EP: dispatch and combine all-to-all per MoE block
    per microbatch, per forward and backward, node-limited when `model.moe_max_nodes` is set
    (`_ep_items`; `nvlink_domain`: GPUs per node, 0 = unknown: every copy on the ep axis).
    Parameters are gathered and activations sent in the compute dtype: `compute_bytes` 2 (bf16), 4 (fp32).
    """
    blocks = [i for st in stages for i in st.layers]
    first, last = any(st.first for st in stages), any(st.last for st in stages)
    moe = [i for i in blocks if m.n_routed_experts > 0 and i >= m.n_dense_layers]
    s = seq_len // cp
    act = compute_bytes * s * micro_batch * m.dim  # one microbatch's hidden states on a tp group
    dt = _dtype_name(compute_bytes)
    recomputed = checkpointed_layers(blocks, mode=activation_checkpointing, every=ac_every)  # forward twice
    n_re, moe_re = len(recomputed), sum(1 for i in recomputed if i in moe)
    items = _fsdp_items(m, stages, pp=pp, dp_replicate=dp_replicate, fsdp=fsdp, tp=tp, ep=ep, microbatches=microbatches,
                        compute_bytes=compute_bytes)
    if tp > 1:
        items += _tp_items(blocks=len(blocks), recomputed=n_re, microbatches=microbatches, ends=int(first) + int(last),
                           act=act, tp=tp, sequence_parallel=sequence_parallel, dt=dt)
    if pp > 1:
        sends = microbatches * (sum(not st.last for st in stages) + sum(not st.first for st in stages))
        per = act // tp if sequence_parallel and tp > 1 else act
        items.append(CommItem("send_recv", "pp", f"{dt} activations fwd + grads bwd", sends, sends * per, pp))
    if cp > 1:
        items += _cp_items(m, blocks=len(blocks), recomputed=n_re, microbatches=microbatches, s=s,
                           micro_batch=micro_batch, tp=tp, cp=cp, compute_bytes=compute_bytes)
    if ep > 1 and moe:
        n = 2 * microbatches * (2 * len(moe) + moe_re)  # dispatch + combine, per forward and backward
        items += _ep_items(m, n=n, s=s, micro_batch=micro_batch, tp=tp, ep=ep, nvlink_domain=nvlink_domain,
                           compute_bytes=compute_bytes)
    return items


def _dtype_name(compute_bytes: int) -> str:
    return {2: "bf16", 4: "fp32"}.get(compute_bytes, f"{compute_bytes}-byte")


def _fsdp_items(m: ModelConfig, stages: list[StageShape], *, pp: int, dp_replicate: int, fsdp: int, tp: int, ep: int,
                microbatches: int, compute_bytes: int = COMPUTE_BYTES) -> list[CommItem]:
    """FSDP's parameter all-gathers and gradient reduce-scatters (dense over dp_shard·cp, experts over
    their own dp degree), and HSDP's all-reduce of the shard over dp_replicate (see `comm_per_step`)."""
    items: list[CommItem] = []
    pc = count_params(m)
    dense, experts = stage_elems(m, stages, tp=tp, ep=ep)
    blocks = [i for st in stages for i in st.layers]
    first, last = any(st.first for st in stages), any(st.last for st in stages)
    roots = sum(1 for st in stages if st.first or st.last)  # root units that own parameters
    root_elems = (pc.embedding // tp if first else 0) + (pc.output // tp + pc.final_norm if last else 0)
    moe_blocks = sum(1 for i in blocks if m.n_routed_experts > 0 and i >= m.n_dense_layers)
    if pp > 1:
        ag_count, ag_elems = len(blocks) + roots, dense
    else:
        ag_count, ag_elems = microbatches * (2 * len(blocks) + roots), microbatches * (2 * (dense - root_elems) + root_elems)
    if fsdp > 1 and dense:
        items.append(CommItem("all_gather", "dp_shard", f"{_dtype_name(compute_bytes)} parameters", ag_count,
                              int(_ring(fsdp) * compute_bytes * ag_elems), fsdp))
        items.append(CommItem("reduce_scatter", "dp_shard", "fp32 gradients", len(blocks) + roots,
                              int(_ring(fsdp) * REDUCE_BYTES * dense), fsdp))
    edp = fsdp // max(ep, 1)  # the experts' own data-parallel degree
    if edp > 1 and experts:
        gathers = 1 if pp > 1 else 2 * microbatches
        items.append(CommItem("all_gather", "dp_shard/ep", f"{_dtype_name(compute_bytes)} expert parameters",
                              gathers * moe_blocks, int(gathers * _ring(edp) * compute_bytes * experts), edp))
        items.append(CommItem("reduce_scatter", "dp_shard/ep", "fp32 expert gradients", moe_blocks,
                              int(_ring(edp) * REDUCE_BYTES * experts), edp))
    if dp_replicate > 1:
        shard = dense // max(fsdp, 1) + experts // max(fsdp // max(ep, 1), 1)
        items.append(CommItem("all_reduce", "dp_replicate", "fp32 gradient shards", len(blocks) + roots,
                              int(2 * _ring(dp_replicate) * REDUCE_BYTES * shard), dp_replicate))
    return items


def _tp_items(*, blocks: int, recomputed: int, microbatches: int, ends: int, act: int, tp: int,
              sequence_parallel: bool, dt: str = "bf16") -> list[CommItem]:
    """Tensor parallel's activation collectives (see `comm_per_step`); `ends`: embedding and/or head held."""
    per_block = microbatches * blocks
    if sequence_parallel:
        n = 4 * per_block + 2 * microbatches * recomputed + ends * microbatches
        b = int(n * _ring(tp) * act)
        return [CommItem("all_gather", "tp", f"{dt} activations (SP)", n, b, tp),
                CommItem("reduce_scatter", "tp", f"{dt} activations (SP)", n, b, tp)]
    n = 7 * per_block + 2 * microbatches * recomputed + ends * microbatches
    return [CommItem("all_reduce", "tp", f"{dt} activations", n, int(n * 2 * _ring(tp) * act), tp)]


def _cp_items(m: ModelConfig, *, blocks: int, recomputed: int, microbatches: int, s: int, micro_batch: int,
              tp: int, cp: int, compute_bytes: int = COMPUTE_BYTES) -> list[CommItem]:
    """Context parallel as Llama 3 runs it ("The Llama 3 Herd of Models", arXiv 2407.21783, §3.3.2):
    "we first all-gather the key (K) and value (V) tensors, and then compute attention output for the
    local query (Q) tensor chunk" (the sequence split into 2·cp load-balanced chunks), not ring
    attention's cp-1 point-to-point exchanges. Per block and microbatch: one K/V all-gather forward
    (again when the block is recomputed) and the reduce-scatter of dK/dV backward, each moving
    (cp-1)/cp of the full sequence's K/V per rank."""
    kv_local = kv_bytes_per_token(m, tp=tp, compute_bytes=compute_bytes) * s * micro_batch  # this rank's 1/cp of the sequence
    dt = _dtype_name(compute_bytes)
    ag = microbatches * (blocks + recomputed)
    rs = microbatches * blocks
    return [CommItem("all_gather", "cp", f"{dt} K/V (all-gather CP)", ag, ag * (cp - 1) * kv_local, cp),
            CommItem("reduce_scatter", "cp", f"{dt} dK/dV (all-gather CP)", rs, rs * (cp - 1) * kv_local, cp)]


def _ep_items(m: ModelConfig, *, n: int, s: int, micro_batch: int, tp: int, ep: int, nvlink_domain: int,
              compute_bytes: int = COMPUTE_BYTES) -> list[CommItem]:
    """The MoE all-to-alls of `n` dispatch/combine calls. Without node-limited routing each of a
    token's k routed copies goes straight to its expert's rank: k·(ep-1)/ep copies per token on the ep
    axis. With `model.moe_max_nodes` = M (DeepSeek-V3: 4; "DeepSeek-V3 Technical Report", arXiv
    2412.19437, §2.1.2 "Node-Limited Routing" and §3.2.2: tokens go by IB once to each target node, to
    the GPU with the same in-node index, then by NVLink to the GPUs hosting their experts) a token
    crosses IB to at most min(k, M, nodes) nodes, (nodes-1)/nodes of them remote, and its k copies
    travel inside the node ((g-1)/g of them to another GPU; g = ep ranks per node): axis `ep_intra`."""
    token = compute_bytes * s * micro_batch * m.dim
    dt, k = _dtype_name(compute_bytes), m.experts_per_token
    g = min(ep, max(nvlink_domain // max(tp, 1), 1)) if nvlink_domain > 0 else 1
    nodes = ep // g if ep % g == 0 else -(-ep // g)
    if m.moe_max_nodes <= 0 or nvlink_domain <= 0 or nodes <= 1:
        return [CommItem("all_to_all", "ep", f"{dt} routed tokens (dispatch + combine)", n, int(n * k * _ring(ep) * token), ep)]
    across = min(k, m.moe_max_nodes, nodes) * _ring(nodes)
    return [
        CommItem("all_to_all", "ep", f"{dt} routed tokens across nodes (<= {m.moe_max_nodes} nodes/token)", n,
                 int(n * across * token), ep),
        CommItem("all_to_all", "ep_intra", f"{dt} routed tokens forwarded to experts in the node", n,
                 int(n * k * _ring(g) * token), g),
    ]


def axis_spans_nodes(axis: str, shape: dict[str, int], *, nvlink_domain: int) -> bool:
    """Whether one group of `axis` crosses the NVLink domain: the mesh is row-major over
    (pp, dp_replicate, dp_shard, cp, tp), so a group spans the product of its own size and every
    inner axis's size (ep is carved out of dp_shard · cp, innermost first)."""
    order = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
    if axis == "ep_intra":  # node-limited routing's NVLink leg (`_ep_items`)
        return False
    if axis == "ep":
        span = shape.get("ep", 1) * shape.get("tp", 1)
    elif axis.startswith("dp_shard"):  # dp_shard, dp_shard*cp, dp_shard/ep: strided over all of dp_shard·cp·tp
        span = shape.get("dp_shard", 1) * shape.get("cp", 1) * shape.get("tp", 1)
    else:
        i = order.index(axis)
        span = math.prod(shape.get(a, 1) for a in order[i:])
    return span > max(nvlink_domain, 1)


# ------------------------------------------------------------------------------------------ checkpoint


def checkpoint_bytes(params_elems: int) -> int:
    """Bytes a checkpoint holds for `params_elems` parameters: fp32 weights + AdamW's two moments
    (gradients are not saved)."""
    return params_elems * (PARAM_BYTES + OPTIM_BYTES)
