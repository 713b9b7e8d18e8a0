"""The planner's memory arithmetic: the pipeline schedule's bubble and microbatches in flight, saved activations,
peak memory per rank by what holds it, and checkpoint bytes.

Pure functions of plain numbers and `ModelConfig`; no torch, no Hydra, no I/O (the rules of `jobs.planner.arith`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from jobs.config import ModelConfig
from jobs.planner.params import (
    COMPUTE_BYTES,
    GRAD_BYTES,
    HEURISTIC_BYTES_PER_PARAM,
    OPTIM_BYTES,
    PARAM_BYTES,
    REDUCE_BYTES,
    BlockParams,
    count_params,
)
from parallel.config import checkpointed_layers

__all__ = [
    "bubble_fraction",
    "layers_in_flight",
    "checkpointed_layers",
    "layer_activation_bytes",
    "expert_padding",
    "moe_activation_bytes",
    "PADDED_LOAD",
    "logits_bytes",
    "activation_bytes",
    "StageShape",
    "RankMemory",
    "rank_memory",
    "stage_elems",
    "shard_elems",
    "checkpointed_layer_bytes",
    "heuristic_bytes_per_rank",
    "checkpoint_bytes",
    "autocast_copy_bytes",
    "pp_recv_bytes",
]


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


def layers_in_flight(
    *, pp: int, microbatches: int, layers_on_rank: int, stages_per_rank: int, schedule: str, pp_rank: int = 0
) -> float:
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


# The padded expert matmul (jobs.models.moe.padded_swiglu), where torch._grouped_mm does not run (fp32, expert rows not
# 16-byte aligned), pads every local expert's rows to the busiest one's: its routed activations (and FLOPs) grow by
# the max / mean tokens per expert, which the bias balancing holds below 1.25 (tests/unit/test_moe.py).
PADDED_LOAD = 1.25


def expert_padding(m: ModelConfig, *, tp: int = 1, compute_bytes: int = COMPUTE_BYTES) -> float:
    """The routed experts' rows computed and kept per routed token copy: 1 on the grouped GEMM (bf16, the rows of the
    tokens and of the experts' tp-split hidden dim 16-byte aligned: jobs.models.moe.grouped_mm_available), else PADDED_LOAD."""
    rows = (m.dim, m.moe_ffn_dim // max(tp, 1))
    grouped = compute_bytes == 2 and all(n * compute_bytes % 16 == 0 for n in rows)
    return 1.0 if grouped else PADDED_LOAD


def moe_activation_bytes(m: ModelConfig, *, tokens: int, tp: int = 1, compute_bytes: int = COMPUTE_BYTES) -> int:
    """Bytes an MoE block's FFN half keeps for backward for `tokens` tokens of a tp group (its input aside): each tp
    rank computes its hidden slice of every row the tp group routed (k per token, gathered whole over tp:
    parallel/ep.py), keeps the rows (x `expert_padding` on the padded matmul), their SwiGLU intermediates and its own
    rows' outputs, which the router's weights multiply (+k x dim per token, ~47% of the rest at DeepSeek-V3's
    shapes); the shared experts' intermediates; the router's fp32 scores and weights; the int64 routing indices."""
    h, f, t = m.dim, m.moe_ffn_dim, max(tp, 1)
    rows = compute_bytes * tokens * m.experts_per_token
    routed = int(rows * (h + 4 * f // t) * expert_padding(m, tp=t, compute_bytes=compute_bytes)) + rows * h // t
    shared = compute_bytes * tokens * m.n_shared_experts * 4 * f // t
    k = m.experts_per_token
    # fp32 scores, the top-k weights and their sum; the weights by row in the compute dtype
    router = 4 * tokens * (m.n_routed_experts + k + 1) + compute_bytes * tokens * k
    indices = 8 * 4 * tokens * k  # int64: the choices, their order by expert, its inverse, the token of each row
    return routed + shared + router + indices


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

    Counts the tensors autograd keeps in our block under DTensor TP: the RMSNorm inputs in fp32 and
    their bf16 outputs that the product with the norm weight saves (sequence-sharded with SP; a fused norm,
    `model.norm_kernel=fused` on CUDA, keeps its input and the rstd: torch's generated FusedRmsNormBackward0), the
    all-gathered input of each column-parallel linear (DTensor keeps the gathered tensor), q and the
    head-repeated k/v that SDPA saves (RoPE's products save only the table), the SDPA output and its
    logsumexp (flash/memory-efficient attention: no seq² scores; torch's math backend, `model.sdpa_backend=math`,
    keeps the seq² probabilities of each head instead of the logsumexp), and the SwiGLU intermediates. Measured on the
    block with saved_tensors_hooks (tests/unit/test_planner_memory_published.py), MHA and GQA alike. The
    per-token MoE term is k routed copies of (input + SwiGLU intermediates + output) plus the shared experts;
    with balanced routing an expert-parallel rank receives as many token copies as it sends, so ep
    does not divide it; the padded expert matmul keeps `expert_padding` times the routed rows. Context parallel
    divides the sequence. `compute_bytes`: 2 for bf16 compute,
    4 for an fp32 run (the norm inputs and the logsumexp are fp32 either way).
    """
    s = seq_len // cp
    sb = s * micro_batch
    h = m.dim
    t = max(tp, 1)
    sharded = t if sequence_parallel else 1  # what the residual stream / norms are divided by
    cb = compute_bytes
    norm_in = 2 * 4 * sb * h // sharded  # attention_norm and ffn_norm inputs, fp32
    norm_out = 2 * cb * sb * h // sharded  # their outputs (type_as), saved by the product with the weight
    if m.norm_kernel == "fused":  # FusedRmsNormBackward0 keeps the input and the fp32 rstd, one a row
        norm_in, norm_out = 2 * cb * sb * h // sharded, 2 * 4 * sb // sharded
    gathered_in = 2 * cb * sb * h  # inputs of wq/wk/wv and w1/w3 (or the MoE input)
    if m.attention == "mla":
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        latents = cb * sb * (m.q_lora_rank + m.kv_lora_rank + m.qk_rope_head_dim) * 2
        heads = cb * sb * m.n_heads * (3 * qk + 2 * m.v_head_dim) // t
        attn = latents + heads + (cb * micro_batch * m.n_heads // t * s * s if m.sdpa_backend == "math" else 0)
    else:
        # q, and k/v repeated to n_heads (repeat_interleave); under context parallelism k/v are the all-gathered
        # whole sequence (cp x this rank's part: Llama 3 §3.3.2), repeated to every head, and SDPA saves them
        sdpa_in = cb * sb * h // t + cb * sb * cp * 2 * h // t
        sdpa_out = cb * sb * h // t + 4 * sb * m.n_heads // t  # output + logsumexp
        if m.sdpa_backend == "math":  # no logsumexp; the probabilities instead, s x s a head
            sdpa_out = cb * sb * h // t + cb * micro_batch * m.n_heads // t * s * s
        attn = sdpa_in + sdpa_out
    if m.n_routed_experts > 0 and layer >= m.n_dense_layers:
        ffn = moe_activation_bytes(m, tokens=sb, tp=t, compute_bytes=cb)
    else:
        ffn = cb * sb * 4 * m.ffn_dim // t  # w1 out, w3 out, silu(w1 out), their product
    return norm_in + norm_out + gathered_in + attn + ffn


def checkpointed_layer_bytes(
    *,
    seq_len: int,
    micro_batch: int,
    dim: int,
    tp: int,
    cp: int = 1,
    sequence_parallel: bool = True,
    compute_bytes: int = COMPUTE_BYTES,
) -> int:
    """Bytes one block keeps per microbatch under full activation checkpointing: its input only."""
    sharded = tp if sequence_parallel and tp > 1 else 1
    return compute_bytes * (seq_len // cp) * micro_batch * dim // sharded


def logits_bytes(
    *,
    seq_len: int,
    micro_batch: int,
    vocab_size: int,
    tp: int,
    cp: int = 1,
    loss_parallel: bool = True,
    compute_bytes: int = COMPUTE_BYTES,
) -> int:
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
        full = layer_activation_bytes(
            m,
            layer=i,
            seq_len=seq_len,
            micro_batch=micro_batch,
            tp=tp,
            cp=cp,
            sequence_parallel=sequence_parallel,
            ep=ep,
            compute_bytes=compute_bytes,
        )
        if i in ckpt:
            recompute = max(recompute, full)
            full = checkpointed_layer_bytes(
                seq_len=seq_len,
                micro_batch=micro_batch,
                dim=m.dim,
                tp=tp,
                cp=cp,
                sequence_parallel=sequence_parallel,
                compute_bytes=compute_bytes,
            )
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
    autocast_bytes: int = (
        0  # bf16 weight copies autocast saves for backward (parts without FSDP; `autocast_copy_bytes`)
    )

    @property
    def states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        return (
            self.states_bytes
            + self.unsharded_bytes
            + self.activation_bytes
            + self.logits_bytes
            + self.p2p_bytes
            + self.autocast_bytes
        )

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
    autocast: bool = False,
) -> RankMemory:
    """Peak memory of the rank holding `stages`, FSDP-sharded `fsdp` ways (dp_shard · cp; experts
    ep · their own dp ways, the same product). `params_elems` replaces the analytic shard size with
    one measured on the real sharded model (the fake-backend path). `pp_rank` sets how many
    microbatches are in flight (`layers_in_flight`); `compute_bytes` is 2 for bf16 compute, 4 for fp32.
    `autocast`: bf16 through torch.autocast, not FSDP's policy (a mesh without FSDP: dp_replicate · dp_shard = 1)."""
    if params_elems is None:
        params_elems = shard_elems(m, stages, tp=tp, fsdp=fsdp, ep=ep)
    in_flight = layers_in_flight(
        pp=pp,
        microbatches=microbatches,
        layers_on_rank=sum(len(st.layers) for st in stages),
        stages_per_rank=stages_per_rank,
        schedule=schedule,
        pp_rank=pp_rank,
    )
    mb_shape = dict(seq_len=seq_len, micro_batch=micro_batch, tp=tp, cp=cp, compute_bytes=compute_bytes)
    return RankMemory(
        **_sharded_state_fields(params_elems),
        unsharded_bytes=_fsdp_working_set(
            m, stages, tp=tp, ep=ep, fsdp=fsdp, pp=pp, microbatches=microbatches, compute_bytes=compute_bytes
        ),
        logits_bytes=_loss_bytes(m, stages, loss_parallel=loss_parallel, **mb_shape),
        p2p_bytes=pp_recv_bytes(
            m, stages, pp=pp, microbatches=microbatches, sequence_parallel=sequence_parallel, **mb_shape
        ),
        **_activation_fields(
            m,
            stages,
            in_flight=in_flight,
            mb_shape=mb_shape,
            ep=ep,
            ac_every=ac_every,
            sequence_parallel=sequence_parallel,
            activation_checkpointing=activation_checkpointing,
            autocast=autocast,
        ),
    )


def _sharded_state_fields(params_elems: int) -> dict[str, int]:
    """`RankMemory`'s fields of the rank's sharded training state: fp32 parameters, gradients and AdamW's moments."""
    return dict(
        params_elems=params_elems,
        params_bytes=params_elems * PARAM_BYTES,
        grads_bytes=params_elems * GRAD_BYTES,
        optimizer_bytes=params_elems * OPTIM_BYTES,
    )


def _activation_fields(
    m: ModelConfig,
    stages: list[StageShape],
    *,
    in_flight: float,
    mb_shape: dict,
    ep: int,
    ac_every: int,
    sequence_parallel: bool,
    activation_checkpointing: str,
    autocast: bool,
) -> dict[str, int]:
    """`RankMemory`'s activation fields: at the chosen activation checkpointing, without and with full AC, and
    autocast's bf16 weight copies kept for backward (0 without autocast)."""
    act = functools.partial(
        _stage_activation_bytes,
        m,
        stages,
        in_flight=in_flight,
        ep=ep,
        ac_every=ac_every,
        sequence_parallel=sequence_parallel,
        **mb_shape,
    )
    copies = functools.partial(autocast_copy_bytes, m, stages, in_flight=in_flight, tp=mb_shape["tp"], ep=ep)
    return dict(
        activation_bytes=act(activation_checkpointing=activation_checkpointing),
        activation_bytes_no_ac=act(activation_checkpointing="none"),
        activation_bytes_full_ac=act(activation_checkpointing="full"),
        autocast_bytes=copies(ac_every=ac_every, activation_checkpointing=activation_checkpointing) if autocast else 0,
    )


def _stage_activation_bytes(
    m: ModelConfig,
    stages: list[StageShape],
    *,
    in_flight: float,
    activation_checkpointing: str,
    ac_every: int,
    seq_len: int,
    micro_batch: int,
    tp: int,
    cp: int,
    ep: int,
    sequence_parallel: bool,
    compute_bytes: int,
) -> int:
    """Saved activations of the rank holding `stages` (`activation_bytes`) less the checkpointed block inputs
    that are pipeline receive buffers: those are held in `p2p_bytes` (`pp_recv_bytes`)."""
    layers = [i for st in stages for i in st.layers]
    saved = activation_bytes(
        m,
        layers,
        in_flight=in_flight,
        seq_len=seq_len,
        micro_batch=micro_batch,
        tp=tp,
        cp=cp,
        ep=ep,
        sequence_parallel=sequence_parallel,
        activation_checkpointing=activation_checkpointing,
        ac_every=ac_every,
        compute_bytes=compute_bytes,
    )
    shared = _received_and_checkpointed(stages, mode=activation_checkpointing, every=ac_every, rank_layers=layers)
    hop = _hop_bytes(
        m,
        tp=tp,
        cp=cp,
        seq_len=seq_len,
        micro_batch=micro_batch,
        sequence_parallel=sequence_parallel,
        compute_bytes=compute_bytes,
    )
    return saved - int(shared * hop * in_flight / max(len(layers), 1))


def _loss_bytes(
    m: ModelConfig,
    stages: list[StageShape],
    *,
    loss_parallel: bool,
    seq_len: int,
    micro_batch: int,
    tp: int,
    cp: int,
    compute_bytes: int,
) -> int:
    """The loss transient (`logits_bytes`) on the rank that holds the last stage; 0 elsewhere."""
    if not any(st.last for st in stages):
        return 0
    return logits_bytes(
        seq_len=seq_len,
        micro_batch=micro_batch,
        vocab_size=m.vocab_size,
        tp=tp,
        cp=cp,
        loss_parallel=loss_parallel,
        compute_bytes=compute_bytes,
    )


def autocast_copy_bytes(
    m: ModelConfig,
    stages: list[StageShape],
    *,
    in_flight: float,
    tp: int,
    ep: int = 1,
    activation_checkpointing: str = "none",
    ac_every: int = 2,
) -> int:
    """The bf16 copies of the weights that torch.autocast makes in forward and autograd keeps for backward,
    on parts FSDP does not wrap (parallel/precision.py): autocast casts each fp32 matmul weight once per
    forward (its cache lives for one autocast region, one microbatch) and the linear saves the copy, so every
    microbatch in flight holds a bf16 copy of the matmul weights it ran through (the embedding lookup and the
    norms are not cast). A checkpointed block keeps none (one is live again while it recomputes); the head's
    copy is kept per microbatch in flight on the last stage. Measured on CPU autocast
    (tests/unit/test_device.py: every saved bf16 weight copy, byte for byte)."""
    pc = count_params(m)
    layers = [i for st in stages for i in st.layers]
    ckpt = set(checkpointed_layers(layers, mode=activation_checkpointing, every=ac_every))
    kept, recompute = 0, 0
    for i in layers:
        b = pc.blocks[i]
        w = (b.attention + b.ffn) // tp + b.router + b.experts // (tp * ep)  # matmul weights: not the norms
        if i in ckpt:
            recompute = max(recompute, w)
        else:
            kept += w
    microbatches = in_flight / max(len(layers), 1)  # layer-microbatches per layer: microbatches in flight
    head = pc.output // tp if any(st.last for st in stages) else 0
    return COMPUTE_BYTES * (int(microbatches * (kept + head)) + recompute)


def _hop_bytes(
    m: ModelConfig, *, tp: int, cp: int, seq_len: int, micro_batch: int, sequence_parallel: bool, compute_bytes: int
) -> int:
    """One microbatch's hidden states between two stages (and one block's checkpointed input)."""
    return compute_bytes * (seq_len // cp) * micro_batch * m.dim // (tp if sequence_parallel and tp > 1 else 1)


def pp_recv_bytes(
    m: ModelConfig,
    stages: list[StageShape],
    *,
    tp: int,
    pp: int,
    cp: int,
    microbatches: int,
    seq_len: int,
    micro_batch: int,
    sequence_parallel: bool,
    compute_bytes: int,
) -> int:
    """Pipeline receive buffers on the rank holding `stages` (the `p2p` column): torch's PipelineStage
    allocates one per microbatch for the activations coming in (every stage but the first) and for the
    gradients coming back (every stage but the last), up front."""
    hop = _hop_bytes(
        m,
        tp=tp,
        cp=cp,
        seq_len=seq_len,
        micro_batch=micro_batch,
        sequence_parallel=sequence_parallel,
        compute_bytes=compute_bytes,
    )
    return 0 if pp <= 1 else microbatches * hop * sum(int(not st.first) + int(not st.last) for st in stages)


def _received_and_checkpointed(stages: list[StageShape], *, mode: str, every: int, rank_layers: list[int]) -> int:
    """Stages whose first block is checkpointed and gets its input from a pipeline receive buffer: that
    input is the buffer itself (one tensor), held in `p2p_bytes`, so the activations must not count it again."""
    ckpt = set(checkpointed_layers(rank_layers, mode=mode, every=every))
    return sum(1 for st in stages if not st.first and st.layers and st.layers[0] in ckpt)


def _fsdp_working_set(
    m: ModelConfig,
    stages: list[StageShape],
    *,
    tp: int,
    ep: int,
    fsdp: int,
    pp: int,
    microbatches: int,
    compute_bytes: int,
) -> int:
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
    if microbatches > 1:  # gradients accumulate without sync (set_requires_gradient_sync(False)): the whole model's
        return unsharded + (dense + experts) * REDUCE_BYTES
    # One microbatch: the peak is where the backward starts, every block's activations still held. By then only the
    # head has a gradient, in the compute dtype; a block's gradient and its fp32 copy for the reduce-scatter come
    # once that block's backward has freed its activations (no fewer bytes: jobs/planner/memory's per-layer figure
    # exceeds a block's 2 + 4 bytes per parameter at every preset shape), so they never add to this peak.
    head = pc.output // tp if any(st.last for st in stages) else 0
    return unsharded + head * compute_bytes


def heuristic_bytes_per_rank(total_params: int, *, model_shards: int) -> int:
    """The 16 bytes/parameter rule: params + grads + AdamW spread evenly over the ranks that shard
    the model (pp · tp · dp_shard · cp; dp_replicate holds copies)."""
    return HEURISTIC_BYTES_PER_PARAM * total_params // model_shards


# ------------------------------------------------------------------------------------------ checkpoint


def checkpoint_bytes(params_elems: int) -> int:
    """Bytes a checkpoint holds for `params_elems` parameters: fp32 weights + AdamW's two moments
    (gradients are not saved)."""
    return params_elems * (PARAM_BYTES + OPTIM_BYTES)
