"""Calibration's collective probe: the seconds of each collective at a few buffer sizes over the real backend
(gloo on CPU, NCCL on CUDA), as the groups of one mesh axis run it in training."""

from __future__ import annotations

from jobs.planner.timing import timed_together

__all__ = ["COLLECTIVE_SIZES", "collective_call", "sent_bytes", "time_collective"]

COLLECTIVE_SIZES = (1024, 256 * 1024, 2 * 1024 * 1024)  # bytes of the full buffer per call


def sent_bytes(op: str, size: int, n: int) -> float:
    """Bytes one rank sends for a collective over a `size`-byte buffer among n ranks (ring algorithms)."""
    ring = (n - 1) / n
    return {"all_reduce": 2 * ring * size, "send_recv": float(size)}.get(op, ring * size)


def collective_call(op: str, size: int, *, n: int, rank: int, device, group=None):
    """A function that issues one `op` over a `size`-byte fp32 buffer in this rank's group of n ranks."""
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

    return call


def time_collective(op: str, size: int, *, n: int, rank: int, device, seconds: float, sync, group=None) -> float:
    """Median seconds of one `op` over a `size`-byte buffer in this rank's group of n ranks (every
    group of the job runs it at the same time, as the groups of one mesh axis do in training)."""
    call = collective_call(op, size, n=n, rank=rank, device=device, group=group)
    return timed_together(call, seconds=seconds, sync=sync, device=device, group=group)
