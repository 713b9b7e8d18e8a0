"""Calibration's model probes, run on every rank at once: the model's matmul rate, the optimizer's step tail,
what FSDP2 and tensor parallelism add to a microbatch, and a two-stage pipeline's step and activation exchange."""

from __future__ import annotations

from jobs.config import JobConfig, ModelConfig
from jobs.planner import arith as P
from jobs.planner.steptime import stage_flops
from jobs.planner.timing import paired_together, timed, timed_together

__all__ = [
    "MIN_REPS_SLOW",
    "PP_PROBE_MICROBATCHES",
    "fsdp_extra_s",
    "matmul_rate",
    "optimizer_ns",
    "pp_action_seconds",
    "tp_seconds",
]

PP_PROBE_MICROBATCHES = 4  # microbatches of the pipeline probe's 1F1B step
# Repeats at least, of the probes whose one repeat is slow and noisy (DTensor's many small collectives):
# on the 2-core box, 4 ranks, one tp 2 microbatch under FSDP2 took 70-210 ms more than without it.
MIN_REPS_SLOW = 9


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


def fsdp_extra_s(cfg: JobConfig, *, tp: int, n: int, device, seconds: float, sync) -> float:
    """Seconds that FSDP2 adds to one microbatch's forward + backward: the model under fully_shard (per
    block and at the root, as parallel/fsdp.py) over the job's n / tp ranks, less the same model
    without it, paired; with tp > 1 both are under the real tensor parallelism first, as
    parallel/recipe.py orders them. The caller takes the gathers' and reductions' alpha-beta time out
    (`fsdp_unit_host_s`). With tp = n FSDP shards over a mesh axis of size 1 (no bytes move)."""
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

    return paired_together(
        step(build(False)), step(build(True)), seconds=seconds, sync=sync, device=device, min_reps=MIN_REPS_SLOW
    )


def pp_action_seconds(cfg: JobConfig, *, rank: int, pair, device, seconds: float, sync) -> tuple[float, float] | None:
    """(seconds of one 1F1B step of a two-stage pipeline whose stages are one small linear layer each,
    seconds of one exchange of a microbatch's activation between the two ranks) on this rank's `pair`
    (ranks 0-1, 2-3, ...; None for an odd last rank, which returns None). The exchange is timed right
    after the step, on the same ranks and bytes, so that the caller takes the sends out of the step with
    their cost of this moment (the send_recv latency fitted earlier left 0 in 1 of 4 runs on 3 ranks here).
    PP_PROBE_MICROBATCHES microbatches of the model's activation shape."""
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if pair is None:
        return None
    m, t = cfg.model, cfg.train
    me, layer = rank % 2, torch.nn.Linear(m.dim, m.dim).to(device)
    stage = PipelineStage(layer, me, 2, device, group=pair)
    sched = Schedule1F1B(stage, n_microbatches=PP_PROBE_MICROBATCHES, loss_fn=lambda out, _: out.float().pow(2).mean())
    x = torch.randn(PP_PROBE_MICROBATCHES * t.micro_batch, t.seq_len, m.dim, device=device)
    step = (lambda: sched.step(x)) if me == 0 else (lambda: sched.step(target=x))
    step_s = timed_together(step, seconds=seconds, sync=sync, device=device, group=pair)
    buf, out = (
        torch.ones(t.micro_batch, t.seq_len, m.dim, device=device),
        torch.empty(t.micro_batch, t.seq_len, m.dim, device=device),
    )
    peer = dist.get_global_rank(pair, 1 - me)

    def exchange():
        for w in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, buf, peer, group=pair), dist.P2POp(dist.irecv, out, peer, group=pair)]
        ):
            w.wait()

    return step_s, timed_together(exchange, seconds=seconds / 2, sync=sync, device=device, group=pair)


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
