"""Calibration's model probes, run on every rank at once: the model's matmul rate, the optimizer's step tail,
what FSDP2 and tensor parallelism add to a microbatch, and a two-stage pipeline's host time per step."""

from __future__ import annotations

from jobs.config import JobConfig, ModelConfig
from jobs.planner import arith as P
from jobs.planner.collectives import collective_call, sent_bytes
from jobs.planner.hardware import compute_bytes
from jobs.planner.steptime import stage_flops
from jobs.planner.timing import paired_together, timed, timed_together

__all__ = [
    "MIN_REPS_SLOW",
    "PP_MIN_REPS",
    "PP_PROBE_MICROBATCHES",
    "fsdp_collectives",
    "one_stage_items",
    "fsdp_host_s",
    "matmul_rate",
    "optimizer_ns",
    "pp_host_s",
    "tp_seconds",
]

PP_PROBE_MICROBATCHES = 4  # microbatches of the pipeline probe's 1F1B step
# Repeats at least, of the probes whose one repeat is slow and noisy (DTensor's many small collectives):
# on the 2-core box, 4 ranks, one tp 2 microbatch under FSDP2 took 70-210 ms more than without it.
MIN_REPS_SLOW = 9
# Repeats at least, of the pipeline probe: its step took 3-5 ms in some repeats and 12-19 ms in others (the two
# ranks on one core or on two) on the 2-core box, 3 ranks; its host time is ~8 ms of that: 5 repeats gave medians of
# -0.1 and 8.4 ms in two runs.
PP_MIN_REPS = 15


def matmul_rate(
    m: ModelConfig, *, micro_batch: int, seq_len: int, dtype_name: str, device, seconds: float, sync
) -> float:
    """Achieved TFLOP/s of the whole model's forward + backward (unsharded), one microbatch."""
    import torch
    import torch.nn.functional as F

    from jobs.models.model import Transformer

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    model = Transformer(m).to(device=device, dtype=dtype)
    x = torch.randint(0, m.vocab_size, (micro_batch, seq_len), device=device)

    def step():
        F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()

    secs = timed(step, seconds=seconds, sync=sync)
    stages = [P.StageShape(tuple(range(m.n_layers)), True, True)]
    _, train, _ = stage_flops(m, stages, tokens=micro_batch * seq_len, seq_len=seq_len, tp=1, recomputed=[])
    return train / secs / 1e12


def optimizer_ns(cfg: JobConfig, *, n: int, device, seconds: float, sync) -> float:
    """Nanoseconds per local parameter element of the trainer's step tail on FSDP2-sharded parameters
    (over all n ranks): the gradient-norm pass and AdamW's step (foreach on CPU, as the trainer)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from jobs.models.model import Transformer
    from parallel.fsdp import apply_fsdp

    model = Transformer(cfg.model).to(device)
    apply_fsdp(model, init_device_mesh(device.type, (n,), mesh_dim_names=("dp_shard",)), reshard_after_forward=True)
    params = list(model.parameters())
    for p in params:
        p.grad = torch.zeros_like(p)
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

    grads = [p.grad for p in params]

    def step():  # what jobs.trainer's stage_grad_sq_norm and optimizer_step do
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        (norm.full_tensor() if isinstance(norm, DTensor) else norm).item()
        opt.step()

    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params)
    return timed_together(step, seconds=seconds, sync=sync, device=device) / max(local, 1) * 1e9


def one_stage_items(cfg: JobConfig, *, fsdp: int, tp: int) -> list[P.CommItem]:
    """The planner's communication items of one microbatch through every layer on one stage (no pp, cp, ep), over
    `fsdp` x `tp` ranks: what the calibration's probes replay or take out of what they time."""
    m, t = cfg.model, cfg.train
    return P.comm_per_step(
        m,
        [P.StageShape(tuple(range(m.n_layers)), True, True)],
        pp=1,
        dp_replicate=1,
        fsdp=fsdp,
        tp=tp,
        cp=1,
        ep=1,
        microbatches=1,
        seq_len=t.seq_len,
        micro_batch=t.micro_batch,
        activation_checkpointing="none",
        sequence_parallel=cfg.mesh.sequence_parallel,
        compute_bytes=compute_bytes(cfg),
    )


def fsdp_collectives(cfg: JobConfig, *, tp: int, n: int) -> list[P.CommItem]:
    """FSDP2's gathers and reductions of one microbatch over the n / tp ranks of a dp_shard group, as the
    planner counts them (its dp_shard items): what `fsdp_host_s` takes out of what FSDP2 adds."""
    return [it for it in one_stage_items(cfg, fsdp=n // tp, tp=tp) if it.axis == "dp_shard"]


def _replay(items: list[P.CommItem], *, rank: int, device, group):
    """A function that issues `items` alone: each item's calls over buffers of its bytes per call."""
    calls = []
    for it in items:
        size = int(it.bytes / it.count / sent_bytes(it.collective, 1, it.group))
        calls += [collective_call(it.collective, size, n=it.group, rank=rank, device=device, group=group)] * it.count
    return lambda: [c() for c in calls]


def fsdp_host_s(cfg: JobConfig, *, tp: int, n: int, rank: int, device, seconds: float, sync) -> float:
    """Seconds that FSDP2 adds to one microbatch's forward + backward beyond its collectives' own time: in
    each repeat, the model under fully_shard (per block and at the root, as parallel/fsdp.py) over the job's
    n / tp ranks, less the same model without it followed by FSDP's gathers and reductions of one microbatch
    issued alone (`fsdp_collectives`, on the same dp_shard groups); paired, every rank at once. The
    collectives' cost is taken out of the repeat it ran in: timed at another moment it moved (the all_gather's
    fitted latency 0.8 -> 7.8 ms between two runs on a busy box) and the difference went negative. With tp > 1
    both models are under the real tensor parallelism first, as parallel/recipe.py orders them. With tp = n
    FSDP shards over a mesh axis of size 1 (no bytes move, nothing is replayed)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from jobs.models.model import Transformer
    from parallel.fsdp import apply_fsdp
    from parallel.tp import apply_tp

    m, t = cfg.model, cfg.train
    mesh = init_device_mesh(device.type, (n // tp, tp), mesh_dim_names=("dp_shard", "tp"))

    def build(fsdp: bool):
        torch.manual_seed(0)
        model = Transformer(m).to(device)
        if tp > 1:
            apply_tp(model, mesh["tp"], sequence_parallel=cfg.mesh.sequence_parallel, loss_parallel=False)
        if fsdp:
            apply_fsdp(model, mesh["dp_shard"], reshard_after_forward=True)
        return model

    x = torch.randint(0, m.vocab_size, (t.micro_batch, t.seq_len), device=device)

    def step(model):
        return lambda: F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()

    plain, replay = (
        step(build(False)),
        _replay(fsdp_collectives(cfg, tp=tp, n=n), rank=rank, device=device, group=mesh["dp_shard"].get_group()),
    )
    return paired_together(
        lambda: (plain(), replay()),
        step(build(True)),
        seconds=seconds,
        sync=sync,
        device=device,
        min_reps=MIN_REPS_SLOW,
    )


def pp_host_s(cfg: JobConfig, *, rank: int, pair, device, seconds: float, sync) -> float | None:
    """Host seconds of one 1F1B step of a two-stage pipeline whose stages are one small linear layer each, beyond
    its compute and its sends, on this rank's `pair` (ranks 0-1, 2-3, ...; None for an odd last rank, which
    returns None): in each repeat, the step less this stage's forward + backward of its
    PP_PROBE_MICROBATCHES microbatches (the model's activation shape) run alone and the exchange of every
    microbatch's activation with the peer (its activation out and its gradient back), posted at once; paired,
    both ranks at once, so that the compute and the sends come out at their cost of that moment (a send_recv
    latency fitted earlier, or a matmul rate timed first, left 0 in 1 of 4 runs on 3 ranks here)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if pair is None:
        return None
    m, t, mb = cfg.model, cfg.train, PP_PROBE_MICROBATCHES
    me, layer, alone = rank % 2, torch.nn.Linear(m.dim, m.dim).to(device), torch.nn.Linear(m.dim, m.dim).to(device)
    stage = PipelineStage(layer, me, 2, device, group=pair)
    sched = Schedule1F1B(stage, n_microbatches=mb, loss_fn=lambda out, _: out.float().pow(2).mean())
    x = torch.randn(mb * t.micro_batch, t.seq_len, m.dim, device=device)
    step = (lambda: sched.step(x)) if me == 0 else (lambda: sched.step(target=x))
    xs = [c.detach().requires_grad_(True) for c in x.chunk(mb)]  # stage 1's input takes a gradient: 3 matmuls
    peer = dist.get_global_rank(pair, 1 - me)
    # Every microbatch's exchange posted at once and waited together, as the schedule's sends overlap its compute:
    # one after the other, each waited for both ranks to be on a core at once, and on a busy box the four cost more
    # than the whole step (the figure came out -1.7 ms with two busy loops beside the ranks).
    sends = [
        op
        for c in xs
        for op in (
            dist.P2POp(dist.isend, torch.ones_like(c), peer, group=pair),
            dist.P2POp(dist.irecv, torch.empty_like(c), peer, group=pair),
        )
    ]

    def parts():
        for c in xs:
            alone(c).float().pow(2).mean().backward()
        for w in dist.batch_isend_irecv(sends):
            w.wait()

    return paired_together(parts, step, seconds=seconds, sync=sync, device=device, group=pair, min_reps=PP_MIN_REPS)


def tp_seconds(cfg: JobConfig, *, tp: int, n: int, device, seconds: float, sync) -> float:
    """Seconds of one microbatch's forward + backward of the model under the real tensor parallelism
    (parallel.tp.apply_tp, DTensor) on groups of tp ranks: the shard's compute, DTensor's own cost
    per op, and the TP collectives (which the caller takes out again with the fitted link model)."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from jobs.models.model import Transformer
    from parallel.tp import apply_tp

    m, t = cfg.model, cfg.train
    mesh = init_device_mesh(device.type, (n // tp, tp), mesh_dim_names=("dp", "tp"))
    model = Transformer(m).to(device)
    apply_tp(model, mesh["tp"], sequence_parallel=cfg.mesh.sequence_parallel, loss_parallel=False)
    x = torch.randint(0, m.vocab_size, (t.micro_batch, t.seq_len), device=device)

    def step():
        F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()

    return timed_together(step, seconds=seconds, sync=sync, device=device, min_reps=MIN_REPS_SLOW)
