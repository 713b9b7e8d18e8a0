"""The RAM tier at a restart inside the allocation (issue 37): the capacity check counts every copy of this run
a host holds already, once per host, so the restart passes whenever the first start passed."""

from __future__ import annotations

import shutil

from checkpoint import CheckpointConfig, CheckpointManager
from checkpoint.memory_capacity import capacity_error
from checkpoint.partner import partner_ranks

GIB = 2**30
S = 10 * GIB  # one rank's state


def _copies(root, names: list[str]) -> None:
    """A committed step of size S in each folder (sparse files: the size counts, no bytes are written)."""
    for name in names:
        d = root / name / "step_7"
        d.mkdir(parents=True)
        with open(d / "__0_0.distcp", "wb") as f:
            f.truncate(S)


def test_a_restart_passes_the_capacity_check_whenever_the_first_start_passed(tmp_path, monkeypatch) -> None:
    # The numbers: 2 nodes x 8 ranks, S = 10 GiB per rank, 40 S free on each node at the first start;
    # each node needs 2 copies x (8 own + 8 partner) = 32 S = 327,680 MiB.
    nodes = ["n0"] * 8 + ["n1"] * 8
    partners = partner_ranks(nodes)
    free = {"free": 40 * S}
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=free["free"]))
    ck = CheckpointManager(
        tmp_path / "ckpt",
        cfg=CheckpointConfig(memory_every_steps=1, memory_dir=str(tmp_path / "shm"), async_mode="none"),
        run_id="runA",
    )
    start = ck.memory_available()
    assert start == 40 * S
    per_host = [(n, S, start) for n in nodes]  # every rank of a host measures the same
    assert capacity_error(per_host, memory_dir="/dev/shm", every=1, partners=partners) is None
    # The restart: this host holds 8 own and 8 partner copies of this run (16 S), so 24 S are free.
    _copies(ck.memory_root, [f"rank_{r}" for r in range(8)] + [f"partner_of_rank_{r}" for r in range(8, 16)])
    free["free"] = 24 * S
    again = ck.memory_available()
    assert again == 40 * S  # before: 24 S + this rank's own and held copy = 26 S (266,240 MiB) -> exit 2
    per_host = [(n, S, again) for n in nodes]
    assert capacity_error(per_host, memory_dir="/dev/shm", every=1, partners=partners) is None
    ck.close()


def test_copies_of_other_runs_do_not_count_as_free(tmp_path, monkeypatch) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=24 * S))
    cfg = CheckpointConfig(memory_every_steps=1, memory_dir=str(tmp_path / "shm"), async_mode="none")
    other = CheckpointManager(tmp_path / "other", cfg=cfg, run_id="runB")
    _copies(other.memory_root, ["rank_0", "partner_of_rank_8"])
    ck = CheckpointManager(tmp_path / "ckpt", cfg=cfg, run_id="runA")
    assert ck.memory_available() == 24 * S
    other.close()
    ck.close()
