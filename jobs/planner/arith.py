"""The planner's arithmetic: parameters, memory per rank, activations, communication, bubble, checkpoint cost,
in three rooms, one import: `params` (parameters, head dims, FLOPs, bytes per state), `memory` (pipeline
in-flight and bubble, activations, memory per rank, checkpoint bytes), `comm` (collectives per step).

Pure functions of plain numbers and `ModelConfig`; no torch, no Hydra, no I/O. `jobs.planner.gate` composes
them into a plan and checks it against a cluster profile; the tests pin them to published figures.
Conventions: bytes are bytes (GiB = 2**30 only when printed), bandwidths are GB/s = 1e9 bytes/s per
GPU per direction, times are seconds. Training precision is the one the recipe targets: fp32 sharded
parameters, gradients and AdamW moments (16 bytes/parameter in all), bf16 compute (activations,
all-gathered parameters), fp32 gradient reduction.
"""

from __future__ import annotations

from jobs.planner.comm import (
    CommItem,
    axis_spans_nodes,
    comm_per_step,
)
from jobs.planner.memory import (
    RankMemory,
    StageShape,
    activation_bytes,
    autocast_copy_bytes,
    bubble_fraction,
    checkpoint_bytes,
    checkpointed_layer_bytes,
    checkpointed_layers,
    heuristic_bytes_per_rank,
    layer_activation_bytes,
    layers_in_flight,
    logits_bytes,
    rank_memory,
    shard_elems,
    stage_elems,
)
from jobs.planner.params import (
    COMPUTE_BYTES,
    GRAD_BYTES,
    HEURISTIC_BYTES_PER_PARAM,
    OPTIM_BYTES,
    PARAM_BYTES,
    REDUCE_BYTES,
    BlockParams,
    ParamCount,
    attention_head_dims,
    block_params,
    count_params,
    flops_per_token,
    kv_bytes_per_token,
)

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
    "autocast_copy_bytes",
    "PARAM_BYTES",
    "GRAD_BYTES",
    "OPTIM_BYTES",
    "COMPUTE_BYTES",
    "REDUCE_BYTES",
    "HEURISTIC_BYTES_PER_PARAM",
]
