"""`parallelize()`: the ordered recipe that turns one meta-device model into this rank's model parts."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.ac import apply_ac
from parallel.compile import apply_compile
from parallel.cp import apply_cp
from parallel.dims import ParallelDims
from parallel.ep import apply_ep, apply_expert_fsdp
from parallel.fsdp import apply_fsdp
from parallel.pipeline import layer_ranges, split_stage, stage_ids
from parallel.precision import apply_autocast, fsdp_policy
from parallel.tp import apply_tp

__all__ = ["parallelize"]


def parallelize(
    model: nn.Module,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh,
    stages_per_rank: int,
    pp_schedule: str,
    sequence_parallel: bool,
    loss_parallel: bool,
    fsdp_per_block: bool = True,
    activation_checkpointing: str = "none",
    ac_every: int = 2,
    pp_layers_per_stage: list[int] | tuple[int, ...] | None = None,
    compile: bool = False,
    compile_backend: str = "inductor",
    mixed_precision: str = "fp32",
    cp_impl: str = "allgather",
    seq_len: int = 0,
    ep_mesh: DeviceMesh | None = None,
) -> tuple[list[nn.Module], list[int]]:
    """Returns (parts, stage ids): the model parts this rank holds, each sharded, still on `model`'s device.

    The order is fixed, for these reasons:
      1. pipeline split first, so no rank builds or shards layers it does not own
         (`pp_layers_per_stage` blocks per stage; None = balanced by cost);
      1b. context parallel (`cp_impl`, with cp > 1): attention layers attend across the cp axis and RoPE
         takes this rank's zig-zag positions of a `seq_len` sample (parallel/cp.py); it changes no
         parameter, so it comes before TP, which only sees the heads of the local chunks;
      2. tensor parallel next: it turns parameters into DTensors on the tp axis;
      3. activation checkpointing (`parallel.ac`) after TP, so a recomputed block replays its TP
         collectives, and before FSDP2, so FSDP's hooks wrap the checkpointed block (as torchtitan);
      4. torch.compile per block (`compile`, with `compile_backend`), after TP and AC, before FSDP (torchtitan's order):
         FSDP2 then wraps compiled blocks (no graph breaks or recompiles measured on CPU), and the
         blocks share one compiled graph;
      5. FSDP2 last, over dp_shard (dp_shard * cp with context parallel; and dp_replicate for HSDP): it shards the (TP-)parameters further.
         FSDP before TP fails (`Cannot distribute a DTensor ... to a different device mesh`).
         `mixed_precision=bf16` rides on it as FSDP2's MixedPrecisionPolicy; parts FSDP does not wrap
         (dp = 1) get bf16 autocast around their forward instead (parallel/precision.py).
    With mesh.ep > 1 (`ep_mesh`, ParallelDims.build_ep_mesh), expert parallelism comes after TP (which splits
    each routed expert's hidden dim over tp, etp = tp: EP then shards whole experts over ep on the MoE mesh's
    (ep, tp) axes) and the routed experts get their own FSDP over the expert-data-parallel axis before the
    blocks are wrapped (parallel/ep.py).
    Model code never changes; every step works on a meta-device model (no memory is touched).
    """
    stages, parts = _pipeline_parts(
        model,
        dims=dims,
        mesh=mesh,
        stages_per_rank=stages_per_rank,
        pp_schedule=pp_schedule,
        pp_layers_per_stage=pp_layers_per_stage,
    )
    rank_layers = [int(k) for part in parts for k in part.layers.keys()]  # selective AC counts over all of them
    for part in parts:
        _shard_part(
            part,
            dims=dims,
            mesh=mesh,
            ep_mesh=ep_mesh,
            rank_layers=rank_layers,
            cp_impl=cp_impl,
            seq_len=seq_len,
            sequence_parallel=sequence_parallel,
            loss_parallel=loss_parallel,
            activation_checkpointing=activation_checkpointing,
            ac_every=ac_every,
            compile=compile,
            compile_backend=compile_backend,
            fsdp_per_block=fsdp_per_block,
            mixed_precision=mixed_precision,
        )
    return parts, stages


def _pipeline_parts(
    model: nn.Module,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh,
    stages_per_rank: int,
    pp_schedule: str,
    pp_layers_per_stage,
) -> tuple[list[int], list[nn.Module]]:
    """(stage ids, parts) this rank holds: its pipeline stages split off `model`, or the whole model without pp."""
    if dims.pp == 1:
        return [0], [model]
    num_stages = dims.pp * stages_per_rank
    stages = stage_ids(mesh["pp"].get_local_rank(), dims.pp, stages_per_rank, pp_schedule)
    ranges = layer_ranges(len(model.layers), num_stages, layers_per_stage=pp_layers_per_stage)
    return stages, [split_stage(model, s, ranges) for s in stages]


def _shard_part(
    part: nn.Module,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh,
    ep_mesh: DeviceMesh | None,
    rank_layers: list[int],
    cp_impl: str,
    seq_len: int,
    sequence_parallel: bool,
    loss_parallel: bool,
    activation_checkpointing: str,
    ac_every: int,
    compile: bool,
    compile_backend: str,
    fsdp_per_block: bool,
    mixed_precision: str,
) -> None:
    """Steps 1b-5 of `parallelize` on one part, in that order."""
    if dims.cp_enabled:
        apply_cp(part, mesh["cp"], impl=cp_impl, seq_len=seq_len)
    if dims.tp_enabled:
        apply_tp(part, mesh["tp"], sequence_parallel=sequence_parallel, loss_parallel=loss_parallel)
    apply_ac(part, mode=activation_checkpointing, every=ac_every, rank_layers=rank_layers)
    if ep_mesh is not None:
        apply_ep(part, ep_mesh[("ep", "tp")] if dims.tp_enabled else ep_mesh["ep"])
    if compile:
        apply_compile(part, backend=compile_backend)
    experts_unwrapped = None
    if (
        ep_mesh is not None
    ):  # experts: HSDP over (dp_replicate, edp) like the dense weights over (dp_replicate, dp_shard)
        edp_mesh = ep_mesh[("dp_replicate", "edp")] if dims.hsdp_enabled else ep_mesh["edp"]
        experts_unwrapped = apply_expert_fsdp(
            part,
            edp_mesh,
            dp=dims.dp * dims.cp,
            reshard_after_forward=not dims.pp_enabled,
            mp_policy=fsdp_policy(mixed_precision),
        )
    if dims.fsdp_enabled:
        apply_fsdp(
            part,
            dims.fsdp_mesh(mesh),
            reshard_after_forward=not dims.pp_enabled,
            per_block=fsdp_per_block,
            mp_policy=fsdp_policy(mixed_precision),
            ignored_params=experts_unwrapped,
        )
    elif mixed_precision == "bf16":
        apply_autocast(part, device_type=mesh.device_type)
