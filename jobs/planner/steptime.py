"""The predicted step time: compute from FLOPs at the achieved matmul rate (attention's at the attention kernel's
own rate on a GPU profile, `Hardware.attention_tflops`; each GEMM shape at its tile waves' share of the rate,
`gemm_efficiency`), memory-bound ops and FSDP2's buffer copies at the HBM rate, communication from an alpha-beta
model per collective and mesh axis, with the overlap our recipe really has.

What overlaps (parallel/recipe.py, parallel/fsdp.py, parallel/pipeline.py):
  - FSDP2 prefetches the next block's all-gather while the current block computes; the first
    gather of a pass and whatever a gather takes beyond one block's compute are exposed. Gradient
    reduce-scatters (and HSDP's all-reduce) run behind the backward of earlier blocks, the last one
    exposed. With a pipeline the stage gathers once per step (reshard_after_forward=False) during the
    first microbatch, and reduces once after the last one.
  - Tensor-parallel collectives sit between the matmuls that need their result: all exposed.
  - Pipeline sends are on the critical path of every microbatch; the bubble stretches the stage's
    time by 1 / (1 - bubble). Context- and expert-parallel exchanges are counted exposed (our
    recipe does not overlap them).
  - The step's one world all-reduce (grad norm, loss, stop flag) is exposed.
  - On CPU ranks (gloo) nothing overlaps: the collectives run on the cores that compute. When more
    ranks than cores share a machine, a rank idle in the bubble gives its core to another rank: only
    the share 1 - (ranks / cores - 1) of the bubble is lost (none at twice as many ranks as cores).
The step tail (gradient-norm pass and AdamW) costs `optimizer_ns_per_param` per local parameter
element: calibrated, or on a published GPU profile the bytes they move at the HBM rate
(`hardware.OPTIMIZER_STEP_BYTES`; milliseconds for the presets' shards).

Host time that no FLOP count sees (calibrated; 0 on the published GPU profiles):
  - each FSDP2 unit (every block, and the root of each stage) runs its hooks and copies its shards
    into the gather buffer and out of it, and the gradients into the reduce buffer, and its
    collectives cost more inside a step than alone (on CPU ranks gloo's thread competes with the
    compute for the cores, and peers arrive apart): `fsdp_unit_host_s["tp<tp>"]` per unit per
    microbatch (once per step with a pipeline: its stages gather once and reduce once), timed at
    the mesh's tp degree (FSDP2 over DTensor parameters costs about 4x as much on CPU);
  - each pipeline schedule action (one stage's forward or backward of one microbatch) costs
    `pp_action_host_s` of bookkeeping beyond its compute and its sends.
On CPU ranks this time is on the critical path; on a GPU the host queues kernels ahead of the
device, so only what exceeds the device's compute is exposed. Calibrated on the 2-core box (4 ranks
busy, tiny model): 7-12 ms per FSDP2 unit per microbatch (tp 1), 11-22 ms (tp 2), and 0.2-1.5 ms per
pipeline action: with them the prediction is within 0.75-1.25 of the measured step
(scripts/bench/steptime_vs_measured.py measures the agreement).

Pure functions of plain numbers, `ModelConfig` and `Hardware`; no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jobs.config import ModelConfig
from jobs.planner import arith as P
from jobs.planner import gemm as G
from jobs.planner import traffic as T
from jobs.planner.hardware import Hardware, axis_ranks_per_node, axis_scope
from jobs.planner.params import REDUCE_BYTES

__all__ = [
    "StepTime",
    "stage_flops",
    "attention_flops",
    "flops_seconds",
    "executed_attention",
    "two_way_traffic_s",
    "predict_rank",
    "predict_step",
    "exposed_axis",
    "memory_bound_s",
    "gemm_efficiency",
    "fsdp_copy_s",
]

_EXPOSED_AXES = ("tp", "pp", "cp", "ep")


def exposed_axis(axis: str) -> bool:
    """Whether collectives on `axis` sit on the critical path (not hidden behind compute): tp, pp, cp and every
    expert-parallel leg (`ep`, node-limited routing's `ep_intra`), whatever suffix the plan gives the name
    (`dp_shard*cp`, `dp_shard/ep` are FSDP's and overlap)."""
    base = axis.split("/")[0].split("*")[0]
    return base in _EXPOSED_AXES or base.startswith("ep")


def stage_flops(
    m: ModelConfig, stages: list[P.StageShape], *, tokens: float, seq_len: int, tp: int, recomputed: list[int]
) -> tuple[float, float, float]:
    """(forward FLOPs of one microbatch of `tokens` tokens, training FLOPs per microbatch, recompute
    FLOPs per microbatch) of the rank holding `stages`: 2 x active matmul parameters per token (over
    tp) plus causal attention (`attention_flops`); the head on the last stage.
    Training = 3 x forward; a recomputed block runs its forward once more."""
    pc = P.count_params(m)
    attention = attention_flops(m, tokens=tokens, seq_len=seq_len, tp=tp)

    def block(i: int) -> float:
        b = pc.blocks[i]
        return tokens * 2.0 * (b.active - b.norms) / tp + attention

    fwd = sum(block(i) for st in stages for i in st.layers)
    if any(st.last for st in stages):
        fwd += tokens * 2.0 * pc.output / tp
    return fwd, 3.0 * fwd, sum(block(i) for i in recomputed)


def attention_flops(m: ModelConfig, *, tokens: float, seq_len: int, tp: int) -> float:
    """Forward FLOPs of one block's attention scores and weighted sum for `tokens` tokens over tp: causal,
    2 * seq_len * width / 2 per token (QK^T and PV, half the positions)."""
    width = m.n_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) if m.attention == "mla" else 2 * m.dim
    return tokens * 2.0 * seq_len * width / 2.0 / tp


def executed_attention(m: ModelConfig) -> tuple[float, float]:
    """(FLOPs run beyond the causal count, FLOPs run in the attention kernel), per causal attention FLOP: torch's
    flash kernels skip the masked half and run at the attention kernel's rate (`model.sdpa_backend=auto`, 0, 1);
    its math backend computes every score as a GEMM and masks after (`math`: twice the causal FLOPs, all at the
    GEMM rate, 1, 0)."""
    return (1.0, 0.0) if m.sdpa_backend == "math" else (0.0, 1.0)


def flops_seconds(
    flops: float, attention: float, hw: Hardware, *, gemm_efficiency: float = 1.0, seq_len: int = 0
) -> float:
    """Seconds of `flops`, `attention` of which run in the attention kernel: at its own rate at `seq_len` where the
    profile has one (`Hardware.attention_at`), else at the matmul rate; the GEMMs at `gemm_efficiency` of the matmul
    rate (their shapes' tile and wave quantization, `gemm_efficiency`)."""
    rate = hw.matmul_tflops * 1e12
    attention_rate = hw.attention_at(seq_len) * 1e12 if hw.attention_tflops > 0 else rate
    return (flops - attention) / (rate * gemm_efficiency) + attention / attention_rate


@dataclass
class StepTime:
    """One pp role's predicted step: each part named, in seconds per optimizer step."""

    role: str
    step_s: float
    parts: dict[
        str, float
    ]  # compute_s, recompute_s, memory_bound_s, interference_s, host_s, comm_exposed_s, bubble_s, dp_exposed_s, optimizer_s
    comm: list[dict] = field(default_factory=list)  # per collective/axis: scope, seconds, exposed_s, link source
    gemm_efficiency: float = 1.0  # the share of the matmul rate this rank's GEMM shapes reach (`gemm_efficiency`)


def _dp_exposed(seconds: float, calls: int, window: float) -> float:
    """A chain of `calls` equal collectives, each hidden behind `window` seconds of compute but the first."""
    if calls <= 0:
        return 0.0
    per = seconds / calls
    return per + (calls - 1) * max(0.0, per - window)


def _fsdp_exposed(
    it: dict, secs: float, *, pp: int, units: int, fwd_unit: float, bwd_unit: float, gather_per_unit: float
) -> float:
    """The exposed part of one FSDP row. With a pipeline the stage gathers once, during the first microbatch's
    forward, and reduces once, behind the last backward. Without one, each microbatch gathers every unit ahead of
    its forward and again ahead of its backward (prefetched: the first gather of the step is exposed, and what a
    gather takes beyond its unit's compute); the reduce-scatters of the last backward share the link with that
    backward's gathers (`gather_per_unit`), so only the compute the gathers leave hides them."""
    n = it["count"]
    if it["collective"] == "all_gather":
        if pp > 1:
            return _dp_exposed(secs, n, fwd_unit)
        per, fwd_calls = secs / max(n, 1), n // 2
        return per + max(fwd_calls - 1, 0) * max(0.0, per - fwd_unit) + (n - fwd_calls) * max(0.0, per - bwd_unit)
    return _dp_exposed(secs, n, max(0.0, bwd_unit - (0.0 if pp > 1 else gather_per_unit)))


def _time_comm(
    items: list[dict], hw: Hardware, shape: dict[str, int], *, fwd_s: float, train_s: float, pp: int, units: int
) -> tuple[list[dict], float, float]:
    """Each collective's time and its exposed part; returns (rows, exposed on the stage, exposed after it).
    `fwd_s`, `train_s`: one microbatch's forward and whole (forward, backward, recompute) device time."""
    rows, stage, tail = [], 0.0, 0.0
    timed = []
    for it in items:
        scope = axis_scope(it["axis"], shape, node_ranks=hw.node_ranks, pod_ranks=hw.pod_ranks)
        per_node = axis_ranks_per_node(it["axis"], shape, group=it["group"], node_ranks=hw.node_ranks)
        link = hw.link(it["collective"], scope, ranks_per_node=per_node)
        timed.append(
            (
                it,
                scope,
                link,
                link.seconds(calls=it["count"], nbytes=it["bytes"], op=it["collective"], group=it["group"]),
            )
        )
    gathers = {it["axis"]: secs / max(it["count"], 1) for it, _, _, secs in timed if it["collective"] == "all_gather"}
    fwd_unit, bwd_unit = fwd_s / max(units, 1), (train_s - fwd_s) / max(units, 1)
    for it, scope, link, secs in timed:
        on_stage = exposed_axis(it["axis"])
        if not hw.overlap or on_stage:
            exposed = secs
        else:
            exposed = _fsdp_exposed(
                it,
                secs,
                pp=pp,
                units=units,
                fwd_unit=fwd_unit,
                bwd_unit=bwd_unit,
                gather_per_unit=gathers.get(it["axis"], 0.0),
            )
        stage, tail = stage + (exposed if on_stage else 0.0), tail + (0.0 if on_stage else exposed)
        rows.append(
            {
                **it,
                "scope": scope,
                "seconds": secs,
                "exposed_s": exposed,
                "alpha_s": link.alpha_s,
                "bus_GBps": link.bus_GBps,
                "source": link.source,
            }
        )
    return rows, stage, tail


def gemm_efficiency(m: ModelConfig, stages: list[P.StageShape], hw: Hardware, *, tokens: float, tp: int) -> float:
    """The share of the best shape's matmul rate that the GEMMs of the rank holding `stages` reach, FLOP-weighted,
    from their shapes' tile and wave quantization on `hw.gemm_sms` SMs (`gemm.wave_efficiency`: NVIDIA's Matrix
    Multiplication Background guide); 1.0 where the rate was calibrated on the model's own shapes (gemm_sms 0) or the
    GEMM shapes are not listed (MLA, MoE)."""
    if hw.gemm_sms <= 0 or m.attention == "mla" or m.n_routed_experts > 0:
        return 1.0
    blocks, head = sum(len(st.layers) for st in stages), any(st.last for st in stages)
    gemms = G.rank_gemms(m, tokens=int(tokens), tp=tp, blocks=blocks, head=head)
    return G.gemms_wave_efficiency(gemms, hw.gemm_sms)


def memory_bound_s(
    m: ModelConfig,
    stages: list[P.StageShape],
    hw: Hardware,
    *,
    tokens: float,
    tp: int,
    sequence_parallel: bool,
    recomputed: list[int],
    compute_bytes: int = 2,
) -> tuple[float, float]:
    """(forward, recompute) seconds of one microbatch's memory-bound ops on the rank holding `stages`
    (jobs.planner.traffic) at the HBM rate; (0, 0) when the profile has none (a calibrated rate holds them)."""
    if hw.hbm_GBps <= 0:
        return 0.0, 0.0
    rate = hw.hbm_GBps * 1e9

    def block(i: int) -> float:
        return (
            tokens
            * T.block_bytes_per_token(
                m, layer=i, tp=tp, sequence_parallel=sequence_parallel, compute_bytes=compute_bytes
            )
            / rate
        )

    fwd = sum(block(i) for st in stages for i in st.layers)
    if any(st.last for st in stages):  # the loss, forward and backward, booked with the forward
        fwd += tokens * T.loss_bytes_per_token(m, tp=tp) / 3.0 / rate
    return fwd, sum(block(i) for i in recomputed)


def two_way_traffic_s(
    m: ModelConfig,
    stages: list[P.StageShape],
    hw: Hardware,
    *,
    tokens: float,
    seq_len: int,
    tp: int,
    sequence_parallel: bool,
    recomputed: list[int],
    compute_bytes: int = 2,
) -> tuple[float, float, float]:
    """(forward, backward, recompute) seconds of one microbatch's materialised attention scores and fused norms on
    the rank holding `stages` at the HBM rate (`traffic.two_way_bytes_per_token`); zeros with flash attention and
    eager norms, or without a profiled HBM rate."""
    if hw.hbm_GBps <= 0:
        return 0.0, 0.0, 0.0
    fwd, bwd = T.two_way_bytes_per_token(
        m, seq_len=seq_len, tp=tp, sequence_parallel=sequence_parallel, compute_bytes=compute_bytes
    )
    per = tokens / (hw.hbm_GBps * 1e9)
    blocks = sum(len(st.layers) for st in stages)
    return blocks * fwd * per, blocks * bwd * per, len(recomputed) * fwd * per


def fsdp_copy_s(items: list[dict], hw: Hardware, *, compute_bytes: int = 2) -> float:
    """Seconds per step that FSDP2 moves through HBM on the compute stream beside its collectives
    (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): each all-gather's copy-out into the unsharded
    parameters (`split_with_sizes_copy`: the gathered bytes read and written once) and each reduce-scatter's copy-in
    (`_chunk_cat`: the gradients read in the compute dtype and written in the fp32 reduce dtype), at the HBM rate;
    0 when the profile has none. `items`: the rank's collectives (bytes one rank sends, the ring's (g - 1) / g)."""
    if hw.hbm_GBps <= 0:
        return 0.0
    moved = 0.0
    for it in items:
        if not it["axis"].startswith("dp_shard") or it["group"] <= 1:
            continue
        whole = it["bytes"] * it["group"] / (it["group"] - 1)  # the gathered output, the reduce-scatter's input
        if it["collective"] == "all_gather":
            moved += 2 * whole
        elif it["collective"] == "reduce_scatter":
            moved += whole * (1 + compute_bytes / REDUCE_BYTES)
    return moved / (hw.hbm_GBps * 1e9)


def _host_s(
    hw: Hardware, shape: dict[str, int], stages: list[P.StageShape], *, microbatches: int, device_s: float
) -> float:
    """Host seconds per step that FLOPs do not count (see the module docstring): FSDP2 units (each
    block plus the stage's root) and pipeline actions (forward and backward per microbatch per stage)."""
    pp = shape.get("pp", 1)
    fsdp = shape.get("dp_shard", 1) * shape.get("dp_replicate", 1) > 1
    units = sum(len(st.layers) + 1 for st in stages) if fsdp else 0
    host = units * hw.fsdp_unit_host_s * (1 if pp > 1 else microbatches)
    if pp > 1:
        host += 2 * microbatches * len(stages) * hw.pp_action_host_s
    return host if not hw.overlap else max(0.0, host - device_s)


@dataclass(frozen=True, slots=True)
class _Device:
    """One rank's device time per step (compute, recompute, memory-bound) and one microbatch's forward and whole
    device time, the windows FSDP's prefetch hides behind."""

    compute: float
    recompute: float
    memory: float
    fwd_mb: float
    train_mb: float
    gemm_efficiency: float


def _device_s(
    m: ModelConfig,
    stages: list[P.StageShape],
    items: list[dict],
    hw: Hardware,
    *,
    shape: dict[str, int],
    microbatches: int,
    tokens: float,
    seq_len: int,
    recomputed: list[int],
    sequence_parallel: bool,
    compute_bytes: int,
) -> _Device:
    """FLOPs at the matmul and attention rates, memory-bound ops and FSDP2's copies at the HBM rate (see
    `predict_rank`)."""
    tp = shape.get("tp", 1)
    fwd, train, re = stage_flops(m, stages, tokens=tokens, seq_len=seq_len, tp=tp, recomputed=recomputed)
    att = attention_flops(m, tokens=tokens, seq_len=seq_len, tp=tp)
    att_fwd, att_re = att * sum(len(st.layers) for st in stages), att * len(recomputed)
    extra, kernel = executed_attention(m)
    fwd, train, re = fwd + extra * att_fwd, train + 3.0 * extra * att_fwd, re + extra * att_re
    eff = gemm_efficiency(m, stages, hw, tokens=tokens, tp=tp)
    compute = microbatches * flops_seconds(train, 3.0 * kernel * att_fwd, hw, gemm_efficiency=eff, seq_len=seq_len)
    recompute = microbatches * flops_seconds(re, kernel * att_re, hw, gemm_efficiency=eff, seq_len=seq_len)
    nm_fwd, nm_re = memory_bound_s(
        m,
        stages,
        hw,
        tokens=tokens,
        tp=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        recomputed=recomputed,
        compute_bytes=compute_bytes,
    )
    sc_fwd, sc_bwd, sc_re = two_way_traffic_s(
        m,
        stages,
        hw,
        tokens=tokens,
        seq_len=seq_len,
        tp=tp,
        sequence_parallel=sequence_parallel and tp > 1,
        recomputed=recomputed,
        compute_bytes=compute_bytes,
    )
    nm_fwd, nm_mb = nm_fwd + sc_fwd, 3.0 * nm_fwd + nm_re + sc_fwd + sc_bwd + sc_re
    memory = microbatches * nm_mb + fsdp_copy_s(items, hw, compute_bytes=compute_bytes)
    return _Device(
        compute=compute,
        recompute=recompute,
        memory=memory,
        fwd_mb=flops_seconds(fwd, kernel * att_fwd, hw, gemm_efficiency=eff, seq_len=seq_len) + nm_fwd,
        train_mb=(compute + recompute) / max(microbatches, 1) + nm_mb,
        gemm_efficiency=eff,
    )


def _world_row(hw: Hardware, world: int) -> dict:
    """The step's one world all-reduce (grad norm, loss, stop flag), exposed."""
    nbytes = int(2 * 24 * (world - 1) / max(world, 1))
    scope = "intra" if world <= hw.node_ranks else "inter"
    link = hw.link("all_reduce", scope)
    secs = link.seconds(calls=1, nbytes=nbytes, op="all_reduce", group=world)
    return {
        "collective": "all_reduce",
        "axis": "world",
        "what": "grad norm, loss, stop flag (fp64)",
        "count": 1,
        "bytes": nbytes,
        "group": world,
        "scope": scope,
        "seconds": secs,
        "exposed_s": secs,
        "alpha_s": link.alpha_s,
        "bus_GBps": link.bus_GBps,
        "source": link.source,
    }


def predict_rank(
    m: ModelConfig,
    stages: list[P.StageShape],
    items: list[dict],
    hw: Hardware,
    *,
    role: str,
    shape: dict[str, int],
    microbatches: int,
    micro_batch: int,
    seq_len: int,
    bubble: float,
    recomputed: list[int],
    world: int,
    params_elems: int = 0,
    sequence_parallel: bool = True,
    compute_bytes: int = 2,
) -> StepTime:
    """The step time of the rank holding `stages`, whose collectives per step are `items`
    (`arith.CommItem.as_dict()` rows, axis names as the plan prints them)."""
    dev = _device_s(
        m,
        stages,
        items,
        hw,
        shape=shape,
        microbatches=microbatches,
        tokens=micro_batch * seq_len / shape.get("cp", 1),
        seq_len=seq_len,
        recomputed=recomputed,
        sequence_parallel=sequence_parallel,
        compute_bytes=compute_bytes,
    )
    units = sum(len(st.layers) + int(st.first or st.last) for st in stages)
    pp = shape.get("pp", 1)
    rows, stage_comm, tail = _time_comm(items, hw, shape, fwd_s=dev.fwd_mb, train_s=dev.train_mb, pp=pp, units=units)
    rows.append(_world_row(hw, world))
    device = dev.compute + dev.recompute + dev.memory
    hidden = sum(r["seconds"] - r["exposed_s"] for r in rows)  # collectives running beside the compute
    interference = hw.comm_sm_share * min(hidden, device)
    host = _host_s(hw, shape, stages, microbatches=microbatches, device_s=device)
    busy = device + interference + stage_comm + host
    parts = {
        "compute_s": dev.compute,
        "recompute_s": dev.recompute,
        "memory_bound_s": dev.memory,
        "interference_s": interference,
        "host_s": host,
        "comm_exposed_s": stage_comm,
        "bubble_s": hw.bubble_cost * busy * bubble / (1.0 - bubble) if bubble < 1 else 0.0,
        "dp_exposed_s": tail + rows[-1]["exposed_s"],
        "optimizer_s": params_elems * hw.optimizer_ns_per_param * 1e-9,
    }
    return StepTime(role=role, step_s=sum(parts.values()), parts=parts, comm=rows, gemm_efficiency=dev.gemm_efficiency)


def predict_step(per_role: list[StepTime]) -> StepTime:
    """The step is as slow as its slowest pipeline role (every rank waits at the world all-reduce)."""
    return max(per_role, key=lambda s: s.step_s)
