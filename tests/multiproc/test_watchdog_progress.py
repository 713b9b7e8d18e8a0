"""The watchdog judges each rank's progress with its phase's own limit, on real ranks: two processes in a gloo group,
each with its watchdog beating through the rendezvous store. A rank whose main thread is stuck outside a collective
while its heartbeat thread goes on is named; a rank in a checkpoint save longer than the hang timeout (and shorter
than its own limit) holds its peer's limit and is named by nobody."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from jobs.failure.watchdog import Watchdog
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.multiproc

HB, HANG_S = 0.2, 2.0


def _ranks_wait(rank: int, world_size: int, run_dir: str, phase: str, limit_s: float | None, hold_s: float) -> dict:
    """Three steps, then rank 1 spends `hold_s` in `phase` (its main thread asleep: a device call that does not
    return, or a save) before it joins the all-reduce rank 0 already waits in. What each watchdog did."""
    fired: list[float] = []
    wd = Watchdog(
        run_dir=run_dir,
        attempt="a",
        rank=rank,
        node=f"n{rank}",
        heartbeat_s=HB,
        init_timeout_s=60.0,
        hang_timeout_s=HANG_S,
        on_hang=fired.append,
        world_size=world_size,
        missed_beats=3,
    ).start()
    wd.attach(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    wd.phase("train")
    x = torch.ones(4)
    for step in range(1, 4):
        dist.all_reduce(x)
        wd.progress(step)
    if rank == 1:
        wd.phase(phase, limit_s=limit_s)
        time.sleep(hold_s)
        wd.phase("train")
    t0 = time.monotonic()
    dist.all_reduce(x)
    waited = time.monotonic() - t0
    wd.progress(4)
    wd.stop(ended=True)
    inc = wd.incident
    return {
        "fired": bool(fired),
        "because": wd.fired_because,
        "incident": None if inc is None else (inc.cls, [s["rank"] for s in inc.suspects]),
        "waited": waited,
    }


def test_a_rank_whose_main_thread_is_stuck_while_its_heartbeat_goes_on_is_named_by_both_ranks(tmp_path) -> None:
    res = run_ranks(_ranks_wait, 2, str(tmp_path), "eval", None, 4 * HANG_S, timeout=120.0).results
    assert res[0]["waited"] > 2 * HANG_S  # rank 0 sat in the all-reduce, its own beat thread sending
    assert res[0]["fired"] and res[1]["fired"], res
    assert res[0]["incident"] == res[1]["incident"] == ("hung_rank", [1]), res


def test_a_rank_in_a_checkpoint_save_longer_than_the_hang_timeout_is_named_by_nobody(tmp_path) -> None:
    res = run_ranks(_ranks_wait, 2, str(tmp_path), "checkpoint_save", 60.0, 3 * HANG_S, timeout=120.0).results
    assert res[0]["waited"] > 2 * HANG_S
    assert not res[0]["fired"] and not res[1]["fired"], res
