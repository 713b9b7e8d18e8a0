"""The `mesh` config group: parallelism degrees and the pipeline schedule (plain dataclass, no Hydra)."""

from __future__ import annotations

from dataclasses import dataclass

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv_zero_bubble")
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b", "zbv_zero_bubble")
AC_MODES = ("none", "selective", "full")  # train.activation_checkpointing
CP_IMPLS = ("allgather", "ring")  # mesh.cp_impl (parallel/cp.py)


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
