"""Measures this machine for the planner (`python -m jobs.calibrate` is its entry point): the achieved
matmul rate of the model's own shapes with every local rank busy at once, each collective's latency
and bus bandwidth over the real backend between the ranks of a small job, the host copy bandwidth,
and the run filesystem's write bandwidth and write+fsync cost. The figures go into a cluster profile
under the keys `jobs.config.ClusterConfig` names (`calibrated`, `matmul_tflops`, `collectives`,
`host_copy_GBps`, `fs_write_GBps`, `fs_fsync_s`).

The ranks are `launcher.tasks_per_node` processes forked on this machine (gloo on CPU, NCCL on
CUDA), as the local launcher starts them; all of them time the model at once, so on a CPU box where
8 ranks share 2 cores the rate is the one each rank gets when all are busy, as in training.
Collectives are timed over the whole job (scope "intra": one node) at a few sizes and fitted with
t = alpha + bytes / bus_bandwidth (bytes one rank sends: the nccl-tests bus-bandwidth convention).
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import signal
import socket
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from jobs.config import JobConfig, ModelConfig
from jobs.planner import arith as P
from jobs.planner.hardware import OPS, compute_bytes, compute_dtype, hops
from jobs.planner.steptime import stage_flops

__all__ = ["calibrate", "COLLECTIVE_SIZES", "sent_bytes"]

COLLECTIVE_SIZES = (1024, 256 * 1024, 2 * 1024 * 1024)  # bytes of the full buffer per call
PP_PROBE_MICROBATCHES = 4  # microbatches of the pipeline probe's 1F1B step
# Repeats at least, of the probes whose one repeat is slow and noisy (DTensor's many small collectives):
# on the 2-core box, 4 ranks, one tp 2 microbatch under FSDP2 took 70-210 ms more than without it.
MIN_REPS_SLOW = 9


def sent_bytes(op: str, size: int, n: int) -> float:
    """Bytes one rank sends for a collective over a `size`-byte buffer among n ranks (ring algorithms)."""
    ring = (n - 1) / n
    return {"all_reduce": 2 * ring * size, "send_recv": float(size)}.get(op, ring * size)


def _timed(fn, *, seconds: float, sync) -> float:
    """Median seconds of `fn` over about `seconds` of repeats, after two warm-up calls."""
    fn(), fn()
    sync()
    times, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_rate(
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

    secs = _timed(step, seconds=seconds, sync=sync)
    stages = [P.StageShape(tuple(range(m.n_layers)), True, True)]
    _, train, _ = stage_flops(m, stages, tokens=micro_batch * seq_len, seq_len=seq_len, tp=1, recomputed=[])
    return train / secs / 1e12


def _optimizer_ns(cfg: JobConfig, *, n: int, device, seconds: float, sync) -> float:
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
    return _timed_together(step, seconds=seconds, sync=sync, device=device) / max(local, 1) * 1e9


def _paired_together(a, b, *, seconds: float, sync, device, min_reps: int = 5) -> float:
    """Median over repeats of (seconds of `b` - seconds of `a`), run back to back in each repeat and
    every rank at once (a barrier before each pair): the machine's speed, which moves from second to
    second on a shared box, is the same for both halves of a pair."""
    import torch.distributed as dist

    for fn in (a, b, a, b):
        fn(), sync()
    t0 = time.perf_counter()
    a(), b(), sync()
    reps = int(min(max(seconds / max(time.perf_counter() - t0, 1e-6), min_reps), 200))
    reps = _agreed(reps, device=device)
    diffs = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        a(), sync()
        t1 = time.perf_counter()
        b(), sync()
        diffs.append((time.perf_counter() - t1) - (t1 - t0))
    return statistics.median(diffs)


def _agreed(value: int, *, device) -> int:
    """The smallest of every rank's `value` (a repeat count: each rank makes that many collective calls);
    on `device`, which NCCL needs."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _fsdp_extra_s(cfg: JobConfig, *, tp: int, n: int, device, seconds: float, sync) -> float:
    """Seconds that FSDP2 adds to one microbatch's forward + backward: the model under fully_shard (per
    block and at the root, as parallel/fsdp.py) over the job's n / tp ranks, less the same model
    without it, paired; with tp > 1 both are under the real tensor parallelism first, as
    parallel/recipe.py orders them. The caller takes the gathers' and reductions' alpha-beta time out
    (`_fsdp_unit_host_s`). With tp = n FSDP shards over a mesh axis of size 1 (no bytes move)."""
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

    return _paired_together(
        step(build(False)), step(build(True)), seconds=seconds, sync=sync, device=device, min_reps=MIN_REPS_SLOW
    )


def _fsdp_unit_host_s(cfg: JobConfig, *, tp: int, extra_s: float, collectives: dict) -> float:
    """Seconds of one FSDP2 unit per microbatch beyond the alpha-beta time of its collectives: what
    `_fsdp_extra_s` measured less the gathers and reductions of one microbatch over n / tp ranks as
    the fitted links time them, over the model's units (its blocks and the root). That is the hooks,
    the copies into and out of the buffers, and what the collectives cost inside a step beyond their
    time alone (gloo's thread competes with the compute for the cores; peers arrive apart): measured
    2026-12-03 on the 2-core box, 2 ranks, tiny, 2.3 ms per unit of which 1.6 ms with no bytes moving;
    at tp 2 on 4 ranks about 4x that (FSDP2 over DTensor parameters)."""
    from jobs.config import ClusterConfig
    from jobs.planner.hardware import hardware

    m, t, n = cfg.model, cfg.train, cfg.launcher.tasks_per_node
    stages = [P.StageShape(tuple(range(m.n_layers)), True, True)]
    hw = hardware(ClusterConfig(matmul_tflops={"x": 1.0}, collectives=collectives), dtype="x", tasks_per_node=n)
    comm = sum(
        hw.link(it.collective, "intra").seconds(calls=it.count, nbytes=it.bytes, op=it.collective, group=it.group)
        for it in P.comm_per_step(
            m,
            stages,
            pp=1,
            dp_replicate=1,
            fsdp=n // tp,
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
        if it.axis == "dp_shard"
    )
    return max(0.0, extra_s - comm) / (m.n_layers + 1)


def _pp_action_seconds(cfg: JobConfig, *, rank: int, pair, device, seconds: float, sync) -> tuple[float, float] | None:
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
    step_s = _timed_together(step, seconds=seconds, sync=sync, device=device, group=pair)
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

    return step_s, _timed_together(exchange, seconds=seconds / 2, sync=sync, device=device, group=pair)


def _pp_action_host_s(cfg: JobConfig, step_s: float, exchange_s: float, *, rate_tflops: float) -> float:
    """Host seconds per pipeline action: the probe's step less its linear layers' FLOPs at the
    measured rate and its sends (a microbatch's activation out and its gradient back: one exchange per
    microbatch), over its 2 x microbatches actions (each rank runs a forward and a backward per microbatch)."""
    m, t, mb = cfg.model, cfg.train, PP_PROBE_MICROBATCHES
    compute = 3 * 2.0 * mb * t.micro_batch * t.seq_len * m.dim * m.dim / (rate_tflops * 1e12)
    return max(0.0, step_s - compute - mb * exchange_s) / (2 * mb)


def _tp_seconds(cfg: JobConfig, *, tp: int, n: int, device, seconds: float, sync) -> float:
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

    return _timed_together(step, seconds=seconds, sync=sync, device=device, min_reps=MIN_REPS_SLOW)


def _tp_rate(cfg: JobConfig, tp: int, seconds: float, collectives: dict) -> float:
    """TFLOP/s of one tp shard's compute under DTensor: the measured microbatch less its TP
    collectives as the fitted alpha-beta model times them (at least a quarter of it stays compute)."""
    from jobs.config import ClusterConfig
    from jobs.planner.hardware import hardware

    m, t = cfg.model, cfg.train
    stages = [P.StageShape(tuple(range(m.n_layers)), True, True)]
    hw = hardware(ClusterConfig(matmul_tflops={"x": 1.0}, collectives=collectives), dtype="x", tasks_per_node=tp)
    comm = 0.0
    for it in P.comm_per_step(
        m,
        stages,
        pp=1,
        dp_replicate=1,
        fsdp=1,
        tp=tp,
        cp=1,
        ep=1,
        microbatches=1,
        seq_len=t.seq_len,
        micro_batch=t.micro_batch,
        activation_checkpointing="none",
        sequence_parallel=cfg.mesh.sequence_parallel,
        compute_bytes=compute_bytes(cfg),
    ):
        comm += hw.link(it.collective, "intra").seconds(calls=it.count, nbytes=it.bytes, op=it.collective, group=tp)
    _, train, _ = stage_flops(m, stages, tokens=t.micro_batch * t.seq_len, seq_len=t.seq_len, tp=tp, recomputed=[])
    return train / max(seconds - comm, seconds / 4) / 1e12


def _collective(op: str, size: int, *, n: int, rank: int, device, seconds: float, sync, group=None) -> float:
    """Median seconds of one `op` over a `size`-byte buffer in this rank's group of n ranks (every
    group of the job runs it at the same time, as the groups of one mesh axis do in training)."""
    import torch
    import torch.distributed as dist

    elems = max(size // 4, n)
    elems -= elems % n
    buf = torch.ones(elems, device=device)
    out = torch.empty(elems, device=device)
    part = torch.empty(elems // n, device=device)
    me = dist.get_group_rank(group, rank) if group is not None else rank

    def call():
        if op == "all_reduce":
            dist.all_reduce(buf, group=group)
        elif op == "all_gather":
            dist.all_gather_into_tensor(out, buf[: elems // n], group=group)
        elif op == "reduce_scatter":
            dist.reduce_scatter_tensor(part, buf, group=group)
        elif op == "all_to_all":
            dist.all_to_all_single(out, buf, group=group)
        else:  # send_recv: pairs (0, 1), (2, 3), ... exchange the buffer, as pipeline neighbours do
            peer = me ^ 1
            if peer < n:
                peer = dist.get_global_rank(group, peer) if group is not None else peer
                ops = [dist.P2POp(dist.isend, buf, peer, group=group), dist.P2POp(dist.irecv, out, peer, group=group)]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()

    return _timed_together(call, seconds=seconds, sync=sync, device=device, group=group)


def _timed_together(fn, *, seconds: float, sync, device, group=None, min_reps: int = 3) -> float:
    """Median seconds of `fn` when it holds collectives: every rank of `group` (default: all) makes the
    same number of calls (agreed from the slowest rank's first call), each starting together after a
    barrier. Ranks outside `group` do not take part (an odd rank out of the pairs)."""
    import torch
    import torch.distributed as dist

    fn(), sync()
    t0 = time.perf_counter()
    fn(), sync()
    first = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
    reps = int(min(max(seconds / max(float(first), 1e-6), min_reps), 200))
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fit_op(op: str, ranks: list[dict], n: int) -> dict[str, float]:
    """alpha and bus bandwidth on groups of n, and the latency per extra ring hop from groups of 2."""
    fits = {}
    for g in (n, 2):
        key = f"{op}.{g}"
        if key in ranks[0]["collectives"]:
            rows = [r["collectives"][key] for r in ranks if key in r["collectives"]]
            fits[g] = _fit(
                [(sent_bytes(op, size, g), max(r[i][1] for r in rows)) for i, (size, _) in enumerate(rows[0])]
            )
    out = {**fits[n], "ranks": float(n), "alpha_hop_s": 0.0}
    if 2 in fits and hops(op, n) > hops(op, 2):
        out["alpha_hop_s"] = round(max(0.0, (fits[n]["alpha_s"] - fits[2]["alpha_s"]) / (hops(op, n) - hops(op, 2))), 9)
    return out


def _fit(points: list[tuple[float, float]]) -> dict[str, float]:
    """Least squares t = alpha + x / (bus * 1e9) over (bytes sent, seconds)."""
    xs, ts = [p[0] for p in points], [p[1] for p in points]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts)) / var if var else 0.0
    alpha = max(mt - slope * mx, min(ts) * 0.01)
    bus = 1.0 / (slope * 1e9) if slope > 0 else float("inf")
    return {"alpha_s": round(alpha, 9), "bus_GBps": round(bus, 4)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, n: int, port: int, cfg: JobConfig, tps: list[int], q) -> None:
    """One calibration rank: the model's rate at every tp shard (all ranks at once), then each collective."""
    import faulthandler
    import warnings

    import torch
    import torch.distributed as dist

    faulthandler.enable()  # a rank killed by a fault prints where (the parent names the signal)
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor / reduce_scatter_tensor
    try:
        cuda = cfg.cluster.gpus_per_node > 0 and torch.cuda.is_available()
        device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        torch.set_num_threads(cfg.launcher.threads_per_rank or max(1, (os.cpu_count() or 1) // n))
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=n
        )
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        secs, t = cfg.calibrate.seconds, cfg.train
        dtype = compute_dtype(t.mixed_precision, gpus_per_node=cfg.cluster.gpus_per_node)
        out: dict = {"rates": {}, "collectives": {}}
        dist.barrier()
        out["rates"][1] = _matmul_rate(
            cfg.model,
            micro_batch=t.micro_batch,
            seq_len=t.seq_len,
            dtype_name=dtype,
            device=device,
            seconds=secs,
            sync=sync,
        )
        pairs = [dist.new_group([r, r + 1]) for r in range(0, n - 1, 2)]  # every rank creates every group
        pair = pairs[rank // 2] if rank // 2 < len(pairs) else None  # None: the odd rank out
        groups = {n: None}
        if n > 2:  # pairs too: a ring's latency grows with its hops, fitted from both group sizes
            groups[2] = pair
        for op in OPS:
            for g, grp in groups.items():
                if g != n and grp is None:  # the odd rank out of the pairs
                    continue
                out["collectives"][f"{op}.{g}"] = [
                    (size, _collective(op, size, n=g, rank=rank, device=device, seconds=secs / 3, sync=sync, group=grp))
                    for size in COLLECTIVE_SIZES
                ]
        out["optimizer_ns"] = _optimizer_ns(cfg, n=n, device=device, seconds=secs / 2, sync=sync)
        out["fsdp_extra_s"] = {tp: _fsdp_extra_s(cfg, tp=tp, n=n, device=device, seconds=secs, sync=sync) for tp in tps}
        out["pp_step_s"] = _pp_action_seconds(cfg, rank=rank, pair=pair, device=device, seconds=secs / 2, sync=sync)
        out["tp_seconds"] = {
            tp: _tp_seconds(cfg, tp=tp, n=n, device=device, seconds=secs, sync=sync) for tp in tps if tp > 1
        }
        q.put((rank, out))
    except BaseException as e:  # reported to the parent, which fails the calibration
        q.put((rank, f"{type(e).__name__}: {e}"))
    _leave_together()


def _leave_together() -> None:
    """Close the group only when every rank is done measuring (a barrier), and never fail a rank
    that has already reported: its figures are in the parent's queue, and a peer that failed is
    reported by that peer."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def _tps(cfg: JobConfig) -> list[int]:
    """tp degrees whose shard shapes are timed: 1 and every power of two that divides the ranks and the model."""
    m, n, out, tp = cfg.model, cfg.launcher.tasks_per_node, [1], 2
    while tp <= n:
        if not (n % tp or m.n_heads % tp or m.n_kv_heads % tp or m.ffn_dim % tp or m.vocab_size % tp):
            out.append(tp)
        tp *= 2
    return out


def _run_ranks(cfg: JobConfig) -> list[dict]:
    import torch.distributed.pipelining  # noqa: F401 - torch (and _dynamo) once in the parent, not in every forked rank

    ctx = mp.get_context("fork")
    q, n, port = ctx.Queue(), cfg.launcher.tasks_per_node, _free_port()
    procs = [ctx.Process(target=_rank, args=(r, n, port, cfg, _tps(cfg), q)) for r in range(n)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + 600
    while len(results) < n and time.monotonic() < deadline:
        try:
            rank, value = q.get(timeout=1.0)
            results[rank] = value
        except Exception:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
    for p in procs:
        p.join(timeout=10)
        if p.exitcode is None:
            p.kill()
    bad = {r: v for r, v in results.items() if isinstance(v, str)}
    bad.update({r: _silent_exit(p.exitcode) for r, p in enumerate(procs) if r not in results})
    if bad:
        raise RuntimeError(f"calibration ranks failed: {dict(sorted(bad.items()))}")
    return [results[r] for r in range(n)]


def _silent_exit(code: int | None) -> str:
    """What a rank that reported nothing did: the rank that failed first when the others only name
    a closed connection (a signal: SIGSEGV, SIGABRT from a gloo enforce, SIGKILL from the OOM killer)."""
    if code is None:
        return "no report within the calibration's 600 s (killed)"
    if code < 0:
        return (
            f"exited by {signal.Signals(-code).name} without a report (a fault prints its traceback on the rank stderr)"
        )
    return f"exited with code {code} without a report"


def _host_copy_GBps(seconds: float) -> float:
    """Device-to-host (CUDA, pinned) or host memory copy bandwidth: what an async save's staging copy moves at."""
    import torch

    n = 64 * 2**20
    if torch.cuda.is_available():
        src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, pin_memory=True)
        sync = torch.cuda.synchronize
    else:
        src, dst, sync = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8), (lambda: None)
    return n / _timed(lambda: dst.copy_(src), seconds=seconds, sync=sync) / 1e9


def _fs(run_root: str, seconds: float) -> tuple[float, float]:
    """(write GB/s of a 64 MiB file with fsync, seconds of a small write + fsync + rename) on `run_root`."""
    root = Path(run_root)
    root.mkdir(parents=True, exist_ok=True)
    data = os.urandom(64 * 2**20)
    with tempfile.TemporaryDirectory(dir=root, prefix=".calibrate-") as d:
        big, small, final = Path(d) / "big", Path(d) / "small.tmp", Path(d) / "small"

        def write(path: Path, payload: bytes) -> None:
            with open(path, "wb") as f:
                f.write(payload)
                f.flush()
                os.fsync(f.fileno())

        bw = len(data) / _timed(lambda: write(big, data), seconds=seconds, sync=lambda: None) / 1e9
        commit = _timed(lambda: (write(small, b"{}"), os.replace(small, final)), seconds=seconds / 2, sync=lambda: None)
    return bw, commit


def calibrate(cfg: JobConfig, *, command: str) -> dict:
    """Measures and returns the profile keys (see the module docstring)."""
    ranks = _run_ranks(cfg)
    n = cfg.launcher.tasks_per_node
    dtype = compute_dtype(cfg.train.mixed_precision, gpus_per_node=cfg.cluster.gpus_per_node)
    collectives = {f"{op}.intra": _fit_op(op, ranks, n) for op in OPS}
    rates = {1: statistics.median(r["rates"][1] for r in ranks)}
    for tp in ranks[0]["tp_seconds"]:
        rates[tp] = _tp_rate(cfg, tp, statistics.median(r["tp_seconds"][tp] for r in ranks), collectives)
    fs_bw, fsync = _fs(cfg.cluster.run_root, cfg.calibrate.seconds)
    pp = [r["pp_step_s"] for r in ranks if r["pp_step_s"] is not None]  # one rank alone has no pipeline probe
    when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    matmul = {dtype: round(rates[1], 6), **{f"{dtype}.tp{tp}": round(v, 6) for tp, v in rates.items() if tp > 1}}
    return {
        "calibrated": f"{when} `{command}` ({n} ranks busy on {os.cpu_count()} cores, model {cfg.model.name}, "
        f"micro_batch {cfg.train.micro_batch} x seq_len {cfg.train.seq_len})",
        "matmul_tflops": matmul,
        "collectives": collectives,
        "optimizer_ns_per_param": round(statistics.median(r["optimizer_ns"] for r in ranks), 4),
        "fsdp_unit_host_s": {
            f"tp{tp}": round(
                _fsdp_unit_host_s(
                    cfg, tp=tp, collectives=collectives, extra_s=statistics.median(r["fsdp_extra_s"][tp] for r in ranks)
                ),
                7,
            )
            for tp in ranks[0]["fsdp_extra_s"]
        },
        "pp_action_host_s": round(
            _pp_action_host_s(
                cfg, statistics.median(p[0] for p in pp), statistics.median(p[1] for p in pp), rate_tflops=rates[1]
            ),
            7,
        )
        if pp
        else 0.0,
        "host_copy_GBps": round(_host_copy_GBps(cfg.calibrate.seconds), 3),
        "fs_write_GBps": round(fs_bw, 3),
        "fs_fsync_s": round(fsync, 6),
    }


def write_profile(cfg: JobConfig, figures: dict, out: Path, *, conf_dir: Path) -> Path:
    """The profile `cfg.cluster` came from (its comments kept), with `figures` set; written to `out`."""
    import yaml

    src = conf_dir / "cluster" / f"{cfg.cluster.name}.yaml"
    base = out if out.exists() else src
    text = base.read_text() if base.exists() else ""
    ours = ("# Measured by python -m jobs.calibrate", "# fs_write_GBps, fs_fsync_s (see")
    header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#") and not line.startswith(ours))
    data = yaml.safe_load(text) or {} if text else {}
    data = {**data, **copy.deepcopy(figures)}
    if out.parent.resolve() == (conf_dir / "cluster").resolve():
        data["name"] = out.stem
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        header + "# Measured by python -m jobs.calibrate: calibrated, matmul_tflops, collectives, host_copy_GBps,\n"
        "# fs_write_GBps, fs_fsync_s (see `calibrated` for when and how).\n"
        + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    )
    return out
