"""The RAM tier at a restart inside the allocation: the capacity check counts every copy of this run
a host holds already, once per host, so the restart passes whenever the first start passed."""

from __future__ import annotations

import shutil

import torch

from checkpoint import CheckpointConfig, CheckpointManager, TrainState, memory_capacity
from checkpoint.memory_capacity import HEADROOM, capacity_error, cgroup_room
from checkpoint.partner import partner_ranks
from tests.unit.test_memory_tier import _fresh, _state, _train
from tests.unit.test_spike import _health

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
    assert start == 40 * S - HEADROOM
    per_host = [(n, S, start) for n in nodes]  # every rank of a host measures the same
    assert capacity_error(per_host, memory_dir="/dev/shm", every=1, partners=partners) is None
    # The restart: this host holds 8 own and 8 partner copies of this run (16 S), so 24 S are free.
    _copies(ck.memory_root, [f"rank_{r}" for r in range(8)] + [f"partner_of_rank_{r}" for r in range(8, 16)])
    free["free"] = 24 * S
    again = ck.memory_available()
    assert again == 40 * S - HEADROOM  # before: 24 S + this rank's own and held copy = 26 S (266,240 MiB) -> exit 2
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
    assert ck.memory_available() == 24 * S - HEADROOM
    other.close()
    ck.close()


def _manager(tmp_path, events: list, *, memory: bool = True, config_hash: str = "c1", **kw) -> CheckpointManager:
    cfg = CheckpointConfig(
        every_steps=2,
        memory_every_steps=1 if memory else 0,
        memory_dir=str(tmp_path / "shm"),
        async_mode="none",
        **kw,
    )
    return CheckpointManager(
        tmp_path / "ckpt",
        cfg=cfg,
        run_id="runA",
        total_steps=100,
        manifest_extra={"config_hash": config_hash},
        emit=lambda kind, **f: events.append((kind, f)),
    )


def _old_timeline(tmp_path) -> None:
    """Steps 1..5 without a rollback: the filesystem tier at 2 and 4, the RAM tier at every step (5 is newest)."""
    model, opt = _fresh()
    ck = _manager(tmp_path, [])
    ck.load_latest(model_parts=[model], optimizers=[opt], train_state=TrainState())
    for step in range(1, 6):
        _train(model, opt, step)
        ck.save_memory(step)
        if step % 2 == 0:
            ck.save(step)
    ck.close()


def _loaded(events: list) -> list[tuple[int, str]]:
    return [(f["step"], f["tier"]) for k, f in events if k == "checkpoint_loaded"]


def test_a_ram_step_saved_before_a_rollback_is_never_loaded_after_it(tmp_path) -> None:
    _old_timeline(tmp_path)
    # Another attempt (on other nodes: no RAM tier there) rolls back to step 2 and saves step 3 of the new timeline.
    model, opt, st = *_fresh(), TrainState()
    ev: list = []
    ck = _manager(tmp_path, ev, memory=False)
    assert ck.load_latest(model_parts=[model], optimizers=[opt], train_state=st, before_step=3) == 2
    st.health["rollbacks"] = [{"rollback": 1, "target_step": 2, "from_step": 2}]
    _train(model, opt, 103)
    ck.save(3)
    ck.close()
    want = _state(model, opt)
    # Back on the first nodes, which still hold the old timeline's RAM step 5: the run knows one rollback.
    model, opt, st = *_fresh(), TrainState()
    ev = []
    ck = _manager(tmp_path, ev)
    got = ck.load_latest(model_parts=[model], optimizers=[opt], train_state=st, rollbacks=1)
    ck.close()
    assert (got, _loaded(ev)) == (3, [(3, "filesystem")])  # before: (5, memory), then step 3 moved aside
    assert st.health["rollbacks"][0]["rollback"] == 1 and all(
        torch.equal(a, b) for a, b in zip(want, _state(model, opt))
    )


def test_a_ram_step_of_another_config_or_with_memory_load_false_is_not_loaded(tmp_path) -> None:
    cases = [
        ({"config_hash": "c2"}, (4, "filesystem")),
        ({"memory_load": False}, (4, "filesystem")),
        ({}, (5, "memory")),
    ]
    for i, (kw, want) in enumerate(cases):
        _old_timeline(tmp_path / str(i))
        ev: list = []
        model, opt = _fresh()
        ck = _manager(tmp_path / str(i), ev, **kw)
        assert ck.load_latest(model_parts=[model], optimizers=[opt], train_state=TrainState()) == want[0], kw
        ck.close()
        assert _loaded(ev) == [want], kw
        # a step newer than the one loaded is of no use any more: the RAM tier drops it (as before)
        assert [p.name for p in (ck.memory_root / "rank_0").iterdir()] == [f"step_{want[0]}"] * (want[1] == "memory")


def test_the_run_knows_the_rollbacks_in_its_ledger_before_the_first_load(tmp_path) -> None:
    h = _health(tmp_path)
    assert h.known_rollbacks() == 0
    h2 = _health(tmp_path)
    h2._emit_fn("rollback", record={"rollback": 1, "target_step": 2})
    h2._emit_fn("rollback", record={"rollback": 2, "target_step": 5})
    assert h2.known_rollbacks() == 2  # what the trainer's load passes as `rollbacks`


def test_the_memory_cgroup_bounds_what_the_ram_tier_may_use(tmp_path, monkeypatch) -> None:
    # cgroup v2 (Slurm's ConstrainRAMSpace: the job's cgroup holds the limit, its step the process)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/slurm/job_7/step_0\n")
    job = tmp_path / "fs/slurm/job_7"
    (job / "step_0").mkdir(parents=True)
    (job / "memory.max").write_text(f"{30 * S}\n")
    (job / "memory.current").write_text(f"{4 * S}\n")
    (job / "step_0/memory.max").write_text("max\n")
    (job / "step_0/memory.current").write_text(f"{4 * S}\n")
    assert cgroup_room(proc=proc, root=tmp_path / "fs") == 26 * S
    # v1, no limit (the page-rounded 2**63 - 1): none
    proc.write_text("4:memory:/process_api/x\n0::/\n")
    v1 = tmp_path / "fs/memory/process_api/x"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory.usage_in_bytes").write_text("1000\n")
    assert cgroup_room(proc=proc, root=tmp_path / "fs") is None
    # the check takes the smaller of the tmpfs's free bytes and the cgroup's room, less the headroom
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=40 * S))
    monkeypatch.setattr(memory_capacity, "cgroup_room", lambda: 26 * S)
    ck = CheckpointManager(
        tmp_path / "ckpt",
        cfg=CheckpointConfig(memory_every_steps=1, memory_dir=str(tmp_path / "shm"), async_mode="none"),
        run_id="runA",
    )
    assert ck.memory_available() == 26 * S - HEADROOM  # before: 40 S, and need == free passed with no headroom
    ck.close()
