"""The test harness's own rendezvous (`tests.multiproc._ranks.run_ranks`): rank 0 binds the store's port and hands it
on, so that a port picked free beforehand and taken by another process before a rank binds it cannot fail a test."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist

from tests.multiproc import _ranks
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.multiproc


def _sum_and_port(rank: int, world_size: int) -> tuple[float, int]:
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t), int(os.environ["MASTER_PORT"])


def test_ranks_meet_even_when_a_port_picked_free_beforehand_is_taken_by_another_process(monkeypatch) -> None:
    # Another process listens on the port a pick-then-bind harness would hand the ranks (what happened on a busy
    # CI box: a concurrent test's gloo socket took it between the pick and rank 0's bind).
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setattr(_ranks, "free_port", lambda: taken.getsockname()[1])
        res = run_ranks(_sum_and_port, 2, timeout=60).results
        busy = taken.getsockname()[1]
    assert [res[r][0] for r in range(2)] == [3.0, 3.0]
    assert res[0][1] == res[1][1] != busy  # both ranks were told the port rank 0 bound
