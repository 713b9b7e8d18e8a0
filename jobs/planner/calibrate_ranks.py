"""The calibration's ranks: `launcher.tasks_per_node` processes forked on this machine, as the local launcher
starts them, each running every probe; `run_ranks` collects their raw timings and names a rank that failed."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

from jobs.config import JobConfig
from jobs.planner.collectives import COLLECTIVE_SIZES, time_collective
from jobs.planner.hardware import OPS, compute_dtype
from jobs.planner.probes import fsdp_host_s, matmul_rate, optimizer_ns, pp_host_s, tp_seconds
from parallel.store import forked_store

__all__ = ["run_ranks"]


def _time_collectives(rank: int, n: int, pair, *, device, seconds: float, sync) -> dict[str, list]:
    """Every op's (size, seconds) at COLLECTIVE_SIZES over the world and, with more than 2 ranks, over this rank's
    `pair` too (a ring's latency grows with its hops, fitted from both group sizes); the odd rank out (`pair` None)
    times the world only."""
    groups = {n: None}
    if n > 2:
        groups[2] = pair
    timed: dict[str, list] = {}
    for op in OPS:
        for g, grp in groups.items():
            if g != n and grp is None:  # the odd rank out of the pairs
                continue
            timed[f"{op}.{g}"] = [
                (size, time_collective(op, size, n=g, rank=rank, device=device, seconds=seconds, sync=sync, group=grp))
                for size in COLLECTIVE_SIZES
            ]
    return timed


def _rank(rank: int, n: int, port, cfg: JobConfig, tps: list[int], q) -> None:
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
            "nccl" if cuda else "gloo", store=forked_store(rank, n, port, timeout_s=300.0), rank=rank, world_size=n
        )
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        secs, t = cfg.calibrate.seconds, cfg.train
        dtype = compute_dtype(t.mixed_precision, gpus_per_node=cfg.cluster.gpus_per_node)
        out: dict = {"rates": {}, "collectives": {}}
        dist.barrier()
        out["rates"][1] = matmul_rate(
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
        out["collectives"] = _time_collectives(rank, n, pair, device=device, seconds=secs / 3, sync=sync)
        out["optimizer_ns"] = optimizer_ns(cfg, n=n, device=device, seconds=secs / 2, sync=sync)
        out["fsdp_host_s"] = {
            tp: fsdp_host_s(cfg, tp=tp, n=n, rank=rank, device=device, seconds=secs, sync=sync) for tp in tps
        }
        out["pp_host_s"] = pp_host_s(cfg, rank=rank, pair=pair, device=device, seconds=secs / 2, sync=sync)
        out["tp_seconds"] = {
            tp: tp_seconds(cfg, tp=tp, n=n, device=device, seconds=secs, sync=sync) for tp in tps if tp > 1
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


def _reports_left(q) -> dict[int, object]:
    """What is still in the queue once the ranks ended (each rank's queue is flushed when it exits)."""
    left: dict[int, object] = {}
    while True:
        try:
            rank, value = q.get(timeout=0.2)
        except Exception:  # noqa: BLE001 - queue.Empty: every report is read
            return left
        left[rank] = value


def run_ranks(cfg: JobConfig) -> list[dict]:
    import torch.distributed.pipelining  # noqa: F401 - torch (and _dynamo) once in the parent, not in every forked rank

    ctx = mp.get_context("fork")
    q, n, port = ctx.Queue(), cfg.launcher.tasks_per_node, ctx.Value("i", 0)  # the port rank 0 binds: parallel.store
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
    results.update(_reports_left(q))  # the peers' reports sent after the first rank died, before they exited
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
