"""The planner's communication arithmetic: the collectives one rank issues per optimizer step, by mesh axis, and
which axes cross the NVLink domain.

Pure functions of plain numbers and `ModelConfig`; no torch, no Hydra, no I/O (the rules of `jobs.planner.arith`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jobs.config import ModelConfig
from jobs.planner.memory import StageShape, stage_elems
from jobs.planner.params import COMPUTE_BYTES, REDUCE_BYTES, count_params, kv_bytes_per_token
from parallel.config import checkpointed_layers

__all__ = ["CommItem", "comm_per_step", "axis_spans_nodes"]


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
    """Collectives per optimizer step for the rank holding `stages`, by axis, one helper per concern: FSDP's
    gathers and reductions (`_fsdp_items`), tensor parallel's activation collectives (`_tp_items`; an MoE block's
    FFN half `_moe_tp_items`), the pipeline's sends (`_pp_item`), context parallel's K/V exchange (`_cp_items`) and
    the MoE all-to-alls (`_moe_items`).
    Parameters are gathered and activations sent in the compute dtype: `compute_bytes` 2 (bf16), 4 (fp32).
    """
    blocks = [i for st in stages for i in st.layers]
    recomputed = checkpointed_layers(blocks, mode=activation_checkpointing, every=ac_every)  # forward twice
    items = _fsdp_items(
        m,
        stages,
        pp=pp,
        dp_replicate=dp_replicate,
        fsdp=fsdp,
        tp=tp,
        ep=ep,
        microbatches=microbatches,
        compute_bytes=compute_bytes,
    )
    return items + _activation_items(
        m,
        stages,
        blocks,
        recomputed,
        pp=pp,
        tp=tp,
        cp=cp,
        ep=ep,
        microbatches=microbatches,
        seq_len=seq_len,
        micro_batch=micro_batch,
        sequence_parallel=sequence_parallel,
        nvlink_domain=nvlink_domain,
        compute_bytes=compute_bytes,
    )


def _activation_items(
    m: ModelConfig,
    stages: list[StageShape],
    blocks: list[int],
    recomputed: list[int],
    *,
    pp: int,
    tp: int,
    cp: int,
    ep: int,
    microbatches: int,
    seq_len: int,
    micro_batch: int,
    sequence_parallel: bool,
    nvlink_domain: int,
    compute_bytes: int,
) -> list[CommItem]:
    """The collectives that move activations (`comm_per_step` without FSDP's): tensor parallel's, the pipeline's
    sends, context parallel's K/V and the MoE all-to-alls."""
    act = compute_bytes * (seq_len // cp) * micro_batch * m.dim  # one microbatch's hidden states on a tp group
    dt = _dtype_name(compute_bytes)
    items: list[CommItem] = []
    if tp > 1:
        items += _tensor_parallel_items(
            m,
            stages,
            blocks,
            recomputed,
            microbatches=microbatches,
            act=act,
            tp=tp,
            sequence_parallel=sequence_parallel,
            dt=dt,
            micro_batch=micro_batch,
        )
    if pp > 1:
        per = act // tp if sequence_parallel and tp > 1 else act
        items.append(_pp_item(stages, pp=pp, microbatches=microbatches, per=per, dt=dt))
    return items + _cp_ep_items(
        m,
        blocks,
        recomputed,
        microbatches=microbatches,
        s=seq_len // cp,
        micro_batch=micro_batch,
        tp=tp,
        cp=cp,
        ep=ep,
        nvlink_domain=nvlink_domain,
        compute_bytes=compute_bytes,
    )


def _cp_ep_items(
    m: ModelConfig,
    blocks: list[int],
    recomputed: list[int],
    *,
    microbatches: int,
    s: int,
    micro_batch: int,
    tp: int,
    cp: int,
    ep: int,
    nvlink_domain: int,
    compute_bytes: int,
) -> list[CommItem]:
    """Context parallel's K/V exchange (`_cp_items`) and the MoE all-to-alls (`_moe_items`) of the rank's `blocks`,
    `s` tokens of each sequence on it."""
    items: list[CommItem] = []
    if cp > 1:
        items += _cp_items(
            m,
            blocks=len(blocks),
            recomputed=len(recomputed),
            microbatches=microbatches,
            s=s,
            micro_batch=micro_batch,
            tp=tp,
            cp=cp,
            compute_bytes=compute_bytes,
        )
    if ep > 1:
        items += _moe_items(
            m,
            blocks,
            recomputed=recomputed,
            microbatches=microbatches,
            s=s,
            micro_batch=micro_batch,
            tp=tp,
            ep=ep,
            nvlink_domain=nvlink_domain,
            compute_bytes=compute_bytes,
        )
    return items


def _tensor_parallel_items(
    m: ModelConfig,
    stages: list[StageShape],
    blocks: list[int],
    recomputed: list[int],
    *,
    microbatches: int,
    act: int,
    tp: int,
    sequence_parallel: bool,
    dt: str,
    micro_batch: int,
) -> list[CommItem]:
    """Tensor parallel's activation collectives: every block's (`_tp_items`) and an MoE block's FFN half
    (`_moe_tp_items`)."""
    ends = int(any(st.first for st in stages)) + int(any(st.last for st in stages))
    moe = [i for i in blocks if m.n_routed_experts > 0 and i >= m.n_dense_layers]
    moe_rec = sum(1 for i in recomputed if i in moe)
    items = _tp_items(
        blocks=len(blocks),
        recomputed=len(recomputed),
        microbatches=microbatches,
        ends=ends,
        act=act,
        tp=tp,
        sequence_parallel=sequence_parallel,
        dt=dt,
        moe_blocks=len(moe),
        moe_recomputed=moe_rec,
    )
    if moe:
        items += _moe_tp_items(
            blocks=len(moe),
            recomputed=moe_rec,
            microbatches=microbatches,
            act=act,
            tp=tp,
            top_k=m.experts_per_token,
            shared=m.n_shared_experts * m.moe_ffn_dim > 0,
            sequence_parallel=sequence_parallel,
            dt=dt,
            n_experts=m.n_routed_experts,
            aux_rows=micro_batch if m.moe_aux_loss_coef > 0 else 0,
        )
    return items


def _pp_item(stages: list[StageShape], *, pp: int, microbatches: int, per: int, dt: str) -> CommItem:
    """The pipeline's sends: one activation send forward and one gradient send backward per microbatch per stage
    boundary of the rank's stages (`per` bytes each: one microbatch's hidden states, sequence-sharded with SP)."""
    sends = microbatches * (sum(not st.last for st in stages) + sum(not st.first for st in stages))
    return CommItem("send_recv", "pp", f"{dt} activations fwd + grads bwd", sends, sends * per, pp)


def _moe_items(
    m: ModelConfig,
    blocks: list[int],
    *,
    recomputed: list[int],
    microbatches: int,
    s: int,
    micro_batch: int,
    tp: int,
    ep: int,
    nvlink_domain: int,
    compute_bytes: int,
) -> list[CommItem]:
    """Expert parallel's dispatch and combine all-to-all per MoE block per microbatch, per forward and backward
    (and per recomputed forward), node-limited when `model.moe_max_nodes` is set (`_ep_items`; `nvlink_domain`:
    GPUs per node, 0 = unknown: every copy on the ep axis)."""
    moe = [i for i in blocks if m.n_routed_experts > 0 and i >= m.n_dense_layers]
    if not moe:
        return []
    n = 2 * microbatches * (2 * len(moe) + sum(1 for i in recomputed if i in moe))  # dispatch + combine
    return _ep_items(
        m, n=n, s=s, micro_batch=micro_batch, tp=tp, ep=ep, nvlink_domain=nvlink_domain, compute_bytes=compute_bytes
    )


def _dtype_name(compute_bytes: int) -> str:
    return {2: "bf16", 4: "fp32"}.get(compute_bytes, f"{compute_bytes}-byte")


def _fsdp_items(
    m: ModelConfig,
    stages: list[StageShape],
    *,
    pp: int,
    dp_replicate: int,
    fsdp: int,
    tp: int,
    ep: int,
    microbatches: int,
    compute_bytes: int = COMPUTE_BYTES,
) -> list[CommItem]:
    """FSDP's parameter all-gathers and gradient reduce-scatters (dense over dp_shard·cp, experts over
    their own dp degree), and HSDP's all-reduce of the shard over dp_replicate.

    Counts from CommDebugMode (notes torch-2.13-cpu.md §9): with a pipeline the stage stays gathered
    (reshard_after_forward=False), so one all-gather per fully_shard unit per step; without one, each
    microbatch gathers every block for forward and again for backward and the root once. Gradients
    reduce-scatter once per unit per step (the pipeline schedule and the trainer sync on the last microbatch
    only). A unit without parameters of its own (the root of a middle stage) issues nothing."""
    dense, experts = stage_elems(m, stages, tp=tp, ep=ep)
    blocks = [i for st in stages for i in st.layers]
    units = len(blocks) + sum(1 for st in stages if st.first or st.last)  # root units that own parameters
    items = []
    if fsdp > 1 and dense:
        kw = dict(pp=pp, fsdp=fsdp, tp=tp, microbatches=microbatches, compute_bytes=compute_bytes)
        items += _dense_fsdp_items(m, stages, dense=dense, units=units, **kw)
    edp = fsdp // max(ep, 1)  # the experts' own data-parallel degree
    if edp > 1 and experts:
        moe_blocks = sum(1 for i in blocks if m.n_routed_experts > 0 and i >= m.n_dense_layers)
        gathers = 1 if pp > 1 else 2 * microbatches
        items += _expert_fsdp_items(
            experts, edp=edp, moe_blocks=moe_blocks, gathers=gathers, compute_bytes=compute_bytes
        )
    if dp_replicate > 1:
        shard = dense // max(fsdp, 1) + experts // max(edp, 1)
        items.append(
            CommItem(
                "all_reduce",
                "dp_replicate",
                "fp32 gradient shards",
                units,
                int(2 * _ring(dp_replicate) * REDUCE_BYTES * shard),
                dp_replicate,
            )
        )
    return items


def _dense_fsdp_items(
    m: ModelConfig,
    stages: list[StageShape],
    *,
    dense: int,
    units: int,
    pp: int,
    fsdp: int,
    tp: int,
    microbatches: int,
    compute_bytes: int,
) -> list[CommItem]:
    """The dense parameters' all-gathers (`units` per step with a pipeline; without one, each microbatch gathers
    every block twice and the root once) and their fp32 gradients' reduce-scatter, once per unit per step."""
    pc = count_params(m)
    first, last = any(st.first for st in stages), any(st.last for st in stages)
    root_elems = (pc.embedding // tp if first else 0) + (pc.output // tp + pc.final_norm if last else 0)
    blocks = sum(len(st.layers) for st in stages)
    if pp > 1:
        ag_count, ag_elems = units, dense
    else:
        ag_count = microbatches * (2 * blocks + units - blocks)
        ag_elems = microbatches * (2 * (dense - root_elems) + root_elems)
    return [
        CommItem(
            "all_gather",
            "dp_shard",
            f"{_dtype_name(compute_bytes)} parameters",
            ag_count,
            int(_ring(fsdp) * compute_bytes * ag_elems),
            fsdp,
        ),
        CommItem("reduce_scatter", "dp_shard", "fp32 gradients", units, int(_ring(fsdp) * REDUCE_BYTES * dense), fsdp),
    ]


def _expert_fsdp_items(experts: int, *, edp: int, moe_blocks: int, gathers: int, compute_bytes: int) -> list[CommItem]:
    """The routed experts' all-gathers (`gathers` per MoE block per step) and gradient reduce-scatters over the
    experts' own data-parallel degree `edp`."""
    return [
        CommItem(
            "all_gather",
            "dp_shard/ep",
            f"{_dtype_name(compute_bytes)} expert parameters",
            gathers * moe_blocks,
            int(gathers * _ring(edp) * compute_bytes * experts),
            edp,
        ),
        CommItem(
            "reduce_scatter",
            "dp_shard/ep",
            "fp32 expert gradients",
            moe_blocks,
            int(_ring(edp) * REDUCE_BYTES * experts),
            edp,
        ),
    ]


def _tp_items(
    *,
    blocks: int,
    recomputed: int,
    microbatches: int,
    ends: int,
    act: int,
    tp: int,
    sequence_parallel: bool,
    dt: str = "bf16",
    moe_blocks: int = 0,
    moe_recomputed: int = 0,
) -> list[CommItem]:
    """Tensor parallel's activation collectives (notes §3): with SP, per block and microbatch 2 all-gathers +
    2 reduce-scatters forward (again when recomputing) and the mirror image backward, plus one of each for the
    embedding and for the head (`ends`: how many of the two the rank holds); without SP, the same count of
    all-reduces: 2 forward (wo, w2) and 2 backward, one per sub-layer's input gradient, where the Partial gradients
    of wq, wk, wv (and of w1, w3) meet at the sub-layer's input and are summed before one all-reduce
    (tests/multiproc/test_collective_counts.py counts them). Of the `moe_blocks` (`moe_recomputed` of them
    recomputed) only the attention half counts here (1 + 1 each way); their FFN half is `_moe_tp_items`."""
    mb, dense, dense_rec = microbatches, blocks - moe_blocks, recomputed - moe_recomputed
    n = 4 * mb * dense + 2 * mb * dense_rec + 2 * mb * moe_blocks + mb * moe_recomputed + ends * mb
    if sequence_parallel:
        b = int(n * _ring(tp) * act)
        return [
            CommItem("all_gather", "tp", f"{dt} activations (SP)", n, b, tp),
            CommItem("reduce_scatter", "tp", f"{dt} activations (SP)", n, b, tp),
        ]
    return [CommItem("all_reduce", "tp", f"{dt} activations", n, int(n * 2 * _ring(tp) * act), tp)]


def _moe_tp_items(
    *,
    blocks: int,
    recomputed: int,
    microbatches: int,
    act: int,
    tp: int,
    top_k: int,
    shared: bool,
    sequence_parallel: bool,
    dt: str,
    n_experts: int = 0,
    aux_rows: int = 0,
) -> list[CommItem]:
    """The FFN half of `blocks` MoE blocks under tp (etp = tp), as parallel/tp.py builds it (`_moe_plan`,
    `_shard_routed_experts`) and tests/multiproc/test_moe_ep.py counts it, per block and microbatch. Each tp rank
    routes its 1/tp of the tokens; the routed rows (top_k x `act` over the tp group) are gathered over tp before the
    experts and their partial outputs reduce-scattered after (two uneven all-to-alls each way); the shared experts
    cost an all-gather and a reduce-scatter each way (`act`; none without shared experts); forward also gathers
    the per-expert counts (`n_experts` int64) and, with the balance loss on, all-reduces its counts (`aux_rows`
    sequences x `n_experts` fp32); without SP the block's output is all-gathered forward and its input's gradient
    backward (`act`). A recomputed block repeats its forward."""
    fwd = microbatches * (blocks + recomputed)  # forward passes (recomputed ones again)
    bwd = microbatches * blocks
    r = _ring(tp)
    rows = 2 * (fwd + bwd)  # gathered before the experts, reduce-scattered after
    items = [
        CommItem(
            "all_to_all", "tp", f"{dt} MoE routed rows ({top_k} per token)", rows, int(rows * r * top_k * act), tp
        ),
        CommItem("all_gather", "tp", "int64 MoE expert counts", fwd, int(fwd * r * tp * 8 * n_experts), tp),
    ]
    if shared:
        for op in ("all_gather", "reduce_scatter"):
            items.append(
                CommItem(op, "tp", f"{dt} MoE shared experts' activations", fwd + bwd, int((fwd + bwd) * r * act), tp)
            )
    if aux_rows:
        items.append(
            CommItem(
                "all_reduce", "tp", "fp32 MoE balance-loss counts", fwd, int(fwd * 2 * r * 4 * aux_rows * n_experts), tp
            )
        )
    if not sequence_parallel:
        items.append(
            CommItem(
                "all_gather", "tp", f"{dt} MoE block output / input grad", fwd + bwd, int((fwd + bwd) * r * act), tp
            )
        )
    return items


def _cp_items(
    m: ModelConfig,
    *,
    blocks: int,
    recomputed: int,
    microbatches: int,
    s: int,
    micro_batch: int,
    tp: int,
    cp: int,
    compute_bytes: int = COMPUTE_BYTES,
) -> list[CommItem]:
    """Context parallel as Llama 3 runs it ("The Llama 3 Herd of Models", arXiv 2407.21783, §3.3.2):
    "we first all-gather the key (K) and value (V) tensors, and then compute attention output for the
    local query (Q) tensor chunk" (the sequence split into 2·cp load-balanced chunks), not ring
    attention's cp-1 point-to-point exchanges. Per block and microbatch: one K/V all-gather forward
    (again when the block is recomputed) and the reduce-scatter of dK/dV backward, each moving
    (cp-1)/cp of the full sequence's K/V per rank."""
    kv_local = (
        kv_bytes_per_token(m, tp=tp, compute_bytes=compute_bytes) * s * micro_batch
    )  # this rank's 1/cp of the sequence
    dt = _dtype_name(compute_bytes)
    ag = microbatches * (blocks + recomputed)
    rs = microbatches * blocks
    return [
        CommItem("all_gather", "cp", f"{dt} K/V (all-gather CP)", ag, ag * (cp - 1) * kv_local, cp),
        CommItem("reduce_scatter", "cp", f"{dt} dK/dV (all-gather CP)", rs, rs * (cp - 1) * kv_local, cp),
    ]


def _ep_items(
    m: ModelConfig,
    *,
    n: int,
    s: int,
    micro_batch: int,
    tp: int,
    ep: int,
    nvlink_domain: int,
    compute_bytes: int = COMPUTE_BYTES,
) -> list[CommItem]:
    """The MoE all-to-alls of `n` dispatch/combine calls, as jobs.train's dispatch (parallel/ep.py) sends them: each
    of a token's k routed copies goes straight to its expert's rank, k·(ep-1)/ep copies per token on the ep axis.
    With `model.moe_max_nodes` set and the nodes known (`nvlink_domain`: GPUs per node, g = ep ranks per node), the
    copies are split by where they land: k·(nodes-1)/nodes of them on another node (axis `ep`, inter-node), k·(g-1)/
    (g·nodes) on another GPU of this node (axis `ep_intra`). Node-limited routing bounds which nodes a token
    reaches, not how many copies cross: the trainer does not deduplicate per node (DeepEP does: one IB copy per
    target node, at most min(k, M, nodes), then NVLink inside it; "DeepSeek-V3 Technical Report", arXiv 2412.19437,
    §3.2.2), so DeepSeek-V3's k=8 over 8+ nodes sends ~7 copies per token across nodes, not <= 4. Under tp each
    rank dispatches its 1/tp of the tokens."""
    token = compute_bytes * s * micro_batch * m.dim // max(tp, 1)  # each tp rank dispatches its 1/tp of the tokens
    dt, k = _dtype_name(compute_bytes), m.experts_per_token
    g = min(ep, max(nvlink_domain // max(tp, 1), 1)) if nvlink_domain > 0 else 1
    nodes = ep // g if ep % g == 0 else -(-ep // g)
    if m.moe_max_nodes <= 0 or nvlink_domain <= 0 or nodes <= 1:
        return [
            CommItem(
                "all_to_all", "ep", f"{dt} routed tokens (dispatch + combine)", n, int(n * k * _ring(ep) * token), ep
            )
        ]
    items = [
        CommItem(
            "all_to_all",
            "ep",
            f"{dt} routed tokens across nodes ({k} copies/token, <= {m.moe_max_nodes} nodes/token)",
            n,
            int(n * k * _ring(nodes) * token),
            ep,
        )
    ]
    if g > 1:  # one ep rank per node (g = 1) sends nothing inside it
        items.append(
            CommItem(
                "all_to_all",
                "ep_intra",
                f"{dt} routed tokens to experts in the node",
                n,
                int(n * k * _ring(g) / nodes * token),
                g,
            )
        )
    return items


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
