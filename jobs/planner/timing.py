"""Timing for calibration: the median of repeats, alone (`timed`) or with every rank of a group starting
together after a barrier (`timed_together`, `paired_together`), and the repeat count all ranks agree on."""

from __future__ import annotations

import statistics
import time

__all__ = ["agreed_min", "paired_together", "timed", "timed_together"]


def timed(fn, *, seconds: float, sync) -> float:
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


def timed_together(fn, *, seconds: float, sync, device, group=None, min_reps: int = 3) -> float:
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


def paired_together(a, b, *, seconds: float, sync, device, group=None, min_reps: int = 5) -> float:
    """Median over repeats of (seconds of `b` - seconds of `a`), run back to back in each repeat and
    every rank of `group` (default: all) at once: the machine's speed, which moves from second to second on a
    shared box, is the same for both halves of a pair. Each half starts after a barrier: with one barrier per pair,
    the ranks leaving it apart (milliseconds on a busy box) made the first collective of `a` wait for the last
    rank, and `b` - `a` came out negative (-10 ms for the pipeline probe with four busy loops beside it)."""
    import torch.distributed as dist

    for fn in (a, b, a, b):
        fn(), sync()
    t0 = time.perf_counter()
    a(), b(), sync()
    reps = int(min(max(seconds / max(time.perf_counter() - t0, 1e-6), min_reps), 200))
    reps = agreed_min(reps, device=device, group=group)
    diffs = []
    for _ in range(reps):
        halves = []
        for fn in (a, b):  # a barrier before each: the spread of the ranks leaving it lands in both halves alike
            dist.barrier(group=group)
            t0 = time.perf_counter()
            fn(), sync()
            halves.append(time.perf_counter() - t0)
        diffs.append(halves[1] - halves[0])
    return statistics.median(diffs)


def agreed_min(value: int, *, device, group=None) -> int:
    """The smallest of every rank's `value` in `group` (default: all; a repeat count: each rank makes that many
    collective calls); on `device`, which NCCL needs."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())
