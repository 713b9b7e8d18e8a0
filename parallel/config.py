"""The `mesh` config group: parallelism degrees and the pipeline schedule (plain dataclass, no Hydra)."""

from __future__ import annotations

from dataclasses import dataclass

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv_zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zbv_zero_bubble")
AC_MODES = ("none", "selective", "full")  # train.activation_checkpointing
CP_IMPLS = ("allgather", "ring")  # mesh.cp_impl (parallel/cp.py)
RING_KERNEL_NAMES = ("flash_cpu", "flash", "efficient")  # the ring's fused per-block kernels (parallel.cp.RING_KERNELS)


def cp_shape_error(*, seq_len: int, cp: int, tp: int, sequence_parallel: bool) -> str | None:
    """Why a sequence of `seq_len` cannot be cut for context parallel (parallel/cp.py: 2*cp equal zig-zag chunks
    per sample, Llama 3 §3.3.2; sequence parallel inside a cp rank's share), naming the fix; None when it can.
    One rule for the trainer's validation and the planner."""
    if cp > 1 and seq_len % (2 * cp):
        return (
            f"train.seq_len({seq_len}) % (2 * mesh.cp({cp})) = {seq_len % (2 * cp)} != 0: context parallel cuts "
            "each sample into 2*cp equal zig-zag chunks; change train.seq_len or mesh.cp"
        )
    if cp > 1 and tp > 1 and sequence_parallel and (seq_len // cp) % tp:
        return (
            f"train.seq_len({seq_len}) / mesh.cp({cp}) = {seq_len // cp} is not divisible by mesh.tp({tp}) with "
            "mesh.sequence_parallel=true; change train.seq_len or set mesh.sequence_parallel=false"
        )
    return None


def checkpointed_layers(layers: list[int], *, mode: str, every: int) -> list[int]:
    """The global layer indices among `layers` whose block is checkpointed under `mode` (torch-free:
    the planner and validation use it without importing torch; `parallel.ac` applies it). Selective
    counts position in `layers`, the blocks one rank holds in order (all its pipeline stages): every
    `every`-th of them. Counting the global index instead checkpointed all of a rank whose interleaved
    1-layer chunks share a parity (Llama 3 405B: rank r holds layers r, r+16, ...) and none of the next."""
    if mode not in AC_MODES:
        raise ValueError(f"train.activation_checkpointing={mode!r} is not one of {', '.join(AC_MODES)}")
    if mode == "none":
        return []
    if mode == "full":
        return list(layers)
    if every < 1:
        raise ValueError(f"train.ac_every({every}) must be >= 1 with train.activation_checkpointing=selective")
    return [i for j, i in enumerate(layers) if (j + 1) % every == 0]


@dataclass
class MeshConfig:
    pp: int = 1  # pipeline-parallel degree (stages across ranks)
    dp_replicate: int = 1  # data-parallel replicas (HSDP outer axis; DDP-like)
    dp_shard: int = -1  # FSDP2 sharding degree; -1 = the ranks left after the other axes
    cp: int = 1  # context-parallel degree: each rank holds 2 of the sequence's 2*cp zig-zag chunks (parallel/cp.py)
    tp: int = 1  # tensor-parallel degree
    ep: int = 1  # expert-parallel degree: MoE experts sharded over ep ranks within dp_shard * cp (parallel/ep.py)
    pp_schedule: str = "1f1b"  # one of gpipe, 1f1b, interleaved_1f1b, zbv_zero_bubble
    pp_microbatches: int = -1  # microbatches per step per dp rank; -1 = global_batch / (dp * micro_batch)
    pp_stages_per_rank: int = -1  # virtual stages per pp rank; -1 = 1, or 2 for multi-stage schedules
    pp_layers_per_stage: list[int] | None = (
        None  # blocks per stage, in stage order (pp * stages per rank entries); None = balanced by cost
    )
    cp_impl: str = "allgather"  # attention across cp ranks: allgather (K/V all-gathered) or ring (K/V passed around)
    sequence_parallel: bool = True  # shard norms/activations along the sequence dim across tp
    loss_parallel: bool = True  # compute the loss on vocab-sharded logits (no all-gather of logits)


def ring_kernel(device_type: str, dtype: str, head_dim: int, *, capability: tuple[int, int] = (8, 0)) -> str:
    """The ring's per-block kernel (parallel/cp.py) for operands of torch dtype `dtype` ("bfloat16", "float32", ...):
    one of RING_KERNEL_NAMES, or "unfused" (`_ring_autograd`: each block's fp32 score matrix, autograd's backward).
    CPU: torch's flash kernel. CUDA: flash in fp16/bf16 with head dims up to 256 on sm80+ (FlashAttention-2's limits,
    as SDPA's own choice), else the memory-efficient kernel (fp32 included); both want head dims that are multiples
    of 8 (SDPA pads the others; the ring does not)."""
    if device_type == "cpu":
        return "flash_cpu"
    if device_type != "cuda" or head_dim % 8:
        return "unfused"
    if dtype in ("float16", "bfloat16") and head_dim <= 256 and capability >= (8, 0):
        return "flash"
    return "efficient"


def ring_kernel_note(*, fp32: bool, head_dim: int) -> str:
    """What the ring runs per block on a GPU (sm80+) with these operands, for the planner's notes: flash, or what
    runs instead and what that costs beyond the plan (which prices flash attention's rate and no score matrix)."""
    kernel = ring_kernel("cuda", "float32" if fp32 else "bfloat16", head_dim)
    if kernel == "flash":
        return "the ring's blocks run flash attention on CUDA"
    if kernel == "efficient":
        return "the ring's blocks are NOT flash on CUDA: the memory-efficient kernel (fp32 or a head dim > 256), slower"
    return (
        f"the ring's blocks are NOT flash on CUDA: head dim {head_dim} is not a multiple of 8, so each block keeps "
        "its fp32 score matrix, O((seq/cp)^2) memory the plan does not count"
    )
