"""One of the checkpoint manager's own process groups, as the calls its parts make on it (gloo; none on one process)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Group"]


class Group:
    """A gloo group of the manager's (`pg`; None when `world_size` is 1: every call is then local). Every rank calls
    each method at the same point."""

    def __init__(self, pg: dist.ProcessGroup | None, *, world_size: int) -> None:
        self.pg, self.world_size = pg, world_size

    @classmethod
    def new(cls, world_size: int) -> Group:
        """A new gloo group of every rank (collective); a local one on one process."""
        return cls(dist.new_group(backend="gloo") if world_size > 1 else None, world_size=world_size)

    def all_gather(self, obj: Any) -> list[Any]:
        if self.world_size <= 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    def bcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""
        if self.world_size <= 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.pg)

    def max(self, values: list[float]) -> list[float]:
        """The element-wise max of `values` over the ranks."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.pg)
        return [float(x) for x in t]

    def destroy(self) -> None:
        """Releases the group (once; no collective left to run on it)."""
        if self.pg is not None and dist.is_initialized():
            dist.destroy_process_group(self.pg)
        self.pg = None
