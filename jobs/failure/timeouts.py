"""Bounded waits everywhere: one timeout applied to every process group this rank belongs to.

`new_group` and DeviceMesh sub-groups do not inherit the world group's timeout (they get the
backend's default, 30 minutes for gloo), so after the groups exist every one of them is set here:
`failure.init_timeout_s` while the job starts, `failure.collective_timeout_s` once a step completed;
the checkpoint's own groups (`longer`) keep `failure.checkpoint_timeout_s` throughout: a save on a slow
filesystem waits in them for the slowest rank's write, which the watchdog allows that long.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

__all__ = ["set_pg_timeouts"]


def set_pg_timeouts(seconds: float, *, longer: dict[dist.ProcessGroup, float] | None = None) -> int:
    """Sets the timeout of every process group of this rank to `seconds`, of those in `longer` to
    their own; returns how many groups were set."""
    if not dist.is_initialized():
        return 0
    own = longer or {}
    groups = [pg for pg in list(c10d._world.pg_map) if not c10d._rank_not_in_group(pg)]
    for pg in groups:
        c10d._set_pg_timeout(timedelta(seconds=own.get(pg, seconds)), pg)
    return len(groups)
