"""Validation of a composed config before any process starts: every error names the override and the fix.

The same `validate()` runs on the login node before submit and on every rank at start.
"""

from __future__ import annotations

from dataclasses import dataclass

from checkpoint.config import replicas_for
from checkpoint.tiers import failure_split
from jobs.config import NORM_KERNELS, SDPA_BACKENDS, FailureConfig, JobConfig
from jobs.device import (
    DEVICES,
    MIXED_PRECISIONS,
    compile_backends,
    resolve_device,
    resolve_mixed_precision,
    visible_gpus,
)
from jobs.failure.signals import parse_signals
from jobs.failure.spike import check_config as check_spike
from jobs.failure.spike import check_retention
from jobs.planner.params import attention_head_dims
from jobs.telemetry.stragglers import WINDOW_STEPS
from jobs.telemetry.tensorboard import check_tensorboard
from parallel.config import CP_IMPLS, MULTI_STAGE_SCHEDULES, checkpointed_layers, cp_shape_error
from parallel.dims import ParallelDims, stages_per_rank
from parallel.pipeline import balanced_layers_per_stage, check_layers_per_stage

__all__ = ["validate", "check_device", "Derived", "checkpoint_wait_s", "check_checkpoint_timeout", "stop_path_s"]


@dataclass(frozen=True, slots=True)
class Derived:
    """Quantities that follow from a valid config (logged once at start)."""

    dims: ParallelDims
    microbatches: int  # microbatches per step per dp rank (pipeline microbatches, or accumulation steps)
    stages_per_rank: int  # virtual pipeline stages held by each pp rank
    num_stages: int  # pipeline stages in total
    tokens_per_step: int  # global_batch * seq_len
    pp_layers_per_stage: tuple[
        int, ...
    ] = ()  # blocks per pipeline stage (mesh.pp_layers_per_stage or balanced); () without pp


def validate(cfg: JobConfig, *, training: bool = True) -> Derived:
    """Raises ValueError naming the dotted override and the arithmetic; returns the derived quantities.

    `training=False` (the planner) accepts what is planned but not trained (MLA with mesh.tp > 1)."""
    t, mesh, ln = cfg.train, cfg.mesh, cfg.launcher
    if ln.nodes < 1 or ln.tasks_per_node < 1:
        raise ValueError(f"launcher.nodes({ln.nodes}) and launcher.tasks_per_node({ln.tasks_per_node}) must be >= 1")
    if ln.spare_nodes < 0 or ln.spare_nodes and ln.name != "slurm":
        raise ValueError(
            f"launcher.spare_nodes({ln.spare_nodes}) must be >= 0, and 0 unless launcher=slurm (spare nodes "
            f"are held in a Slurm allocation): set launcher.spare_nodes=0"
        )
    dims = ParallelDims.from_config(mesh, world_size=cfg.world_size, world_size_expr=cfg.world_size_expr)

    _check_model(cfg, dims)
    _check_cp(cfg, dims)
    _check_moe(cfg, dims)
    if training:
        _check_mla(cfg, dims)
    spr, num_stages, split = _check_pipeline(cfg, dims)
    microbatches = _check_batch(cfg, dims)

    for name, value in (("train.steps", t.steps), ("train.log_every", t.log_every)):
        if value < 1:
            raise ValueError(f"{name}({value}) must be >= 1")
    _check_eval(cfg, dims)
    if t.device not in DEVICES:
        raise ValueError(f"train.device={t.device!r} is not one of {', '.join(DEVICES)}")
    if t.mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"train.mixed_precision={t.mixed_precision!r} is not one of {', '.join(MIXED_PRECISIONS)}")
    _check_failure(cfg)
    _check_metrics(cfg)
    # the RAM tier's partner copies need another node (checkpoint/partner.py; the ranks check the real nodes again)
    replicas_for(cfg.checkpoint.memory_replicas, nodes=ln.nodes, memory_on=cfg.checkpoint.memory_on)
    _check_compile(cfg, dims)
    return Derived(
        dims=dims,
        microbatches=microbatches,
        stages_per_rank=spr if dims.pp > 1 else 1,
        num_stages=num_stages,
        tokens_per_step=t.global_batch * t.seq_len,
        pp_layers_per_stage=split,
    )


def _check_model(cfg: JobConfig, dims: ParallelDims) -> None:
    """The model's shapes against the tp degree, the sequence and activation checkpointing."""
    m, t, mesh = cfg.model, cfg.train, cfg.mesh
    if m.dim % m.n_heads:
        raise ValueError(f"model.dim({m.dim}) % model.n_heads({m.n_heads}) = {m.dim % m.n_heads} != 0")
    if m.n_heads % m.n_kv_heads:
        raise ValueError(
            f"model.n_heads({m.n_heads}) % model.n_kv_heads({m.n_kv_heads}) != 0: query heads must group evenly"
        )
    if m.n_heads % dims.tp:
        raise ValueError(
            f"model.n_heads({m.n_heads}) % mesh.tp({dims.tp}) = {m.n_heads % dims.tp} != 0: "
            "each tp rank needs whole heads; pick mesh.tp dividing the head count"
        )
    if m.n_kv_heads % dims.tp:
        raise ValueError(
            f"model.n_kv_heads({m.n_kv_heads}) % mesh.tp({dims.tp}) = {m.n_kv_heads % dims.tp} != 0: "
            "each tp rank needs whole key/value heads; pick mesh.tp dividing the KV head count"
        )
    if m.ffn_dim % dims.tp:
        raise ValueError(f"model.ffn_dim({m.ffn_dim}) % mesh.tp({dims.tp}) != 0")
    if m.vocab_size % dims.tp and mesh.loss_parallel and dims.tp > 1:
        raise ValueError(
            f"model.vocab_size({m.vocab_size}) % mesh.tp({dims.tp}) != 0 with mesh.loss_parallel=true; "
            "pad the vocabulary or set mesh.loss_parallel=false"
        )
    if m.sdpa_backend not in SDPA_BACKENDS:
        raise ValueError(
            f"model.sdpa_backend={m.sdpa_backend!r} is not one of {', '.join(SDPA_BACKENDS)}: set "
            "model.sdpa_backend=auto (torch picks a fused kernel) or math (the scores materialised)"
        )
    if m.norm_kernel not in NORM_KERNELS:
        raise ValueError(
            f"model.norm_kernel={m.norm_kernel!r} is not one of {', '.join(NORM_KERNELS)}: set "
            "model.norm_kernel=eager (our RMSNorm's elementwise ops) or fused (F.rms_norm's fused kernel)"
        )
    checkpointed_layers([], mode=t.activation_checkpointing, every=t.ac_every)  # raises naming train.*
    if t.seq_len > m.max_seq_len:
        raise ValueError(f"train.seq_len({t.seq_len}) > model.max_seq_len({m.max_seq_len})")
    if dims.tp > 1 and mesh.sequence_parallel and t.seq_len % dims.tp:
        raise ValueError(
            f"train.seq_len({t.seq_len}) % mesh.tp({dims.tp}) != 0 with mesh.sequence_parallel=true; "
            "make the sequence divisible or set mesh.sequence_parallel=false"
        )


def _check_cp(cfg: JobConfig, dims: ParallelDims) -> None:
    """Context parallel (parallel/cp.py): 2*cp equal chunks per sample, sequence parallel inside a cp rank's share."""
    t, mesh = cfg.train, cfg.mesh
    if mesh.cp_impl not in CP_IMPLS:
        raise ValueError(f"mesh.cp_impl={mesh.cp_impl!r} is not one of {', '.join(CP_IMPLS)}")
    if dims.cp == 1:
        return
    if cfg.model.sdpa_backend == "math":
        raise ValueError(
            f"model.sdpa_backend=math with mesh.cp({dims.cp}) > 1: context parallel runs its own attention kernels "
            "(parallel/cp.py), not the math backend; set model.sdpa_backend=auto or mesh.cp=1"
        )
    error = cp_shape_error(seq_len=t.seq_len, cp=dims.cp, tp=dims.tp, sequence_parallel=mesh.sequence_parallel)
    if error:
        raise ValueError(error)
    if t.compile:
        raise ValueError(
            f"train.compile=true with mesh.cp({dims.cp}) > 1: the cp attention's collectives are not "
            "compiled (untested); set train.compile=false or mesh.cp=1"
        )


def _check_moe(cfg: JobConfig, dims: ParallelDims) -> None:
    """The MoE keys (jobs/models/moe.py) and expert parallelism against them."""
    m = cfg.model
    if m.n_routed_experts <= 0:
        if dims.ep > 1:
            raise ValueError(
                f"mesh.ep({dims.ep}) > 1 but model.n_routed_experts({m.n_routed_experts}) = 0: a dense "
                "model has no experts to shard; set mesh.ep=1 or pick an MoE model (model=tiny_moe)"
            )
        return
    if m.n_routed_experts % dims.ep:
        raise ValueError(
            f"model.n_routed_experts({m.n_routed_experts}) % mesh.ep({dims.ep}) != 0: each ep rank needs whole experts"
        )
    if m.moe_score_func not in ("softmax", "sigmoid"):
        raise ValueError(f"model.moe_score_func={m.moe_score_func!r} is not one of softmax, sigmoid")
    groups = max(m.moe_groups, 1)
    if m.n_routed_experts % groups:
        raise ValueError(
            f"model.n_routed_experts({m.n_routed_experts}) % model.moe_groups({groups}) != 0: "
            "the node limit counts equal groups of experts"
        )
    allowed = m.n_routed_experts // groups * (m.moe_max_nodes if 0 < m.moe_max_nodes < groups else groups)
    if not 0 < m.experts_per_token <= allowed:
        raise ValueError(
            f"model.experts_per_token({m.experts_per_token}) must be in 1..{allowed}: the experts of "
            f"model.moe_max_nodes({m.moe_max_nodes}) of model.moe_groups({groups}) groups"
        )
    if m.moe_ffn_dim <= 0:
        raise ValueError(f"model.moe_ffn_dim({m.moe_ffn_dim}) must be > 0 with model.n_routed_experts > 0")
    if m.moe_ffn_dim % dims.tp:  # the routed and shared experts' hidden dim is split over tp (etp = tp, parallel/tp.py)
        raise ValueError(
            f"model.moe_ffn_dim({m.moe_ffn_dim}) % mesh.tp({dims.tp}) != 0: the experts' hidden dim is "
            "split over the tp ranks (etp = tp); pick mesh.tp dividing model.moe_ffn_dim"
        )
    local_seq = cfg.train.seq_len // dims.cp
    if dims.tp > 1 and local_seq % dims.tp:  # the MoE blocks' tokens are split over tp (parallel/tp.py), SP or not
        raise ValueError(
            f"train.seq_len({cfg.train.seq_len}) / mesh.cp({dims.cp}) = {local_seq} is not divisible by mesh.tp"
            f"({dims.tp}): each tp rank routes and dispatches its own chunk of an MoE block's tokens; change "
            "train.seq_len or mesh.tp"
        )


def _check_mla(cfg: JobConfig, dims: ParallelDims) -> None:
    """Multi-head latent attention (jobs/models/mla.py) as trained: its dims set, no tp or cp of it yet."""
    m = cfg.model
    if m.attention not in ("gqa", "mla"):
        raise ValueError(f"model.attention={m.attention!r} is not one of gqa, mla")
    if m.attention != "mla":
        return
    attention_head_dims(m)  # raises naming the MLA dims that are not set
    for axis in ("tp", "cp"):
        if getattr(dims, axis) > 1:
            raise ValueError(
                f"mesh.{axis}({getattr(dims, axis)}) > 1 with model.attention=mla: {axis} of latent "
                f"attention is not built yet (planned only: jobs.plan); set mesh.{axis}=1"
            )


def _check_pipeline(cfg: JobConfig, dims: ParallelDims) -> tuple[int, int, tuple[int, ...] | None]:
    """The schedule's stages per rank and the layer split: (stages per rank, stages, blocks per stage)."""
    m, mesh = cfg.model, cfg.mesh
    spr = stages_per_rank(mesh)
    multi = mesh.pp_schedule in MULTI_STAGE_SCHEDULES
    if dims.pp > 1 and multi and spr < 2:
        raise ValueError(f"mesh.pp_schedule={mesh.pp_schedule} needs mesh.pp_stages_per_rank >= 2, got {spr}")
    if dims.pp > 1 and not multi and spr != 1:
        raise ValueError(
            f"mesh.pp_schedule={mesh.pp_schedule} runs one stage per rank; mesh.pp_stages_per_rank({spr}) "
            "must be 1 (or use interleaved_1f1b / zbv_zero_bubble)"
        )
    if mesh.pp_schedule == "zbv_zero_bubble" and dims.pp > 1 and spr != 2:
        raise ValueError(f"mesh.pp_schedule=zbv_zero_bubble needs exactly 2 stages per rank, got {spr}")
    num_stages = dims.pp * spr if dims.pp > 1 else 1
    split = _layers_per_stage(cfg, dims, spr)
    if m.n_layers < num_stages and not split:
        raise ValueError(
            f"model.n_layers({m.n_layers}) < pipeline stages mesh.pp({dims.pp}) * stages per rank({spr}) "
            f"= {num_stages}: every stage needs at least one layer (or set mesh.pp_layers_per_stage)"
        )
    if dims.pp > 1 and not split:
        split = tuple(balanced_layers_per_stage(m.n_layers, num_stages))
    return spr, num_stages, split


def _check_batch(cfg: JobConfig, dims: ParallelDims) -> int:
    """The global batch against dp, the micro batch and the pipeline; returns the microbatches per step."""
    t, mesh = cfg.train, cfg.mesh
    multi = mesh.pp_schedule in MULTI_STAGE_SCHEDULES
    per_mb = dims.dp * t.micro_batch
    if t.micro_batch < 1 or t.global_batch < 1:
        raise ValueError(f"train.global_batch({t.global_batch}) and train.micro_batch({t.micro_batch}) must be >= 1")
    if t.global_batch % per_mb:
        raise ValueError(
            f"train.global_batch({t.global_batch}) is not a multiple of dp({dims.dp}) * "
            f"train.micro_batch({t.micro_batch}) = {per_mb}; dp = mesh.dp_replicate({dims.dp_replicate}) * "
            f"mesh.dp_shard({dims.dp_shard})"
        )
    microbatches = t.global_batch // per_mb
    if mesh.pp_microbatches not in (-1, microbatches):
        raise ValueError(
            f"train.global_batch({t.global_batch}) != dp({dims.dp}) * train.micro_batch({t.micro_batch}) * "
            f"mesh.pp_microbatches({mesh.pp_microbatches}) = {per_mb * mesh.pp_microbatches}; "
            f"set mesh.pp_microbatches={microbatches} (or -1 to derive it)"
        )
    if dims.pp > 1 and microbatches < dims.pp:
        raise ValueError(
            f"pipeline microbatches {microbatches} = train.global_batch({t.global_batch}) / (dp({dims.dp}) * "
            f"train.micro_batch({t.micro_batch})) < mesh.pp({dims.pp}): the schedule needs at least one "
            "microbatch per stage; raise train.global_batch or lower train.micro_batch"
        )
    if dims.pp > 1 and multi and microbatches % dims.pp:
        raise ValueError(
            f"mesh.pp_schedule={mesh.pp_schedule} needs the microbatches ({microbatches}) to be a multiple "
            f"of mesh.pp({dims.pp})"
        )
    return microbatches


def check_device(cfg: JobConfig, *, gpus: int | None = None, per_task: bool = False) -> tuple[str, str]:
    """Where the ranks run (not on a login node): (device type, mixed precision) resolved from
    `train.device` / `train.mixed_precision` and the `gpus` visible here (default: counted).
    ValueError when the GPUs cannot host the ranks. `per_task`: checked by a rank, which Slurm may
    have bound to one GPU of its own."""
    t, ln = cfg.train, cfg.launcher
    n = visible_gpus() if gpus is None else gpus
    device = resolve_device(t.device, gpus=n, gpus_per_node=cfg.cluster.gpus_per_node, cluster=cfg.cluster.name)
    if device == "cuda" and n < ln.tasks_per_node and not (per_task and n == 1):
        raise ValueError(
            f"train.device={t.device} with launcher.tasks_per_node({ln.tasks_per_node}) ranks on this node but "
            f"only {n} GPU(s) visible: one rank per GPU; set launcher.tasks_per_node={n} "
            "(or make the GPUs visible: CUDA_VISIBLE_DEVICES), or train on CPU ranks: train.device=cpu"
        )
    check_compile_backend(cfg)
    return device, resolve_mixed_precision(t.mixed_precision, device_type=device)


def check_compile_backend(cfg: JobConfig) -> None:
    """With train.compile=true, train.compile_backend must be a torch.compile backend of the torch the ranks run."""
    if not cfg.train.compile:
        return
    known = compile_backends()
    if cfg.train.compile_backend not in known:
        raise ValueError(
            f"train.compile_backend={cfg.train.compile_backend!r} is not a torch.compile backend of this torch "
            f"(torch._dynamo.list_backends(): {', '.join(known)}); set train.compile_backend=inductor (the default), "
            "or aot_eager to check dynamo's capture without inductor's code generation"
        )


def _layers_per_stage(cfg: JobConfig, dims: ParallelDims, spr: int) -> tuple[int, ...]:
    """The user's pipeline split (mesh.pp_layers_per_stage), checked; () when none is set."""
    given = cfg.mesh.pp_layers_per_stage
    if given is None:
        return ()
    check_layers_per_stage(list(given), n_layers=cfg.model.n_layers, pp=dims.pp, stages_per_rank=spr)
    return tuple(given)


def _check_eval(cfg: JobConfig, dims: ParallelDims) -> None:
    """Held-out evaluation (jobs/evaluate.py): its keys, and a pipeline schedule whose eval() works."""
    t = cfg.train
    if t.eval_every < 0 or t.eval_batches < 1:
        raise ValueError(
            f"train.eval_every({t.eval_every}) must be >= 0 (0 = off) and train.eval_batches({t.eval_batches}) >= 1"
        )
    if t.eval_every and dims.pp > 1 and cfg.mesh.pp_schedule == "zbv_zero_bubble":
        raise ValueError(
            "train.eval_every with mesh.pp_schedule=zbv_zero_bubble: torch 2.13's forward-only "
            "ScheduleZBVZeroBubble.eval() fails (its action list still sends backward inputs); use "
            "gpipe, 1f1b or interleaved_1f1b, or train.eval_every=0"
        )


def _check_compile(cfg: JobConfig, dims: ParallelDims) -> None:
    """train.compile composes with FSDP2 and PP (tests/multiproc/test_compile.py), not with TP (train.compile_backend
    is checked where the ranks run, `check_compile_backend`: it needs torch)."""
    if cfg.train.compile and dims.tp > 1:
        raise ValueError(
            f"train.compile=true with mesh.tp({dims.tp}) > 1: compiled blocks on tensor-parallel DTensors fail in "
            "backward with torch 2.13 ('Tensor' object has no attribute '_local_tensor'; measured on CPU/gloo, with "
            "and without sequence and loss parallelism); set train.compile=false or mesh.tp=1"
        )


def _check_failure(cfg: JobConfig) -> None:
    """The failure policy: signals that exist, timeouts that can fire, budgets that can be met."""
    f = cfg.failure
    parse_signals(f.requeue_signals)
    _check_failure_timeouts(f)
    _check_failure_budgets(f)
    _check_health(f)
    check_spike(f)
    if f.sdc_rerun and f.sdc_rtol == 0 and not cfg.train.deterministic:
        raise ValueError(
            "failure.sdc_rtol(0.0) with train.deterministic=false: nondeterministic kernels compute a step's "
            "re-run slightly differently, so every suspicious step would read as silent data corruption and send "
            "its GPU's node away; set failure.sdc_rtol=1e-3, or train.deterministic=true, or failure.sdc_rerun=false"
        )
    c = cfg.checkpoint
    check_retention(f, enabled=c.enabled, interval=c.interval, every_steps=c.every_steps, keep=c.keep)
    failure_split(process_share=f.process_share, node_share=f.node_share)  # the checkpoint tiers' failure shares


def _check_failure_timeouts(f: FailureConfig) -> None:
    """Timeouts that can fire, in order: a peer's heartbeat goes stale before the hang is named, the hang before a
    stuck collective times out."""
    for name in (
        "init_timeout_s",
        "collective_timeout_s",
        "hang_timeout_s",
        "heartbeat_s",
        "node_probe_timeout_s",
        "checkpoint_timeout_s",
    ):
        if getattr(f, name) <= 0:
            raise ValueError(f"failure.{name}({getattr(f, name)}) must be > 0")
    if f.hang_timeout_s >= f.collective_timeout_s:
        raise ValueError(
            f"failure.hang_timeout_s({f.hang_timeout_s}) >= failure.collective_timeout_s"
            f"({f.collective_timeout_s}): a stuck collective would time out before the watchdog names "
            f"the hang (with every rank's stack and the suspect); set failure.hang_timeout_s below "
            f"failure.collective_timeout_s, e.g. failure.hang_timeout_s={f.collective_timeout_s * 0.6:g}"
        )
    if f.missed_beats < 2:
        raise ValueError(
            f"failure.missed_beats({f.missed_beats}) must be >= 2: one late beat of a busy filesystem "
            "is no hang; e.g. failure.missed_beats=5"
        )
    if f.hang_timeout_s < 3 * f.heartbeat_s:
        raise ValueError(
            f"failure.hang_timeout_s({f.hang_timeout_s}) < 3 * failure.heartbeat_s({f.heartbeat_s}): "
            "a peer's heartbeat must be able to go stale before the hang is named; lower heartbeat_s"
        )


def _check_failure_budgets(f: FailureConfig) -> None:
    """Restart, quarantine and requeue budgets that can be met."""
    if f.restarts_in_allocation < 0:
        raise ValueError(
            f"failure.restarts_in_allocation({f.restarts_in_allocation}) must be >= 0 "
            "(0: every dead or hung rank sends the job back to the queue)"
        )
    if f.quarantine_ttl_h < 0:
        raise ValueError(
            f"failure.quarantine_ttl_h({f.quarantine_ttl_h}) must be >= 0 (hours a quarantined node stays excluded; "
            "0 = until removed from quarantine.json by hand)"
        )
    if f.max_requeues < 0 or f.max_attempts_without_progress < 1:
        raise ValueError(
            f"failure.max_requeues({f.max_requeues}) must be >= 0 and "
            f"failure.max_attempts_without_progress({f.max_attempts_without_progress}) >= 1"
        )


def _check_metrics(cfg: JobConfig) -> None:
    """Straggler thresholds that can be met; TensorBoard installed when asked for."""
    f = cfg.failure
    if f.straggler_ratio <= 1.0 or f.straggler_intervals < 1 or f.straggler_min_diff_s < 0:
        raise ValueError(
            f"failure.straggler_ratio({f.straggler_ratio}) must be > 1, failure.straggler_intervals"
            f"({f.straggler_intervals}) >= 1 and failure.straggler_min_diff_s({f.straggler_min_diff_s}) >= 0; "
            "e.g. failure.straggler_ratio=1.1 failure.straggler_intervals=3"
        )
    if not 0 <= cfg.metrics.kernel_every <= WINDOW_STEPS:
        raise ValueError(
            f"metrics.kernel_every({cfg.metrics.kernel_every}) must be 0 (GPU straggler checks on CUDA "
            f"event time) or 1..{WINDOW_STEPS}: every judged window ({WINDOW_STEPS} steps or more) needs a "
            "profiled step; e.g. metrics.kernel_every=10"
        )
    check_tensorboard(cfg.metrics.tensorboard)


def _check_health(f: FailureConfig) -> None:
    """GPU health: a period NVML can keep up with, a temperature in range, XIDs that exist."""
    if f.health_every_s < 0 or 0 < f.health_every_s < 1:
        raise ValueError(
            f"failure.health_every_s({f.health_every_s}) must be 0 (check at start only) or >= 1: "
            "every rank queries NVML each time; set failure.health_every_s=60"
        )
    if not 0 < f.health_temp_warn_c < 150:
        raise ValueError(
            f"failure.health_temp_warn_c({f.health_temp_warn_c}) is not a GPU temperature in C; "
            "set failure.health_temp_warn_c=85"
        )
    bad = [x for x in f.health_failing_xids if not isinstance(x, int) or x < 1]
    if bad:
        raise ValueError(
            f"failure.health_failing_xids has {bad}: XIDs are positive integers, e.g. "
            "failure.health_failing_xids=[48,63,64,74,79,92,94,95,119,120]"
        )


def checkpoint_wait_s(*, write_s: float, async_mode: str) -> float:
    """The longest a checkpoint phase waits for writes, from the planner's write time of one checkpoint:
    an async save first waits for the one still in flight, then writes its own (the stop path and the
    end of training wait for both); a synchronous save writes one."""
    return write_s * (1 if async_mode == "none" else 2)


def check_checkpoint_timeout(f: FailureConfig, *, write_s: float, async_mode: str) -> None:
    """failure.checkpoint_timeout_s covers the predicted checkpoint writes (Megatron's "checkpointing"
    timeout); ValueError with the arithmetic and the value to set."""
    need = checkpoint_wait_s(write_s=write_s, async_mode=async_mode)
    if f.checkpoint_timeout_s < need:
        n = "" if async_mode == "none" else "2 x "
        raise ValueError(
            f"failure.checkpoint_timeout_s({f.checkpoint_timeout_s:g}) < {n}the predicted checkpoint write "
            f"({write_s:.0f} s, checkpoint.async_mode={async_mode}) = {need:.0f} s: the watchdog would end "
            f"every attempt inside its final save; set failure.checkpoint_timeout_s={int(need * 1.5) + 1}"
        )


def stop_path_s(*, step_s: float, blocking_s: float, write_s: float, async_mode: str) -> float:
    """From a stop signal to the job letting go of its nodes: the step in progress, then the save, all of
    whose write is waited for (synchronous: its blocking part is the write), after a save still in flight."""
    if async_mode == "none":
        return step_s + max(blocking_s, write_s)
    return step_s + write_s + blocking_s + write_s
