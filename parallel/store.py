"""The store forked ranks on one machine meet at: rank 0 opens it on a port the kernel picks and publishes the port
in shared memory made before the fork (a `multiprocessing` Value); the others wait for it, then connect. A port
picked free by the parent and bound later by rank 0 can be taken in between by another process (a concurrent run's
gloo sockets). The launcher's ranks, which may be on other hosts, publish it in the run dir instead
(jobs/launch/rendezvous.py)."""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["forked_store"]


def forked_store(rank: int, world_size: int, port, *, timeout_s: float) -> dist.TCPStore:
    """The TCPStore of `world_size` forked ranks; `port` is the shared Value (0 until rank 0 publishes)."""
    timeout = timedelta(seconds=timeout_s)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
        port.value = store.port
        return store
    deadline = time.monotonic() + timeout_s
    while port.value == 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"rank 0 published no store port within {timeout_s:.0f} s")
        time.sleep(0.01)
    return dist.TCPStore("127.0.0.1", port.value, world_size, is_master=False, timeout=timeout)
