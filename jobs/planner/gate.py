"""The zero-GPU readiness gate (`python -m jobs.plan` is its entry point) for the composed config at its full world size.

It prints per-rank memory (measured on the real `parallelize()` over a fake process group for a
sample of ranks covering every pipeline role, and compared with the 16 bytes/parameter rule), the
activation memory with and without activation checkpointing, the communication per step by
collective and mesh axis, the pipeline bubble, the checkpoint size, write time, Young/Daly interval
and expected goodput, and a six-question readiness table. `plan.json=true` prints one JSON object.
Nothing is written anywhere (run.dir is never created). The checks and the readiness table are
`jobs.planner.checks`; the arithmetic is `jobs.planner.arith` (memory, comm, params) and `steptime`.

Exit codes (jobs/exitcodes.py): 0 every check passed; 1 a check failed (each failure names the knob);
2 the config is invalid (the ValueError of `jobs.validate`, or a composition error).

Context parallel (mesh.cp > 1, trained by parallel/cp.py) and expert parallel (mesh.ep > 1) are
planned the same way: their own arithmetic is checked here, `validate()` runs on the config with
those axes folded away, and a note says how each is planned (and whether training is built). MoE
and MLA models are planned analytically only (jobs/model.py builds MoE blocks, jobs/moe.py, but not MLA).
"""

from __future__ import annotations

import copy
import gc
import time
from dataclasses import asdict, dataclass, field, replace

from jobs.config import JobConfig
from jobs.planner import arith as P
from jobs.planner import costs as C
from jobs.planner import hardware as H
from jobs.planner import steptime as S
from jobs.planner.checks import (INTERVAL_LOWER_BOUND, Check, analytic_checks, goodput_text, readiness,
                                 restart_text)
from jobs.telemetry.flops import mfu_text
from parallel.config import cp_shape_error

__all__ = ["Check", "Plan", "check", "build_plan", "render", "validate_for_planning"]

GiB = 2**30


# ------------------------------------------------------------------------------------- validation


def validate_for_planning(cfg: JobConfig):
    """`jobs.validate.validate(cfg)`, except that mesh.cp > 1 and mesh.ep > 1 are planned, not refused.

    Returns (Derived with the real cp/ep degrees, notes). Raises ValueError naming the override.
    The cp/ep arithmetic is checked here; everything else is the training validator's, run on a copy
    whose mesh has cp=1, ep=1 and whose world is the cp-th part (each cp group acts as one rank for
    batch and microbatch arithmetic, which is what cp means).
    """
    from jobs.validate import validate

    mesh, m, t = cfg.mesh, cfg.model, cfg.train
    notes: list[str] = []
    if m.n_routed_experts > 0 or m.attention == "mla":
        notes.append(
            f"model {m.name}: MoE/MLA planned analytically (no fake-backend measurement"
            f"{'; MLA trains with mesh.tp=1 and mesh.cp=1 (jobs/mla.py)' if m.attention == 'mla' else ''})"
        )
    if mesh.cp <= 1 and mesh.ep <= 1:
        return validate(cfg, training=False), notes
    from parallel.dims import ParallelDims, fold_moe_mesh

    world = cfg.world_size
    dp_shard = ParallelDims.from_config(mesh, world_size=world, world_size_expr=cfg.world_size_expr,
                                        training=False).dp_shard
    if mesh.cp > 1:
        error = cp_shape_error(seq_len=t.seq_len, cp=mesh.cp, tp=mesh.tp, sequence_parallel=mesh.sequence_parallel)
        if error:
            raise ValueError(error)
        notes.append(f"cp{mesh.cp}: context parallel (mesh.cp_impl={mesh.cp_impl}) is trained by parallel/cp.py; planned "
                     "analytically with K/V all-gathered over cp (ring moves the same bytes point to point), FSDP "
                     "sized over dp_shard*cp, as torchtitan")
    if mesh.ep > 1:
        if m.n_routed_experts <= 0:
            raise ValueError(f"mesh.ep({mesh.ep}) > 1 but model.n_routed_experts({m.n_routed_experts}) = 0: a dense model has no experts to shard")
        if m.n_routed_experts % mesh.ep:
            raise ValueError(f"model.n_routed_experts({m.n_routed_experts}) % mesh.ep({mesh.ep}) != 0: each ep rank needs whole experts")
        fold_moe_mesh(pp=mesh.pp, dp_replicate=mesh.dp_replicate, dp_shard=dp_shard, cp=mesh.cp, tp=mesh.tp, ep=mesh.ep)
        why = _refused_by_training(cfg)
        notes.append(f"ep{mesh.ep}: planned analytically, training {'built (parallel/ep.py)' if not why else 'refused: ' + why} "
                     "(experts sharded ep-ways, then FSDP over dp_shard*cp/ep)")
    view = copy.deepcopy(cfg)
    view.mesh.cp, view.mesh.ep, view.mesh.dp_shard = 1, 1, dp_shard
    view.launcher.nodes, view.launcher.tasks_per_node = 1, world // mesh.cp
    d = validate(view, training=False)
    dims = replace(d.dims, cp=mesh.cp, ep=mesh.ep, world_size=world)
    return replace(d, dims=dims), notes


def _refused_by_training(cfg: JobConfig) -> str:
    """Why `jobs.train` refuses this config ('' when it trains it): the trainer's own validation, one rule."""
    from jobs.validate import validate

    try:
        validate(cfg)
    except ValueError as e:
        return str(e)
    return ""


# --------------------------------------------------------------------------------------------- roles


def _stage_shapes(cfg: JobConfig, d) -> dict[int, list[P.StageShape]]:
    """The stages every pp rank holds, from the real split (parallel.pipeline)."""
    from parallel.pipeline import layer_ranges, stage_ids

    dims = d.dims
    if dims.pp <= 1:
        return {0: [P.StageShape(tuple(range(cfg.model.n_layers)), True, True)]}
    ranges = layer_ranges(cfg.model.n_layers, d.num_stages, layers_per_stage=d.pp_layers_per_stage)
    out = {}
    for r in range(dims.pp):
        out[r] = [
            P.StageShape(tuple(ranges[s]), s == 0, s == d.num_stages - 1)
            for s in stage_ids(r, dims.pp, d.stages_per_rank, cfg.mesh.pp_schedule)
        ]
    return out


def _roles(shapes: dict[int, list[P.StageShape]]) -> dict[int, str]:
    """One pp rank per distinct role (what its stages hold), with a name for it."""
    seen: dict[tuple, int] = {}
    for r, stages in shapes.items():
        key = tuple((len(s.layers), s.first, s.last) for s in stages)
        seen.setdefault(key, r)
    names = {}
    for key, r in seen.items():
        stages = shapes[r]
        extra = "".join([", embedding" if any(x.first for x in stages) else "",
                         ", head" if any(x.last for x in stages) else ""])
        names[r] = f"pp{r} [{sum(len(x.layers) for x in stages)} layers{extra}]"
    return names


# -------------------------------------------------------------------------------------- measurement


def _measurement_mesh(dims):
    """The world mesh with its size-1 axes left out: the same row-major rank layout and the same
    groups on every axis parallelize() uses (an axis of size 1 is never sharded over), but without
    the world_size one-rank groups per size-1 axis that the fake backend would otherwise create one
    by one (about 2 x 16,384 `new_group` calls at 16K ranks)."""
    from parallel.dims import MESH_AXES
    from torch.distributed.device_mesh import init_device_mesh

    axes = [(a, n) for a, n in zip(MESH_AXES, dims.shape) if n > 1] or [("dp_shard", 1)]
    return init_device_mesh("cpu", tuple(n for _, n in axes), mesh_dim_names=tuple(a for a, _ in axes))


def _dim0_sizes(m, stages: list[P.StageShape], *, tp: int) -> list[int]:
    """Dim-0 sizes of a stage's parameters after tensor parallelism: FSDP2 shards dim 0, so these
    decide whether the last dp_shard ranks get smaller (uneven) shards."""
    hd = m.dim // m.n_heads
    out = []
    if any(s.layers for s in stages):
        out += [m.n_heads * hd // tp, m.n_kv_heads * hd // tp, m.dim, m.ffn_dim // tp]
    if any(s.first or s.last for s in stages):
        out.append(m.vocab_size // tp)
    return out


@dataclass
class Measured:
    rank: int
    role: str
    coords: dict[str, int]
    params_elems: int
    params_bytes: int
    analytic_elems: int
    seconds: float


def _measure(cfg: JobConfig, d, roles: dict[int, str], shapes) -> tuple[list[Measured], list[str], float]:
    """Real `parallelize()` on a meta-device model over the fake backend, one rank at a time.

    Samples, for each pipeline role, the first and the last dp_shard coordinate (FSDP's uneven
    shards fall on the last ones). With cp > 1 the mesh folds cp into dp_shard (FSDP over
    dp_shard*cp, which is how context parallel shards parameters); cp does not change shard sizes
    otherwise. Returns (measurements, notes, seconds).
    """
    import torch

    from jobs.model import Transformer

    t0 = time.perf_counter()
    dims = d.dims
    mdims = replace(dims, dp_shard=dims.dp_shard * dims.cp, cp=1, ep=1)
    fsdp = mdims.dp_shard
    samples = _samples(cfg, mdims, roles, shapes)
    base = None
    if dims.pp > 1:
        with torch.device("meta"):
            base = Transformer(cfg.model)
    out = []
    for rank, role, coords in samples:
        t1 = time.perf_counter()
        elems, nbytes = _measure_rank(cfg, d, mdims, rank, base)
        analytic = P.shard_elems(cfg.model, shapes[coords["pp"]], tp=dims.tp, fsdp=fsdp)
        out.append(Measured(rank, role, coords, elems, nbytes, analytic, time.perf_counter() - t1))
    notes = []
    if dims.cp > 1:
        notes.append(f"fake backend: cp folded into dp_shard ({dims.dp_shard}*{dims.cp} = {fsdp}) for the measurement")
    return out, notes, time.perf_counter() - t0


def _samples(cfg: JobConfig, mdims, roles: dict[int, str], shapes) -> list[tuple[int, str, dict[str, int]]]:
    """(rank, role, coords) to measure: dp_shard 0 of each pipeline role, and the last dp_shard too
    when a dim-0 size does not divide by the FSDP degree (only there do shards come out smaller)."""
    fsdp = mdims.dp_shard
    shape = mdims.shape  # (pp, dp_replicate, dp_shard, cp, tp)
    samples = []
    for pp_rank, role in roles.items():
        uneven = any(n % fsdp for n in _dim0_sizes(cfg.model, shapes[pp_rank], tp=mdims.tp))
        for s in sorted({0, fsdp - 1}) if uneven else [0]:
            rank = ((pp_rank * shape[1] + 0) * shape[2] + s) * shape[3] * shape[4]
            samples.append((rank, role, {"pp": pp_rank, "dp_replicate": 0, "dp_shard": s, "tp": 0}))
    return samples


def _measure_rank(cfg: JobConfig, d, mdims, rank: int, base) -> tuple[int, int]:
    """(elements, bytes) of the parameters `rank` holds after the real `parallelize()`, in its own
    fake process group (torn down afterwards). Parallelizes `base` when given (pp > 1), else a fresh
    meta-device model."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from jobs.model import Transformer
    from parallel.recipe import parallelize

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=mdims.world_size, store=FakeStore())
    try:
        mesh = _measurement_mesh(mdims)
        if base is None:
            with torch.device("meta"):
                model = Transformer(cfg.model)
        else:
            model = base
        parts, _ = parallelize(
            model,
            dims=mdims,
            mesh=mesh,
            stages_per_rank=d.stages_per_rank,
            pp_schedule=cfg.mesh.pp_schedule,
            sequence_parallel=cfg.mesh.sequence_parallel,
            loss_parallel=cfg.mesh.loss_parallel,
            pp_layers_per_stage=d.pp_layers_per_stage,
        )
        elems = nbytes = 0
        for part in parts:
            for p in part.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                elems += local.numel()
                nbytes += local.numel() * local.element_size()
    finally:
        dist.destroy_process_group()
        gc.collect()
    return elems, nbytes


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
    axes: list[dict] = field(default_factory=list)  # per mesh axis > 1: the link it runs on, our rank order and Llama 3's
    meshes: str = ""  # the attention layers' mesh and the MoE layers' folded over the same ranks (ParallelDims.describe_meshes)
    tiers: dict = field(default_factory=dict)  # the checkpoint tiers side by side and their combined goodput (jobs/planner/tiers.py)

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
    measured: list[Measured] = field(default_factory=list)
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
    x.shape = {"pp": dims.pp, "dp_replicate": dims.dp_replicate, "dp_shard": dims.dp_shard, "cp": dims.cp,
               "tp": dims.tp, "ep": dims.ep}
    x.common = dict(tp=dims.tp, pp=dims.pp, microbatches=x.d.microbatches, seq_len=t.seq_len,
                    micro_batch=t.micro_batch, cp=dims.cp, ep=dims.ep,
                    sequence_parallel=x.cfg.mesh.sequence_parallel and dims.tp > 1)
    x.pcount = P.count_params(x.cfg.model)
    x.shapes = _stage_shapes(x.cfg, x.d)
    x.roles = _roles(x.shapes)


def _fake_backend(x: _Draft, measure: bool | None) -> None:
    """The real parallelize() on the fake backend (unless off, or the model is MoE/MLA)."""
    m = x.cfg.model
    do = x.cfg.plan.fake_backend if measure is None else measure
    if not do or m.n_routed_experts > 0 or m.attention == "mla":
        return
    try:
        x.measured, mnotes, secs = _measure(x.cfg, x.d, x.roles, x.shapes)
        x.notes += mnotes
        x.notes.append(f"fake backend: real parallelize() on {len(x.measured)} sampled ranks of "
                       f"{x.d.dims.world_size} in {secs:.1f} s")
        x.checks.append(Check("parallelize", True, f"the real recipe sharded {len(x.measured)} sampled ranks at "
                                                   f"world size {x.d.dims.world_size}"))
    except Exception as e:  # the recipe itself failing at this scale is the finding
        x.checks.append(Check("parallelize", False, f"parallelize() failed on the fake backend: {type(e).__name__}: {e}"))


def _memory(x: _Draft) -> None:
    """Peak memory of every role (measured shard sizes where the fake backend ran); the peak role."""
    cfg, t = x.cfg, x.cfg.train
    measured_max: dict[int, int] = {}
    for r in x.measured:
        measured_max[r.coords["pp"]] = max(measured_max.get(r.coords["pp"], 0), r.params_elems)
    best = None
    for pp_rank, role in x.roles.items():
        mem = P.rank_memory(
            cfg.model, x.shapes[pp_rank], fsdp=x.fsdp, stages_per_rank=x.d.stages_per_rank,
            schedule=cfg.mesh.pp_schedule, loss_parallel=cfg.mesh.loss_parallel,
            activation_checkpointing=t.activation_checkpointing, ac_every=t.ac_every, pp_rank=pp_rank,
            params_elems=measured_max.get(pp_rank), autocast=x.d.dims.dp == 1 and H.compute_bytes(x.cfg) == 2,
            compute_bytes=H.compute_bytes(x.cfg), **x.common,
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
    for it in P.comm_per_step(x.cfg.model, x.shapes[pp_rank], dp_replicate=dims.dp_replicate, fsdp=x.fsdp,
                              activation_checkpointing=t.activation_checkpointing, ac_every=t.ac_every,
                              nvlink_domain=x.cfg.cluster.nvlink_domain, compute_bytes=H.compute_bytes(x.cfg), **x.common):
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


def _step_time(x: _Draft) -> None:
    """The predicted step (jobs.planner.steptime) of every pp role; the slowest one sets the step."""
    cfg, d, m, cl, t = x.cfg, x.d, x.cfg.model, x.cfg.cluster, x.cfg.train
    x.bubble = P.bubble_fraction(pp=d.dims.pp, microbatches=d.microbatches, stages_per_rank=d.stages_per_rank,
                                 schedule=cfg.mesh.pp_schedule)
    fpt = P.flops_per_token(m, seq_len=t.seq_len)
    model_flops_rank = fpt * d.tokens_per_step / d.dims.world_size
    x.step = {"model_tflop_per_rank": model_flops_rank / 1e12, "flops_per_token": fpt}
    hw = H.hardware(cl, dtype=H.compute_dtype(t.mixed_precision, gpus_per_node=cl.gpus_per_node),
                    tasks_per_node=cfg.launcher.tasks_per_node, tp=d.dims.tp)
    if hw is None:
        x.notes.append(f"no step time: cluster={cl.name} has neither calibrated figures (python -m jobs.calibrate) "
                       "nor cited GPU peaks")
        return
    per_role = []
    for pp_rank, role in x.roles.items():
        layers = [i for st in x.shapes[pp_rank] for i in st.layers]
        per_role.append(S.predict_rank(
            m, x.shapes[pp_rank], _role_comm(x, pp_rank), hw, role=role, shape=x.shape, microbatches=d.microbatches,
            micro_batch=t.micro_batch, seq_len=t.seq_len, bubble=x.bubble, world=d.dims.world_size,
            recomputed=P.checkpointed_layers(layers, mode=t.activation_checkpointing, every=t.ac_every),
            params_elems=next(r["params_elems"] for r in x.role_rows if r["pp_rank"] == pp_rank),
            sequence_parallel=x.common["sequence_parallel"], compute_bytes=H.compute_bytes(cfg)))
        if pp_rank == x.peak[0]:
            x.comm = [{**r, "link": r["scope"]} for r in per_role[-1].comm]
    slow = S.predict_step(per_role)
    if hw.bubble_why and x.bubble > 0:
        x.notes.append(hw.bubble_why)
    x.step_s = slow.step_s
    parts = slow.parts
    x.step.update(parts)
    x.step.update(
        step_s=slow.step_s, slowest_role=slow.role, tokens_per_s=d.tokens_per_step / slow.step_s,
        matmul_tflops=hw.matmul_tflops, matmul_source=hw.matmul_source, dtype=hw.dtype, overlap=hw.overlap_why,
        hbm_GBps=hw.hbm_GBps, comm_sm_share=hw.comm_sm_share,
        comm_s_unoverlapped=sum(r["seconds"] for r in slow.comm),
        serial_sum_s=parts["compute_s"] + parts["recompute_s"] + parts["memory_bound_s"] + parts["bubble_s"]
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
    save = C.save_cost(ledger=ledger_save, override=pc.save_fixed_s, async_mode=ck.async_mode, write_s=write_s,
                       stage_s=per_rank_ck / (cl.host_copy_GBps * 1e9), fsync_s=cl.fs_fsync_s, profile=profile)
    rst = C.restart_cost(ledger=ledger_restart, override=pc.restart_overhead_s, load_s=write_s, profile=profile)
    delta, restart = save.seconds, rst.seconds
    mtbf = job_mtbf_s(mtbf_job_hours=cfg.failure.mtbf_job_hours, mtbf_node_hours=cfg.failure.mtbf_node_hours,
                      nodes=cfg.launcher.nodes)
    ip = plan_interval(delta=delta, mtbf=mtbf, restart=restart)
    if ck.interval == "auto" or x.step_s is None:
        tau = max(ip.interval_s, write_s if ck.async_mode != "none" else 0.0)
        policy = f"checkpoint.interval={ck.interval}: Daly"
    else:
        every = ck.every_steps if ck.every_steps > 0 else cfg.train.steps
        tau = every * x.step_s
        policy = f"checkpoint.every_steps={every} x {x.step_s:.2f} s/step"
    x.checkpoint = {
        "bytes_per_rank": per_rank_ck, "bytes_total": total_ck, "write_s": write_s, "blocking_s": delta,
        "interval_s": tau, "daly_interval_s": ip.interval_s, "young_interval_s": ip.young_s,
        "interval_steps": max(1, round(tau / x.step_s)) if x.step_s else None,
        "mtbf_s": mtbf, "restart_s": restart, "lost_work_per_failure_s": (tau + delta) / 2, "policy": policy,
        "blocking_source": save.source, "restart_source": rst.source, "save_known": save.known,
        "restart_known": rst.known,
    }


def _goodput(x: _Draft) -> None:
    """Daly's expected goodput at the interval used (0 without checkpoints)."""
    from checkpoint.interval import expected_wall_time

    k = x.checkpoint
    x.goodput = (1.0 / expected_wall_time(1.0, tau=k["interval_s"], delta=k["blocking_s"], mtbf=k["mtbf_s"],
                                          restart=k["restart_s"]) if x.cfg.checkpoint.enabled else 0.0)
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
            m, layer=m.n_layers - 1, seq_len=t.seq_len, micro_batch=t.micro_batch, tp=dims.tp, cp=dims.cp,
            sequence_parallel=sp, ep=dims.ep),
        "checkpointed_per_layer_bytes": P.checkpointed_layer_bytes(
            seq_len=t.seq_len, micro_batch=t.micro_batch, dim=m.dim, tp=dims.tp, cp=dims.cp, sequence_parallel=sp),
        "peak_no_ac_bytes": peak_mem.activation_bytes_no_ac,
        "peak_full_ac_bytes": peak_mem.activation_bytes_full_ac,
        "layers_in_flight": P.layers_in_flight(
            pp=dims.pp, microbatches=x.d.microbatches, layers_on_rank=sum(len(s.layers) for s in x.shapes[peak_pp]),
            stages_per_rank=x.d.stages_per_rank, schedule=cfg.mesh.pp_schedule, pp_rank=peak_pp),
    }


def _assemble(x: _Draft, readiness: list[dict], t0: float) -> Plan:
    mem, dims = x.peak[1], x.d.dims
    dtype = H.compute_dtype(x.cfg.train.mixed_precision, gpus_per_node=x.cfg.cluster.gpus_per_node)
    x.notes.append(f"memory assumes bf16 compute with fp32 reduction (MixedPrecisionPolicy), fp32 sharded "
                   f"params/grads/AdamW; the traffic and the step time use the {dtype} bytes and rate (train.mixed_precision)")
    return Plan(
        world_size=dims.world_size,
        mesh=" * ".join(f"{a}{v}" for a, v in x.shape.items() if v > 1) or "single",
        params_total=x.pcount.total,
        params_active=x.pcount.active,
        peak_role=x.peak[2],
        per_rank={k: getattr(mem, k) for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "unsharded_bytes",
                                               "activation_bytes", "logits_bytes", "p2p_bytes", "autocast_bytes",
                                               "peak_bytes")},
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
    x.checks = analytic_checks(cfg, d, x.peak[1], x.peak[2], x.checkpoint, x.goodput, x.goodput_upper,
                               in_flight=in_flight) + x.checks
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


# -------------------------------------------------------------------------------------------- output


def _gib(b: float) -> str:
    return f"{b / GiB:.2f} GiB"


def render(plan: Plan) -> str:
    """The plan as text tables."""
    L = []
    L.append(f"plan: {plan.mesh} on {plan.world_size} ranks | params {plan.params_total / 1e9:.2f} B total, "
             f"{plan.params_active / 1e9:.2f} B active | planned in {plan.seconds:.1f} s")
    L.append(f"  meshes: {plan.meshes}")
    for n in plan.notes:
        L.append(f"  note: {n}")
    L.append("")
    L += _memory_lines(plan)
    L.append("")
    L += _comm_lines(plan)
    L.append("")
    L += _checkpoint_lines(plan)
    if plan.tiers:
        from jobs.planner.tiers import tier_lines

        L += tier_lines(plan.tiers)
    L.append("")
    L.append("readiness")
    for r in plan.readiness:
        L.append(f"  [{r['status']:7s}] {r['question']:32s} {r['answer']}")
    L.append("")
    L.append("checks")
    for c in plan.checks:
        L.append(f"  {'PASS' if c.ok else 'FAIL'}  {c.name:20s} {c.why}")
    return "\n".join(L)


def _memory_lines(plan: Plan) -> list[str]:
    """The memory table: per role, the fake-backend samples, and the activations of the peak role."""
    L = []
    L.append("memory per rank (GiB)         params   grads   optim  unshard    acts  pp_recv  logits    peak")
    for r in plan.roles:
        tag = "*" if r["measured"] else " "
        L.append(f"  {r['role'][:27]:27s}{tag}" + "".join(
            f"{r[k] / GiB:8.2f}" for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "unsharded_bytes",
                                           "activation_bytes", "p2p_bytes", "logits_bytes", "peak_bytes")))
    L.append(f"  (* params measured on the real sharded model) 16 B/param heuristic: {_gib(plan.heuristic_bytes_per_rank)} "
             f"for params+grads+optim")
    if plan.per_rank.get("autocast_bytes"):
        L.append(f"  peak includes {_gib(plan.per_rank['autocast_bytes'])} of bf16 weight copies autocast keeps for backward "
                 "(no FSDP on this mesh: one per microbatch in flight)")
    if plan.measured:
        L.append("  sampled ranks (fake backend):   rank   coords                       measured  analytic max   seconds")
        for r in plan.measured:
            c = r["coords"]
            L.append(f"    {r['role'][:28]:28s} {r['rank']:6d}   pp{c['pp']} dp_shard{c['dp_shard']:<6d}           "
                     f"{r['params_elems'] / 1e6:10.2f} M {r['analytic_elems'] / 1e6:10.2f} M  {r['seconds']:6.2f}")
    a = plan.activation
    L.append(f"  activations ({plan.peak_role}): {a['layers_in_flight']:.0f} layer-microbatches in flight; "
             f"no AC {_gib(a['peak_no_ac_bytes'])}, full AC {_gib(a['peak_full_ac_bytes'])}; "
             f"train.activation_checkpointing={a['activation_checkpointing']}")
    return L


def _comm_lines(plan: Plan) -> list[str]:
    """The communication table of the peak role, the bubble, the axes' link scopes and the predicted step."""
    L = []
    L.append(f"communication per step ({plan.peak_role})")
    L.append("  collective      axis          count        bytes   link        seconds   exposed  what")
    for c in plan.comm:
        secs = f"{c['seconds']:9.4g} {c['exposed_s']:9.4g}" if c["seconds"] is not None else "        -         -"
        L.append(f"  {c['collective']:15s} {c['axis']:12s} {c['count']:6d} {c['bytes'] / GiB:9.3g} GiB  {c['link']:9s} {secs}  {c['what']}")
    sources = sorted({c["source"] for c in plan.comm if c.get("source")})
    for src in sources:
        L.append(f"  link figures: {src}")
    L.append(f"  pipeline bubble: {plan.bubble_fraction:.1%}")
    if plan.axes:
        L.append("  axes (ranks one group spans -> link): " + "; ".join(
            f"{a['axis']}{a['size']} ours {a['ours_span']} -> {a['ours_scope']}, Llama 3 order {a['llama3_span']} -> "
            f"{a['llama3_scope']}" for a in plan.axes))
    s = plan.step
    if "step_s" in s:
        L.append(f"  step ({s['slowest_role']}): compute {s['compute_s']:.3g} s + recompute {s['recompute_s']:.3g} s + "
                 f"memory-bound ops {s['memory_bound_s']:.3g} s + interference {s['interference_s']:.3g} s + "
                 f"host {s['host_s']:.3g} s + exposed comm {s['comm_exposed_s']:.3g} s + bubble {s['bubble_s']:.3g} s + dp tail "
                 f"{s['dp_exposed_s']:.3g} s + optimizer {s['optimizer_s']:.3g} s = {s['step_s']:.3g} s predicted ({s['tokens_per_s']:.4g} tokens/s"
                 + (f", {mfu_text(s['mfu'])})" if "mfu" in s else ")"))
        L.append(f"  matmul {s['matmul_tflops']:.4g} TFLOP/s {s['dtype']}: {s['matmul_source']}; {s['overlap']}")
        if s.get("memory_bound_s") or s.get("interference_s"):
            L.append(f"  memory-bound ops at {s['hbm_GBps']:.4g} GB/s: {H.HBM_SOURCE}; interference: a hidden collective "
                     f"takes {s['comm_sm_share']:.1%} of the compute beside it ({H.COMM_SMS_SOURCE})")
    return L


def _checkpoint_lines(plan: Plan) -> list[str]:
    """The checkpoint lines: size, write and blocking time, interval, restart and expected goodput, with sources."""
    k = plan.checkpoint
    return [
        f"checkpoint: {k['bytes_per_rank'] / 1e9:.2f} GB per rank, {k['bytes_total'] / 1e12:.3f} TB total; write "
        f"{k['write_s']:.1f} s, blocking {k['blocking_s']:.3f} s; job MTBF {k['mtbf_s'] / 3600:.2f} h -> Daly "
        f"{k['daly_interval_s']:.0f} s (Young {k['young_interval_s']:.0f} s); interval used {k['interval_s']:.0f} s"
        + (f" = {k['interval_steps']} steps" if k["interval_steps"] else "")
        + ("" if k["save_known"] else f" ({INTERVAL_LOWER_BOUND})")
        + f"; restart {restart_text(k)}; expected goodput {goodput_text(plan.goodput_expected)}",
        f"  blocking save from: {k['blocking_source']}",
        f"  restart from: {k['restart_source']}",
    ]
