"""The zero-GPU readiness gate (`python -m jobs.plan` is its entry point) for the composed config at its full world size.

It prints per-rank memory (measured on the real `parallelize()` over a fake process group for a
sample of ranks covering every pipeline role, and compared with the 16 bytes/parameter rule), the
activation memory with and without activation checkpointing, the communication per step by
collective and mesh axis, the pipeline bubble, the checkpoint size, write time, Young/Daly interval
and expected goodput, and a six-question readiness table. `plan.json=true` prints one JSON object.
Nothing is written anywhere (run.dir is never created). The checks and the readiness table are
`jobs.planner.checks`; the arithmetic is `jobs.planner.arith` (memory, comm, params) and `steptime`; the
measurement over the fake process group is `jobs.planner.measure`, the text tables `jobs.planner.render`.

Exit codes (jobs/exitcodes.py): 0 every check passed; 1 a check failed (each failure names the knob);
2 the config is invalid (the ValueError of `jobs.validate`, or a composition error).

Context parallel (mesh.cp > 1, trained by parallel/cp.py) and expert parallel (mesh.ep > 1) are
checked by the trainer's own `validate(training=False)`, and a note says how each is planned (and whether
training is built). MoE
and MLA models are planned analytically only (jobs/models/model.py builds MoE blocks, jobs/models/moe.py, but not MLA).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from jobs.config import JobConfig
from jobs.planner import arith as P
from jobs.planner import costs as C
from jobs.planner import hardware as H
from jobs.planner import measure as M
from jobs.planner import steptime as S
from jobs.planner.checks import Check, analytic_checks, readiness
from jobs.planner.params import attention_head_dims
from parallel.config import ring_kernel_note

__all__ = ["Check", "Plan", "check", "build_plan", "validate_for_planning"]

# ------------------------------------------------------------------------------------- validation


def validate_for_planning(cfg: JobConfig):
    """`jobs.validate.validate(cfg, training=False)`, the trainer's own checks (one validator), with notes on what
    is planned analytically. `training=False` accepts only what is planned but not trained (MLA with mesh.tp > 1
    or mesh.cp > 1). Returns (Derived, notes). Raises ValueError naming the override."""
    from jobs.validate import validate

    mesh, m = cfg.mesh, cfg.model
    d = validate(cfg, training=False)
    bad = {k: v for k, v in (cfg.cluster.gpu_attention_seq_share or {}).items() if not 0 < v <= 1}
    if bad:
        raise ValueError(
            f"cluster.gpu_attention_seq_share has shares outside (0, 1] at {bad}: each is the attention rate at that "
            "sequence length over cluster.gpu_attention_tflops (cluster.gpu_attention_seq_share=null: one rate at "
            "every length)"
        )
    notes: list[str] = []
    if m.n_routed_experts > 0 or m.attention == "mla":
        notes.append(
            f"model {m.name}: MoE/MLA planned analytically (no fake-backend measurement"
            f"{'; MLA trains with mesh.tp=1 and mesh.cp=1 (jobs/models/mla.py)' if m.attention == 'mla' else ''})"
        )
    if mesh.cp > 1:
        kernel = ring_kernel_note(fp32=cfg.train.mixed_precision == "fp32", head_dim=attention_head_dims(m)[0])
        notes.append(
            f"cp{mesh.cp}: context parallel (mesh.cp_impl={mesh.cp_impl}) is trained by parallel/cp.py; planned "
            "analytically with K/V all-gathered over cp (ring moves the same bytes point to point), FSDP "
            "sized over dp_shard*cp, as torchtitan" + (f"; {kernel}" if mesh.cp_impl == "ring" else "")
        )
    if mesh.ep > 1:
        why = _refused_by_training(cfg)
        notes.append(
            f"ep{mesh.ep}: planned analytically, training {'built (parallel/ep.py)' if not why else 'refused: ' + why} "
            "(experts sharded ep-ways, then FSDP over dp_shard*cp/ep)"
        )
    return d, notes


def _refused_by_training(cfg: JobConfig) -> str:
    """Why `jobs.train` refuses this config ('' when it trains it): the trainer's own validation, one rule."""
    from jobs.validate import validate

    try:
        validate(cfg)
    except ValueError as e:
        return str(e)
    return ""


# ---------------------------------------------------------------------------------------------- plan


@dataclass
class Plan:
    world_size: int
    mesh: str
    params_total: int
    params_active: int
    peak_role: str
    per_rank: dict[str, int]
    roles: list[dict]
    heuristic_bytes_per_rank: int
    activation: dict[str, object]
    comm: list[dict]
    step: dict[str, float | str]  # predicted parts in seconds, tokens_per_s, mfu; where the figures came from
    bubble_fraction: float
    checkpoint: dict[str, float]
    goodput_expected: float | None  # None: the restart cost is unknown (no ledger, no plan.restart_overhead_s)
    checks: list[Check]
    readiness: list[dict]
    notes: list[str] = field(default_factory=list)
    measured: list[dict] = field(default_factory=list)
    seconds: float = 0.0
    axes: list[dict] = field(
        default_factory=list
    )  # per mesh axis > 1: the link it runs on, our rank order and Llama 3's
    meshes: str = (
        ""  # the attention layers' mesh and the MoE layers' folded over the same ranks (ParallelDims.describe_meshes)
    )
    tiers: dict = field(
        default_factory=dict
    )  # the checkpoint tiers side by side and their combined goodput (jobs/planner/tiers.py)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["checks"] = [asdict(c) for c in self.checks]
        return d


@dataclass
class _Draft:
    """What the plan's steps hand each other: each step reads what the earlier ones filled in."""

    cfg: JobConfig
    d: object  # jobs.validate.Derived (with the real cp/ep degrees)
    notes: list[str]
    shape: dict[str, int] = field(default_factory=dict)  # mesh axis -> degree
    common: dict = field(default_factory=dict)  # keyword arguments every arith call shares
    pcount: P.ParamCount | None = None
    shapes: dict[int, list[P.StageShape]] = field(default_factory=dict)
    roles: dict[int, str] = field(default_factory=dict)
    measured: list[M.Measured] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    role_rows: list[dict] = field(default_factory=list)
    peak: tuple = ()  # (pp rank, RankMemory, role) of the rank with the highest peak
    comm: list[dict] = field(default_factory=list)
    bubble: float = 0.0
    step: dict[str, float] = field(default_factory=dict)
    step_s: float | None = None
    checkpoint: dict = field(default_factory=dict)
    goodput: float | None = 0.0
    goodput_upper: float = 0.0  # the goodput with an unknown restart counted as its load only: an upper bound
    tiers: dict = field(default_factory=dict)
    axes: list[dict] = field(default_factory=list)

    @property
    def fsdp(self) -> int:
        return self.d.dims.dp_shard * self.d.dims.cp


def _shapes(x: _Draft) -> None:
    """Mesh shape, parameter count, the stages each pp rank holds and one pp rank per role."""
    dims, t = x.d.dims, x.cfg.train
    x.shape = {
        "pp": dims.pp,
        "dp_replicate": dims.dp_replicate,
        "dp_shard": dims.dp_shard,
        "cp": dims.cp,
        "tp": dims.tp,
        "ep": dims.ep,
    }
    x.common = dict(
        tp=dims.tp,
        pp=dims.pp,
        microbatches=x.d.microbatches,
        seq_len=t.seq_len,
        micro_batch=t.micro_batch,
        cp=dims.cp,
        ep=dims.ep,
        sequence_parallel=x.cfg.mesh.sequence_parallel and dims.tp > 1,
    )
    x.pcount = P.count_params(x.cfg.model)
    x.shapes = M.stage_shapes(x.cfg, x.d)
    x.roles = M.roles(x.shapes)


def _fake_backend(x: _Draft, measure: bool | None) -> None:
    """The real parallelize() on the fake backend (unless off, or the model is MoE/MLA)."""
    m = x.cfg.model
    do = x.cfg.plan.fake_backend if measure is None else measure
    if not do or m.n_routed_experts > 0 or m.attention == "mla":
        return
    try:
        x.measured, mnotes, secs = M.measure(x.cfg, x.d, x.roles, x.shapes)
        x.notes += mnotes
        x.notes.append(
            f"fake backend: real parallelize() on {len(x.measured)} sampled ranks of "
            f"{x.d.dims.world_size} in {secs:.1f} s"
        )
        x.checks.append(
            Check(
                "parallelize",
                True,
                f"the real recipe sharded {len(x.measured)} sampled ranks at world size {x.d.dims.world_size}",
            )
        )
    except Exception as e:  # the recipe itself failing at this scale is the finding
        x.checks.append(
            Check("parallelize", False, f"parallelize() failed on the fake backend: {type(e).__name__}: {e}")
        )


def _memory(x: _Draft) -> None:
    """Peak memory of every role (measured shard sizes where the fake backend ran); the peak role."""
    cfg, t = x.cfg, x.cfg.train
    measured_max: dict[int, int] = {}
    for r in x.measured:
        measured_max[r.coords["pp"]] = max(measured_max.get(r.coords["pp"], 0), r.params_elems)
    best = None
    for pp_rank, role in x.roles.items():
        mem = P.rank_memory(
            cfg.model,
            x.shapes[pp_rank],
            fsdp=x.fsdp,
            stages_per_rank=x.d.stages_per_rank,
            schedule=cfg.mesh.pp_schedule,
            loss_parallel=cfg.mesh.loss_parallel,
            activation_checkpointing=t.activation_checkpointing,
            ac_every=t.ac_every,
            pp_rank=pp_rank,
            params_elems=measured_max.get(pp_rank),
            autocast=x.d.dims.dp == 1 and H.compute_bytes(x.cfg) == 2,
            compute_bytes=H.compute_bytes(x.cfg),
            **x.common,
        )
        x.role_rows.append({"role": role, "pp_rank": pp_rank, "measured": pp_rank in measured_max, **mem.as_dict()})
        if best is None or mem.peak_bytes > best[1].peak_bytes:
            best = (pp_rank, mem, role)
    x.peak = best


def _comm(x: _Draft) -> None:
    """Collectives of the peak rank per step (timed by `_step_time` when the profile has figures)."""
    x.comm = [{**r, "link": "-", "seconds": None} for r in _role_comm(x, x.peak[0])]


def _role_comm(x: _Draft, pp_rank: int) -> list[dict]:
    dims, t = x.d.dims, x.cfg.train
    rows = []
    for it in P.comm_per_step(
        x.cfg.model,
        x.shapes[pp_rank],
        dp_replicate=dims.dp_replicate,
        fsdp=x.fsdp,
        activation_checkpointing=t.activation_checkpointing,
        ac_every=t.ac_every,
        nvlink_domain=x.cfg.cluster.nvlink_domain,
        compute_bytes=H.compute_bytes(x.cfg),
        **x.common,
    ):
        row = it.as_dict()
        if it.axis == "dp_shard" and dims.cp > 1:
            row["axis"] = "dp_shard*cp"
        rows.append(row)
    return rows


def _topology(x: _Draft) -> None:
    """Which mesh axes cross node and pod boundaries: for our rank order (parallel/dims.py, pp outermost,
    tp innermost) and for Llama 3's [TP, CP, PP, DP] (DP outermost). The step time uses ours."""
    cl = x.cfg.cluster
    node = max(cl.nvlink_domain, 1) if cl.gpus_per_node > 0 else max(x.cfg.launcher.tasks_per_node, 1)
    for axis in ("tp", "cp", "ep", "dp_shard", "dp_replicate", "pp"):
        if x.shape.get(axis, 1) <= 1:
            continue
        row = {"axis": axis, "size": x.shape[axis]}
        for name, order in (("ours", H.OUR_ORDER), ("llama3", H.LLAMA3_ORDER)):
            row[f"{name}_span"] = H.axis_span(axis, x.shape, order)
            row[f"{name}_scope"] = H.axis_scope(axis, x.shape, node_ranks=node, pod_ranks=cl.pod_gpus, order=order)
        x.axes.append(row)


def _predict_role(x: _Draft, hw: H.Hardware, pp_rank: int, role: str) -> S.StepTime:
    """The predicted step of pipeline rank `pp_rank` (`role`: first, middle, last or only)."""
    cfg, d, m, t = x.cfg, x.d, x.cfg.model, x.cfg.train
    layers = [i for st in x.shapes[pp_rank] for i in st.layers]
    return S.predict_rank(
        m,
        x.shapes[pp_rank],
        _role_comm(x, pp_rank),
        hw,
        role=role,
        shape=x.shape,
        microbatches=d.microbatches,
        micro_batch=t.micro_batch,
        seq_len=t.seq_len,
        bubble=x.bubble,
        world=d.dims.world_size,
        recomputed=P.checkpointed_layers(layers, mode=t.activation_checkpointing, every=t.ac_every),
        params_elems=next(r["params_elems"] for r in x.role_rows if r["pp_rank"] == pp_rank),
        sequence_parallel=x.common["sequence_parallel"],
        compute_bytes=H.compute_bytes(cfg),
    )


def _step_time(x: _Draft) -> None:
    """The predicted step (jobs.planner.steptime) of every pp role; the slowest one sets the step."""
    cfg, d, m, cl, t = x.cfg, x.d, x.cfg.model, x.cfg.cluster, x.cfg.train
    x.bubble = P.bubble_fraction(
        pp=d.dims.pp, microbatches=d.microbatches, stages_per_rank=d.stages_per_rank, schedule=cfg.mesh.pp_schedule
    )
    fpt = P.flops_per_token(m, seq_len=t.seq_len)
    model_flops_rank = fpt * d.tokens_per_step / d.dims.world_size
    x.step = {"model_tflop_per_rank": model_flops_rank / 1e12, "flops_per_token": fpt}
    hw = H.hardware(
        cl,
        dtype=H.compute_dtype(t.mixed_precision, gpus_per_node=cl.gpus_per_node),
        tasks_per_node=cfg.launcher.tasks_per_node,
        tp=d.dims.tp,
    )
    if hw is None:
        x.notes.append(
            f"no step time: cluster={cl.name} has neither calibrated figures (python -m jobs.calibrate) "
            "nor cited GPU peaks"
        )
        return
    per_role = []
    for pp_rank, role in x.roles.items():
        per_role.append(_predict_role(x, hw, pp_rank, role))
        if pp_rank == x.peak[0]:
            x.comm = [{**r, "link": r["scope"]} for r in per_role[-1].comm]
    slow = S.predict_step(per_role)
    if hw.bubble_why and x.bubble > 0:
        x.notes.append(hw.bubble_why)
    x.step_s = slow.step_s
    parts = slow.parts
    x.step.update(parts)
    x.step.update(
        step_s=slow.step_s,
        slowest_role=slow.role,
        tokens_per_s=d.tokens_per_step / slow.step_s,
        matmul_tflops=hw.matmul_tflops,
        matmul_source=hw.matmul_source,
        gemm_efficiency=slow.gemm_efficiency,
        gemm_sms=hw.gemm_sms,
        dtype=hw.dtype,
        overlap=hw.overlap_why,
        hbm_GBps=hw.hbm_GBps,
        comm_sm_share=hw.comm_sm_share,
        attention_tflops=0.0 if x.cfg.model.sdpa_backend == "math" else hw.attention_at(t.seq_len),
        sdpa_backend=x.cfg.model.sdpa_backend,
        norm_kernel=x.cfg.model.norm_kernel,
        comm_s_unoverlapped=sum(r["seconds"] for r in slow.comm),
        serial_sum_s=parts["compute_s"]
        + parts["recompute_s"]
        + parts["memory_bound_s"]
        + parts["bubble_s"]
        + sum(r["seconds"] for r in slow.comm),
        step_s_at_mfu=slow.step_s,  # the key the Slurm signal check reads (kept: it is the predicted step now)
    )
    if cl.gpu_bf16_tflops > 0:
        x.step["mfu"] = model_flops_rank / (slow.step_s * cl.gpu_bf16_tflops * 1e12)
        x.step["mfu_assumed"] = x.step["mfu"]  # old key, now the predicted MFU (plan.mfu is no input any more)


def _checkpoint(x: _Draft) -> None:
    """Checkpoint bytes, write time, blocking cost, restart cost, job MTBF and the interval."""
    from checkpoint.interval import job_mtbf_s, plan_interval

    cfg, cl, pc, ck = x.cfg, x.cfg.cluster, x.cfg.plan, x.cfg.checkpoint
    per_rank_ck = P.checkpoint_bytes(x.peak[1].params_elems)
    total_ck = P.checkpoint_bytes(x.pcount.total)
    write_s = total_ck / (cl.fs_write_GBps * 1e9)
    profile = f"cluster={cl.name}, " + (f"calibrated {cl.calibrated}" if cl.calibrated else "cited")
    ledger_save, ledger_restart = C.ledger_costs(cfg.run.dir)
    save = C.save_cost(
        ledger=ledger_save,
        override=pc.save_fixed_s,
        async_mode=ck.async_mode,
        write_s=write_s,
        stage_s=per_rank_ck / (cl.host_copy_GBps * 1e9),
        fsync_s=cl.fs_fsync_s,
        profile=profile,
    )
    rst = C.restart_cost(ledger=ledger_restart, override=pc.restart_overhead_s, load_s=write_s, profile=profile)
    delta, restart = save.seconds, rst.seconds
    mtbf = job_mtbf_s(
        mtbf_job_hours=cfg.failure.mtbf_job_hours, mtbf_node_hours=cfg.failure.mtbf_node_hours, nodes=cfg.launcher.nodes
    )
    ip = plan_interval(delta=delta, mtbf=mtbf, restart=restart)
    if ck.interval == "auto" or x.step_s is None:
        tau = max(ip.interval_s, write_s if ck.async_mode != "none" else 0.0)
        policy = f"checkpoint.interval={ck.interval}: Daly"
    else:
        every = ck.every_steps if ck.every_steps > 0 else cfg.train.steps
        tau = every * x.step_s
        policy = f"checkpoint.every_steps={every} x {x.step_s:.2f} s/step"
    x.checkpoint = {
        "bytes_per_rank": per_rank_ck,
        "bytes_total": total_ck,
        "write_s": write_s,
        "blocking_s": delta,
        "interval_s": tau,
        "daly_interval_s": ip.interval_s,
        "young_interval_s": ip.young_s,
        "interval_steps": max(1, round(tau / x.step_s)) if x.step_s else None,
        "mtbf_s": mtbf,
        "restart_s": restart,
        "lost_work_per_failure_s": (tau + delta) / 2,
        "policy": policy,
        "blocking_source": save.source,
        "restart_source": rst.source,
        "save_known": save.known,
        "restart_known": rst.known,
    }


def _goodput(x: _Draft) -> None:
    """Daly's expected goodput at the interval used (0 without checkpoints)."""
    from checkpoint.interval import expected_wall_time

    k = x.checkpoint
    x.goodput = (
        1.0
        / expected_wall_time(1.0, tau=k["interval_s"], delta=k["blocking_s"], mtbf=k["mtbf_s"], restart=k["restart_s"])
        if x.cfg.checkpoint.enabled
        else 0.0
    )
    x.goodput_upper = x.goodput
    if x.cfg.checkpoint.enabled and not k["restart_known"]:  # never a number that looks measured
        x.goodput = None


def _tiers(x: _Draft) -> None:
    """Each checkpoint tier's interval and goodput factor, and the combination against the filesystem tier alone."""
    from jobs.planner.tiers import tier_section

    if x.cfg.checkpoint.enabled:
        x.tiers = tier_section(x.cfg, ckpt=x.checkpoint, step_s=x.step_s)


def _activation_summary(x: _Draft) -> dict[str, object]:
    cfg, dims, m, t = x.cfg, x.d.dims, x.cfg.model, x.cfg.train
    peak_pp, peak_mem, _ = x.peak
    sp = x.common["sequence_parallel"]
    return {
        "activation_checkpointing": t.activation_checkpointing,
        "ac_every": t.ac_every,
        "per_microbatch_per_layer_bytes": P.layer_activation_bytes(
            m,
            layer=m.n_layers - 1,
            seq_len=t.seq_len,
            micro_batch=t.micro_batch,
            tp=dims.tp,
            cp=dims.cp,
            sequence_parallel=sp,
            ep=dims.ep,
        ),
        "checkpointed_per_layer_bytes": P.checkpointed_layer_bytes(
            seq_len=t.seq_len, micro_batch=t.micro_batch, dim=m.dim, tp=dims.tp, cp=dims.cp, sequence_parallel=sp
        ),
        "peak_no_ac_bytes": peak_mem.activation_bytes_no_ac,
        "peak_full_ac_bytes": peak_mem.activation_bytes_full_ac,
        "layers_in_flight": P.layers_in_flight(
            pp=dims.pp,
            microbatches=x.d.microbatches,
            layers_on_rank=sum(len(s.layers) for s in x.shapes[peak_pp]),
            stages_per_rank=x.d.stages_per_rank,
            schedule=cfg.mesh.pp_schedule,
            pp_rank=peak_pp,
        ),
    }


def _assemble(x: _Draft, readiness: list[dict], t0: float) -> Plan:
    mem, dims = x.peak[1], x.d.dims
    dtype = H.compute_dtype(x.cfg.train.mixed_precision, gpus_per_node=x.cfg.cluster.gpus_per_node)
    x.notes.append(
        f"memory assumes bf16 compute with fp32 reduction (MixedPrecisionPolicy), fp32 sharded "
        f"params/grads/AdamW; the traffic and the step time use the {dtype} bytes and rate (train.mixed_precision)"
    )
    return Plan(
        world_size=dims.world_size,
        mesh=" * ".join(f"{a}{v}" for a, v in x.shape.items() if v > 1) or "single",
        params_total=x.pcount.total,
        params_active=x.pcount.active,
        peak_role=x.peak[2],
        per_rank={
            k: getattr(mem, k)
            for k in (
                "params_bytes",
                "grads_bytes",
                "optimizer_bytes",
                "unsharded_bytes",
                "activation_bytes",
                "logits_bytes",
                "p2p_bytes",
                "autocast_bytes",
                "peak_bytes",
            )
        },
        roles=x.role_rows,
        heuristic_bytes_per_rank=P.heuristic_bytes_per_rank(x.pcount.total, model_shards=dims.pp * dims.tp * x.fsdp),
        activation=_activation_summary(x),
        comm=x.comm,
        step=x.step,
        bubble_fraction=x.bubble,
        checkpoint=x.checkpoint,
        goodput_expected=x.goodput,
        checks=x.checks,
        readiness=readiness,
        notes=x.notes,
        measured=[asdict(r) for r in x.measured],
        seconds=time.perf_counter() - t0,
        axes=x.axes,
        meshes=dims.describe_meshes(),
        tiers=x.tiers,
    )


def build_plan(cfg: JobConfig, *, measure: bool | None = None) -> Plan:
    """The whole plan, as a pipeline of small steps: validate -> shapes -> (fake backend) -> memory ->
    comm -> step time -> checkpoint/interval -> goodput -> checks. Raises ValueError for an invalid
    config. `measure` (default plan.fake_backend) runs the fake-backend measurement; without it every
    number is analytic."""
    t0 = time.perf_counter()
    d, notes = validate_for_planning(cfg)
    x = _Draft(cfg=cfg, d=d, notes=notes)
    _shapes(x)
    _fake_backend(x, measure)
    for step in (_memory, _comm, _topology, _step_time, _checkpoint, _goodput, _tiers):
        step(x)
    in_flight = _activation_summary(x)["layers_in_flight"]
    x.checks = (
        analytic_checks(cfg, d, x.peak[1], x.peak[2], x.checkpoint, x.goodput, x.goodput_upper, in_flight=in_flight)
        + x.checks
    )
    rows = readiness(cfg, d, x.peak[1], x.peak[2], x.step, x.bubble, x.comm, x.checkpoint, x.goodput, x.checks)
    return _assemble(x, rows, t0)


def _recomputed_share(cfg: JobConfig, stages: list[P.StageShape]) -> float:
    """Share of a rank's blocks that activation checkpointing runs forward twice."""
    layers = [i for st in stages for i in st.layers]
    t = cfg.train
    ckpt = P.checkpointed_layers(layers, mode=t.activation_checkpointing, every=t.ac_every)
    return len(ckpt) / max(len(layers), 1)


# ----------------------------------------------------------------------------------- sweep pruning


def check(cfg: JobConfig) -> list[Check]:
    """The analytic checks for one config (no fake backend): cheap enough for every point of a sweep.
    A config error is returned as a failed `config` check rather than raised."""
    try:
        return build_plan(cfg, measure=False).checks
    except ValueError as e:
        return [Check("config", False, str(e))]
