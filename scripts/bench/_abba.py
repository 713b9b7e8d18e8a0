"""The step-time benchmarks' shared method: two variants of a model on the same forked gloo ranks, forward+backward
steps after a barrier (the slowest rank's time), warmed up, then in ABBA blocks so drift in load hits both alike."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from _fork import join_group, published_port, run_forked_ranks  # scripts/bench is on sys.path when run as a script

from jobs.trainer import cross_entropy


def step_time(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """One forward+backward after a barrier; the slowest rank's seconds."""
    dist.barrier()
    t0 = time.perf_counter()
    cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    dt = torch.tensor(time.perf_counter() - t0)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def abba_medians(
    models: dict[str, torch.nn.Module], x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace
) -> tuple[dict[str, float], int]:
    """Each of the two `models` warmed up (--warmup steps), then --rounds rounds of a --block-step block of each,
    the order reversed every other round; the median step time of each and the steps each median is of."""
    names = list(models)
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        for _ in range(args.warmup):
            step_time(models[n], x, y)
    for r in range(args.rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            times[n] += [step_time(models[n], x, y) for _ in range(args.block)]
    return {n: statistics.median(ts) for n, ts in times.items()}, len(times[names[0]])


def abba_main(
    p: argparse.ArgumentParser,
    *,
    world: Callable[[argparse.Namespace], int],
    body: Callable[[int, argparse.Namespace], None],
) -> int:
    """Adds --rounds/--block/--warmup to `p`, parses, and runs `body(rank, args)` on `world(args)` forked ranks, one
    torch thread each, inside gloo's default group; the exit code (1 when a rank failed)."""
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--block", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    port, n = published_port(), world(args)

    def rank_main(rank: int) -> None:
        torch.set_num_threads(1)
        join_group(rank, n, port, timeout_s=300)
        body(rank, args)
        dist.destroy_process_group()

    return 1 if run_forked_ranks(n, rank_main) else 0
