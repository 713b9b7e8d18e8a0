"""The hardware figures the step-time model uses, each with where it came from: measured by
`python -m jobs.calibrate` (the profile's `calibrated`, `matmul_tflops`, `collectives`), or derived
from the profile's cited peaks with a cited efficiency (below). And which mesh axes cross node and
pod boundaries, for our rank order and for Llama 3's.

Pure functions of a `ClusterConfig` and plain numbers; no torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from jobs.config import ClusterConfig

__all__ = [
    "OPS",
    "Link",
    "hops",
    "compute_dtype",
    "Hardware",
    "hardware",
    "axis_span",
    "axis_scope",
    "axis_ranks_per_node",
    "OUR_ORDER",
    "LLAMA3_ORDER",
    "MATMUL_EFFICIENCY",
    "MATMUL_EFFICIENCY_BY_GPU",
    "matmul_efficiency",
    "ATTENTION_SOURCE",
    "seq_share",
    "GEMM_SHAPE_SOURCE",
    "OPTIMIZER_STEP_BYTES",
    "NVLINK_EFFICIENCY",
    "COMM_SMS",
    "IB_EFFICIENCY",
    "NCCL_ALPHA_S",
    "PEAK_BF16_TFLOPS",
    "peak_bf16_tflops",
]

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

# Cited efficiencies for profiles that were not calibrated (published GPU clusters).
# Achieved bf16 GEMM per GPU model: Bekman, "ML Engineering", compute/accelerator, "Maximum Achievable Matmul FLOPS
# comparison table" (stas00/ml-engineering, BF16, mean of 100 iterations at the best shape): A100 SXM 271.2 of 312
# (86.9%, torch 2.6.0; 267.9 = 85.9% in its CUDA 12.1 edition), A100 PCIe 252.9 of 312 (81.1%), H100 SXM 794.5 of
# 989 (80.3%; 797.5 for torch bf16 8192^3 in zzc0721/torch-performance-test-data#79), GH200 828.6 of 989 (83.8%).
# Matched on the name torch reports, most specific first; a profile names its own as cluster.gpu_matmul_efficiency.
MATMUL_EFFICIENCY_BY_GPU: tuple[tuple[tuple[str, ...], float], ...] = (
    (("GH200",), 828.6 / 989.0),
    (("A100", "PCIE"), 252.9 / 312.0),
    (("A100",), 271.2 / 312.0),
    (("H100", "PCIE"), 0.0),  # not in the table
    (("H100", "NVL"), 0.0),
    (("H100",), 794.5 / 989.0),
)
# The H100 SXM line: what a profile without cluster.gpu_matmul_efficiency gets, said so in its source.
MATMUL_EFFICIENCY = 794.5 / 989.0
MATMUL_SOURCE = "Bekman ML Engineering, max achievable matmul table"


def matmul_efficiency(gpu_name: str) -> float:
    """The achieved share of the bf16 peak of a GPU by the name torch reports (MATMUL_EFFICIENCY_BY_GPU); 0.0 for
    one the table does not have."""
    name = gpu_name.upper()
    return next((e for keys, e in MATMUL_EFFICIENCY_BY_GPU if all(k.upper() in name for k in keys)), 0.0)


# NVLink: NCCL reaches ~370 GB/s bus bandwidth of the 450 GB/s line rate (~20% protocol overhead),
# NVIDIA's S. Jeaugey in NVIDIA/nccl-tests#212.
NVLINK_EFFICIENCY = 370.0 / 450.0
# InfiniBand NDR 400 Gb/s (50 GB/s): "you should see 46-48 GB/s per NIC", NVIDIA's D. Addison in NVIDIA/nccl-tests#290.
IB_EFFICIENCY = 47.0 / 50.0
# A ring collective spreads its channels over the NICs of the group's ranks on a node: "24GB/s is the peak
# performance per 200G NIC (12 GB/s for 100G NICs), so in your case [8 x 100G] 96GB/s is the target" (NVIDIA's
# S. Jeaugey, NVIDIA/nccl-tests#119); 45 GB/s with 4 GPUs per node against 90 with 8 on the same NICs
# (NVIDIA/nccl#1168); more NICs give more bandwidth "up to 160GB/s which is the NVLink intra-node bandwidth of
# your system" (S. Jeaugey, NVIDIA/nccl#412): a group with g ranks per node reaches g ranks' NICs, capped by the
# intra-node figure. An all-to-all "cannot aggregate the bandwidth of multiple NICs" (S. Jeaugey,
# NVIDIA/nccl-tests#267) and a send is one pair's: both stay at one rank's NIC share.
NIC_AGGREGATING = ("all_reduce", "all_gather", "reduce_scatter")
# Communication kernels beside compute: "only 20 SMs are sufficient to fully utilize the bandwidths of IB and
# NVLink" of the H800's 132 ("DeepSeek-V3 Technical Report", arXiv 2412.19437, §3.2.2): while a collective runs
# hidden behind compute, the compute has cluster.gpu_sms - 20 SMs, so it loses 20 / gpu_sms of that time.
COMM_SMS = 20
COMM_SMS_SOURCE = "20 SMs drive IB + NVLink (DeepSeek-V3 report §3.2.2) of cluster.gpu_sms"
# Memory-bound ops run at cluster.gpu_hbm_GBps, the datasheet's HBM bandwidth (jobs.planner.traffic).
HBM_SOURCE = (
    "cluster.gpu_hbm_GBps (datasheet HBM bandwidth; memory-bound ops' bytes from jobs.planner.traffic, "
    "FSDP2's copy-out and copy-in from torch's _fsdp_collectives.py)"
)
# Each GEMM shape at its share of the best shape's rate (jobs.planner.gemm.wave_efficiency) on cluster.gpu_sms SMs.
GEMM_SHAPE_SOURCE = (
    "tile and wave quantization at 256x128 tiles, one per SM a wave (NVIDIA Matrix Multiplication Background "
    "User's Guide), FLOP-weighted over the rank's GEMMs"
)
# Attention runs at cluster.gpu_attention_tflops beside the cited GEMM rate, times its share at the run's sequence
# length (cluster.gpu_attention_seq_share): FlashAttention-2's published causal head-dim-128 forward + backward rates
# by sequence length, the kernel behind SDPA's flash backend (each profile cites them); a calibrated rate holds
# attention already.
ATTENTION_SOURCE = (
    "cluster.gpu_attention_tflops x cluster.gpu_attention_seq_share at the sequence length (FlashAttention-2's "
    "published causal rates, SDPA's flash backend)"
)
# The step tail on a GPU without a calibrated figure: memory-bound, at cluster.gpu_hbm_GBps per local fp32 parameter.
# The gradient-norm pass reads each gradient (4 B; jobs/trainer.py scales the gradients only when the norm exceeds
# optim.max_norm); AdamW (torch.optim.AdamW, fused on CUDA) reads the parameter, gradient and both moments and writes
# the parameter and both moments (7 x 4 B). GB/s is bytes per ns: 32 / gpu_hbm_GBps ns per parameter.
OPTIMIZER_STEP_BYTES = 4 + 7 * 4
# Latency: 46-48 us for all-reduces of 4 B..1 KiB on 2 nodes x 8 GPUs (NVIDIA/nccl#1244, NCCL 2.21, NDR IB).
# Used for both scopes: no intra-node figure is cited, so the intra-node latency is an upper bound.
NCCL_ALPHA_S = 46e-6

# Dense (no 2:4 sparsity) bf16 tensor-core peak per GPU, matched on the name torch/NVML report ("NVIDIA H100
# 80GB HBM3", "NVIDIA H100 NVL", "NVIDIA H200", ...), most specific first. NVIDIA's product pages list bf16
# "with sparsity": halved here. H100 (nvidia.com/en-us/data-center/h100): SXM 1,979, NVL 1,671, PCIe 1,513
# -> 989 / 835 / 756 (torchtitan/tools/utils.py get_peak_flops has the same three). H200
# (nvidia.com/en-us/data-center/h200): SXM 1,979, NVL 1,671 -> 989 / 835; GH200 the H200 SXM's. H800: the
# H100's silicon with cut NVLink: SXM 989, PCIe 756. B200: 2.25 PFLOPS dense (NVIDIA Blackwell datasheet,
# torchtitan's 2.25e15); GB200 2.5 PFLOPS per GPU (GB200 NVL72: 180 PFLOPS dense bf16 / 72). A100
# (nvidia.com/en-us/data-center/a100): 312 dense, SXM and PCIe. L40S: 362 (L40S datasheet, 733 with sparsity).
PEAK_BF16_TFLOPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("GH200",), 989.0),
    (("H200", "NVL"), 835.0),
    (("H200",), 989.0),
    (("H100", "NVL"), 835.0),
    (("H100", "PCIe"), 756.0),
    (("H100",), 989.0),
    (("H800", "PCIe"), 756.0),
    (("H800",), 989.0),
    (("GB200",), 2500.0),
    (("B200",), 2250.0),
    (("A100",), 312.0),
    (("L40S",), 362.0),
)


def peak_bf16_tflops(gpu_name: str) -> float:
    """The dense bf16 peak of a GPU by the name torch reports; 0.0 for one not in the table (no MFU
    then, never a guess: `cluster.gpu_bf16_tflops` sets it by hand)."""
    name = gpu_name.upper()
    return next((t for keys, t in PEAK_BF16_TFLOPS if all(k.upper() in name for k in keys)), 0.0)


OUR_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # parallel/dims.py: row-major, tp innermost
# "The Llama 3 Herd of Models" §3.3.2: ranks grouped as [TP, CP, PP, DP], TP innermost, DP outermost.
LLAMA3_ORDER = ("dp_replicate", "dp_shard", "pp", "cp", "tp")


@dataclass(frozen=True, slots=True)
class Link:
    """The alpha-beta model of one collective on one scope: t = calls * alpha + bytes / bus bandwidth,
    with bytes as `arith.CommItem` counts them (what one rank sends: the nccl-tests bus-bandwidth convention)."""

    alpha_s: float
    bus_GBps: float
    source: str
    ranks: int = 0  # group size alpha was measured at; 0 = use alpha as is for every group size
    alpha_hop_s: float = 0.0  # latency of each ring hop more or less than at `ranks`
    per_node_rank: bool = False  # bus_GBps is one rank's NIC share: a group with g ranks per node drives g shares

    def seconds(self, *, calls: int, nbytes: float, op: str = "all_reduce", group: int = 0) -> float:
        """A ring's latency grows with its hops (Thakur, Rabenseifner & Gropp 2005): the calibrated
        alpha at `ranks` plus alpha_hop_s per hop more (or less) in a group of `group`."""
        alpha = self.alpha_s
        if self.ranks and group:
            alpha = max(0.0, alpha + self.alpha_hop_s * (hops(op, group) - hops(op, self.ranks)))
        return calls * alpha + (nbytes / (self.bus_GBps * 1e9) if self.bus_GBps > 0 else 0.0)


def hops(op: str, n: int) -> int:
    """Sequential steps of the ring algorithm for `op` among n ranks (1 for a point-to-point send)."""
    if op == "send_recv":
        return 1
    return max(1, (2 if op == "all_reduce" else 1) * (n - 1))


@dataclass(frozen=True, slots=True)
class Hardware:
    dtype: str  # compute dtype the matmul rate is for
    matmul_tflops: float  # achieved per rank
    matmul_source: str
    links: dict[str, Link] = field(default_factory=dict)  # "<op>.<intra|inter>"
    overlap: bool = True  # collectives can run beside compute
    overlap_why: str = ""
    node_ranks: int = 8  # ranks that share the fast fabric (scope "intra")
    pod_ranks: int = 0  # ranks under one non-blocking switch tier; 0 = not modelled
    optimizer_ns_per_param: float = 0.0  # the step tail (grad norm + AdamW) per local parameter; 0 = not modelled
    fsdp_unit_host_s: float = (
        0.0  # host time per FSDP unit per microbatch beyond its collectives, at this tp; 0 = not modelled
    )
    pp_action_host_s: float = 0.0  # host time per pipeline schedule action beyond compute and sends; 0 = not modelled
    bubble_cost: float = 1.0  # share of the pipeline bubble that is lost time (CPU ranks sharing cores: less)
    bubble_why: str = ""
    hbm_GBps: float = (
        0.0  # the memory-bound ops' rate (GPU datasheet); 0 = not modelled (a calibrated CPU rate holds them)
    )
    comm_sm_share: float = 0.0  # share of the compute a collective takes while hidden behind it; 0 = not modelled
    attention_tflops: float = 0.0  # the attention kernel's best rate (planner's count); 0 = attention at matmul_tflops
    attention_seq_share: tuple[tuple[int, float], ...] = ()  # (sequence length, share of attention_tflops); () = 1
    gemm_sms: int = 0  # SMs a GEMM's tile waves fill (gemm.wave_efficiency); 0 = every shape at matmul_tflops

    def attention_at(self, seq_len: int) -> float:
        """The attention kernel's rate at `seq_len` (planner's count): `attention_tflops` times its share at that
        length (`seq_share`); 0 when attention runs at the matmul rate."""
        return self.attention_tflops * seq_share(self.attention_seq_share, seq_len)

    def link(self, op: str, scope: str, *, ranks_per_node: int = 1) -> Link:
        """The link of `op` on `scope`; across nodes for a group with `ranks_per_node` ranks on each node, whose
        ring spreads over their NICs (NIC_AGGREGATING) up to the intra-node figure."""
        base = self.links[f"{op}.{'intra' if scope == 'intra' else 'inter'}"]
        if scope == "intra" or ranks_per_node <= 1 or not base.per_node_rank:
            return base
        cap = self.links[f"{op}.intra"].bus_GBps
        bus = min(base.bus_GBps * ranks_per_node, cap)
        why = f"{base.source}; x {ranks_per_node} ranks' NICs per node (nccl-tests#119, nccl#1168), cap intra {cap:.0f}"
        return Link(base.alpha_s, bus, why, base.ranks, base.alpha_hop_s)


def seq_share(table: tuple[tuple[int, float], ...], seq_len: int) -> float:
    """The share at `seq_len` of a (sequence length, share) table, linear in log2 of the length between its
    lengths, the nearest end's outside them; 1.0 for an empty table."""
    if not table:
        return 1.0
    pts = sorted(table)
    if seq_len <= pts[0][0]:
        return pts[0][1]
    for (s0, v0), (s1, v1) in zip(pts, pts[1:]):
        if seq_len <= s1:
            w = math.log2(seq_len / s0) / math.log2(s1 / s0)
            return v0 + w * (v1 - v0)
    return pts[-1][1]


def _seq_share_table(cl: ClusterConfig) -> tuple[tuple[int, float], ...]:
    """cluster.gpu_attention_seq_share as sorted (sequence length, share) pairs; () when null."""
    return tuple(sorted((int(k), float(v)) for k, v in (cl.gpu_attention_seq_share or {}).items()))


def _fsdp_unit_host_s(cl: ClusterConfig, tp: int) -> float:
    """The calibrated host time of one FSDP2 unit whose parameters are sharded over `tp` ranks; the nearest
    smaller tp's figure when this one was not timed (an underestimate: DTensor parameters cost more)."""
    timed = sorted((int(k.removeprefix("tp")), v) for k, v in cl.fsdp_unit_host_s.items())
    below = [v for t, v in timed if t <= tp]
    return float(below[-1]) if below else 0.0


def compute_bytes(cfg) -> int:
    """Bytes per gathered parameter and sent activation: the compute dtype's (train.mixed_precision)."""
    return 4 if compute_dtype(cfg.train.mixed_precision, gpus_per_node=cfg.cluster.gpus_per_node) == "fp32" else 2


def compute_dtype(mixed_precision: str, *, gpus_per_node: int) -> str:
    """The dtype the trainer computes in: train.mixed_precision, auto = bf16 on GPUs, fp32 on CPU ranks."""
    return mixed_precision if mixed_precision != "auto" else ("bf16" if gpus_per_node > 0 else "fp32")


def _published_links(cl: ClusterConfig) -> dict[str, Link]:
    if cl.intra_node_bw_achieved:  # the profile's figure was measured as achieved: the efficiency is in it already
        intra = Link(
            NCCL_ALPHA_S,
            cl.intra_node_bw_GBps,
            "cluster.intra_node_bw_GBps as achieved "
            "(cluster.intra_node_bw_achieved=true, no efficiency applied); alpha NVIDIA/nccl#1244",
        )
    else:
        intra = Link(
            NCCL_ALPHA_S,
            cl.intra_node_bw_GBps * NVLINK_EFFICIENCY,
            f"{NVLINK_EFFICIENCY:.2f} x cluster.intra_node_bw_GBps (NVIDIA/nccl-tests#212); alpha NVIDIA/nccl#1244",
        )
    share = cl.node_nics / max(cl.gpus_per_node, 1) if cl.node_nics > 0 else 1.0  # NICs per GPU
    nics = f" x cluster.node_nics({cl.node_nics}) / gpus_per_node" if cl.node_nics > 0 else ""
    inter = {
        op: Link(
            NCCL_ALPHA_S,
            cl.inter_node_bw_GBps * IB_EFFICIENCY * share,
            f"{IB_EFFICIENCY:.2f} x cluster.inter_node_bw_GBps{nics} (NVIDIA/nccl-tests#290); alpha NVIDIA/nccl#1244",
            per_node_rank=cl.node_nics > 0 and op in NIC_AGGREGATING,
        )
        for op in OPS
    }
    return {f"{op}.{scope}": (intra if scope == "intra" else inter[op]) for op in OPS for scope in ("intra", "inter")}


def _links(cl: ClusterConfig, calibrated: str) -> dict[str, Link] | None:
    """Every op's link on both scopes: calibrated where measured, cited otherwise; a scope the calibration could not
    reach (one node: no inter) borrows the other's figure. None when an op has no intra-node figure."""
    links = _published_links(cl) if cl.intra_node_bw_GBps > 0 else {}
    for key, v in cl.collectives.items():
        links[key] = Link(
            float(v["alpha_s"]),
            float(v["bus_GBps"]),
            calibrated,
            int(v.get("ranks", 0)),
            float(v.get("alpha_hop_s", 0.0)),
        )
    for op in OPS:
        for a, b in (("intra", "inter"), ("inter", "intra")):
            if f"{op}.{a}" not in links and f"{op}.{b}" in links:
                w = links[f"{op}.{b}"]
                links[f"{op}.{a}"] = Link(
                    w.alpha_s, w.bus_GBps, f"{w.source}; {a} not measured, {b} used", w.ranks, w.alpha_hop_s
                )
    return links if all(f"{op}.intra" in links for op in OPS) else None


def hardware(cl: ClusterConfig, *, dtype: str, tasks_per_node: int, tp: int = 1) -> Hardware | None:
    """The figures for `cl`: calibrated where the profile has them, cited otherwise; None when the
    profile has neither (no time estimate). A calibrated rate at one tp rank's shapes
    (`matmul_tflops["<dtype>.tp<tp>"]`) is preferred to the unsharded one."""
    calibrated = f"calibrated ({cl.calibrated})" if cl.calibrated else "calibrated"
    key = f"{dtype}.tp{tp}" if cl.matmul_tflops.get(f"{dtype}.tp{tp}") else dtype
    attention = 0.0  # a calibrated rate was timed on the whole model, attention included
    gemm_sms = 0  # and on the model's own GEMM shapes
    if cl.matmul_tflops.get(key):
        rate, source = cl.matmul_tflops[key], f"cluster.matmul_tflops.{key} {calibrated}"
    elif cl.gpu_bf16_tflops > 0 and dtype == "bf16":
        eff = cl.gpu_matmul_efficiency or MATMUL_EFFICIENCY
        whose = "cluster.gpu_matmul_efficiency" if cl.gpu_matmul_efficiency else "the H100 SXM's (profile sets none)"
        rate = cl.gpu_bf16_tflops * eff
        source = f"{eff:.3f} ({whose}) x cluster.gpu_bf16_tflops (achieved bf16 GEMM: {MATMUL_SOURCE})"
        attention, gemm_sms = cl.gpu_attention_tflops, cl.gpu_sms
    else:
        return None
    links = _links(cl, calibrated)
    if links is None:
        return None
    gpu = cl.gpus_per_node > 0
    cores = os.cpu_count() or 1
    over = 0.0 if gpu else max(0.0, tasks_per_node / cores - 1.0)
    return Hardware(
        dtype=dtype,
        matmul_tflops=rate,
        matmul_source=source,
        links=links,
        overlap=gpu,
        overlap_why=(
            "GPU: NCCL kernels run on their own stream beside compute"
            if gpu
            else "CPU ranks: gloo runs on the same cores as the compute, nothing overlaps"
        ),
        node_ranks=max(cl.nvlink_domain, 1) if gpu else max(tasks_per_node, 1),
        pod_ranks=cl.pod_gpus,
        optimizer_ns_per_param=cl.optimizer_ns_per_param
        or (OPTIMIZER_STEP_BYTES / cl.gpu_hbm_GBps if gpu and cl.gpu_hbm_GBps > 0 else 0.0),
        fsdp_unit_host_s=_fsdp_unit_host_s(cl, tp),
        pp_action_host_s=cl.pp_action_host_s,
        hbm_GBps=cl.gpu_hbm_GBps if gpu else 0.0,
        comm_sm_share=COMM_SMS / cl.gpu_sms if gpu and cl.gpu_sms > COMM_SMS else 0.0,
        attention_tflops=attention if gpu else 0.0,
        attention_seq_share=_seq_share_table(cl),
        gemm_sms=gemm_sms if gpu else 0,
        bubble_cost=max(0.0, 1.0 - over),
        bubble_why=(
            ""
            if not over
            else f"{tasks_per_node} CPU ranks share {cores} cores: a rank idle in the bubble "
            f"gives its core to another, so {max(0.0, 1.0 - over):.0%} of the bubble is lost time"
        ),
    )


def axis_span(axis: str, shape: dict[str, int], order: tuple[str, ...] = OUR_ORDER) -> int:
    """Consecutive ranks one group of `axis` spans: its size times the sizes of every axis inner to
    it in `order` (outermost first). ep is carved out of dp_shard * cp, innermost first (as torchtitan);
    dp_shard*cp and dp_shard/ep groups span all of dp_shard * cp."""
    if axis == "ep":
        return shape.get("ep", 1) * shape.get("tp", 1)
    base = "dp_shard" if axis.startswith("dp_shard") else axis
    i = order.index(base)
    return shape.get(base, 1) * math.prod(shape.get(a, 1) for a in order[i + 1 :])


def axis_ranks_per_node(axis: str, shape: dict[str, int], *, group: int, node_ranks: int) -> int:
    """Ranks of one `group`-rank group of `axis` on each node it spans: a row-major group strided by the inner
    axes, so node_ranks / stride of them share a node (1 when the stride is a node or more)."""
    if axis == "ep_intra":  # inside one node by construction
        return group
    span = axis_span(axis, shape)
    return max(1, min(group, group * max(node_ranks, 1) // max(span, 1)))


def axis_scope(
    axis: str, shape: dict[str, int], *, node_ranks: int, pod_ranks: int = 0, order: tuple[str, ...] = OUR_ORDER
) -> str:
    """ "intra" when one group of `axis` fits in the fast domain, "inter" when it crosses nodes,
    "inter-pod" when it also crosses pods (only when the profile sets cluster.pod_gpus). `ep_intra` is
    node-limited routing's forwarding leg inside the node (arith._ep_items): intra by construction."""
    if axis == "ep_intra":
        return "intra"
    span = axis_span(axis, shape, order)
    if span <= max(node_ranks, 1):
        return "intra"
    if pod_ranks and span > pod_ranks:
        return "inter-pod"
    return "inter"
