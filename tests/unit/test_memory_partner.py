"""Partner copies and the asynchronous save of the RAM tier without processes: the ring over nodes, the
checkpoint.memory_replicas checks, which copy each rank loads, the capacity with partner copies, and a RAM save
that returns before its write yet saves the state of its own step (a failed write leaves nothing loadable)."""

from __future__ import annotations

import time

import pytest
import torch

import checkpoint.memory_tier as memory_mod
from checkpoint import CheckpointConfig, CheckpointManager
from checkpoint.errors import CheckpointConfigError
from checkpoint.memory_capacity import capacity_error
from checkpoint.partner import commit_folder, pack_folder, partner_ranks, plan_memory_load, replicas_for
from jobs.config import compose
from jobs.validate import validate
from tests.unit.test_memory_tier import _fresh, _state, _train


def test_a_ranks_partner_is_the_same_local_rank_on_the_next_node_in_a_ring() -> None:
    assert partner_ranks(["a", "a", "b", "b"]) == [2, 3, 0, 1]
    assert partner_ranks(["a", "a", "b", "b", "c", "c"]) == [2, 3, 4, 5, 0, 1]  # c's partners are on a
    assert partner_ranks(["a", "b", "a", "b"]) == [1, 0, 3, 2]  # cyclic placement: nodes by their first rank
    assert partner_ranks(["n2", "n1"]) == [1, 0]


def test_partner_copies_need_another_node_and_the_same_ranks_per_node_and_say_the_override() -> None:
    with pytest.raises(CheckpointConfigError, match=r"checkpoint.memory_replicas=1.*one node.*memory_replicas=0"):
        partner_ranks(["a", "a"])
    with pytest.raises(CheckpointConfigError, match=r"different numbers of ranks \(a: 2, b: 1\)"):
        partner_ranks(["a", "a", "b"])
    assert replicas_for(None, nodes=1, memory_on=True) == 0  # null: on when there is another node
    assert replicas_for(None, nodes=2, memory_on=True) == 1
    assert replicas_for(1, nodes=1, memory_on=False) == 0  # no RAM tier, no copies
    assert replicas_for(0, nodes=4, memory_on=True) == 0
    with pytest.raises(CheckpointConfigError, match=r"checkpoint.memory_replicas=1 .* 1 node.*launcher.nodes >= 2"):
        replicas_for(1, nodes=1, memory_on=True)
    with pytest.raises(ValueError, match=r"checkpoint.memory_replicas\(2\) must be 0, 1 or null"):
        CheckpointConfig(memory_replicas=2)
    # the login node refuses it before submitting, naming the override
    base = ["mesh=single", "mesh.dp_shard=2", "launcher.tasks_per_node=2", "checkpoint.memory_every_steps=5"]
    with pytest.raises(ValueError, match=r"checkpoint.memory_replicas=1"):
        validate(compose([*base, "checkpoint.memory_replicas=1"]))
    validate(compose([*base, "checkpoint.memory_replicas=1", "launcher.nodes=2", "mesh.dp_shard=4"]))


def test_a_step_loads_from_own_or_partner_copies_of_one_save_never_a_mix() -> None:
    own = [{5: "a", 6: "a"}, {}, {5: "a", 6: "a"}, {5: "a", 6: "a"}]  # rank 1's node lost its copies
    held = [{5: "a", 6: "a"}, {5: "a", 6: "a"}, {}, {5: "a"}]  # rank 2's partner was on that node
    assert plan_memory_load(own, held) == [
        (6, [True, False, True, True], [True, True, False, False]),
        (5, [True, False, True, True], [True, True, False, True])]
    # step 7: rank 1 has no copy; step 4: rank 1's own copy is of another save (an attempt saved it again), its
    # partner's copy is of rank 0's save: that one
    assert plan_memory_load([{7: "a", 4: "x"}, {4: "y"}], [{}, {4: "x"}]) == [(4, [True, False], [False, True])]
    assert plan_memory_load([{4: "x"}, {4: "y"}], [{}, {}]) == []
    assert plan_memory_load([{}, {}], [{}, {}]) == []


def test_the_capacity_check_counts_the_partner_copies_a_node_holds() -> None:
    mib = 2**20
    per_rank = [("a", 10 * mib, 60 * mib), ("a", 10 * mib, 60 * mib), ("b", 10 * mib, 60 * mib), ("b", 10 * mib, 60 * mib)]
    assert capacity_error(per_rank, memory_dir="/dev/shm", every=5) is None  # 40 MiB per node
    why = capacity_error(per_rank, memory_dir="/dev/shm", every=5, partners=[2, 3, 0, 1])  # 80 MiB per node
    assert why is not None and "80.0 MiB on node a" in why and "2 ranks' state + 2 partner copies" in why
    assert "checkpoint.memory_replicas=0" in why and "also short: b" in why


def test_a_copy_is_committed_only_when_every_file_matches_its_manifest(tmp_path) -> None:
    model, opt = _fresh()
    ck = CheckpointManager(tmp_path / "ckpt", cfg=CheckpointConfig(memory_every_steps=1, memory_dir=str(tmp_path / "shm"),
                                                                   async_mode="none"), run_id="r", total_steps=9)
    ck.load_latest(model_parts=[model], optimizers=[opt])
    _train(model, opt, 1)
    ck.save_memory(1)
    payload = pack_folder(ck.memory_root / "rank_0" / "step_1")
    manifest = commit_folder(payload, tmp=tmp_path / "copy" / "step_1.t.tmp", final=tmp_path / "copy" / "step_1", step=1)
    assert manifest["rank"] == 0 and sorted(p.name for p in (tmp_path / "copy" / "step_1").iterdir()) == sorted(
        [*manifest["files"], "manifest.json"])
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0xFF
    with pytest.raises(Exception):  # noqa: B017 - a damaged pickle or a crc32 mismatch, never a commit
        commit_folder(bytes(damaged), tmp=tmp_path / "bad" / "step_1.t.tmp", final=tmp_path / "bad" / "step_1", step=1)
    assert not (tmp_path / "bad" / "step_1").exists()
    ck.close()


def _slow_stage(monkeypatch, delay_s: float) -> list[float]:
    """Makes the RAM save's staging copy start `delay_s` late; returns when each copy finished."""
    done: list[float] = []
    real = memory_mod.MemoryTierMixin._stage

    def slow(self, tree, path=""):
        if path == "":
            time.sleep(delay_s)
        out = real(self, tree, path)
        if path == "":
            done.append(time.perf_counter())
        return out

    monkeypatch.setattr(memory_mod.MemoryTierMixin, "_stage", slow)
    return done


def test_an_async_ram_save_returns_before_its_copy_and_saves_its_own_steps_state_bitwise(tmp_path, monkeypatch) -> None:
    """The staging copy is forced to start 0.3 s late: save_memory returns before it, and the next optimizer step
    waits for it (else step 4's save would hold step 5's parameters)."""
    done = _slow_stage(monkeypatch, 0.3)
    cfg = CheckpointConfig(memory_every_steps=4, memory_dir=str(tmp_path / "shm"), async_mode="thread")
    model, opt = _fresh()
    ck = CheckpointManager(tmp_path / "ckpt", cfg=cfg, run_id="r", total_steps=9)
    ck.load_latest(model_parts=[model], optimizers=[opt])
    want = None
    for step in range(1, 7):
        _train(model, opt, step)
        if ck.memory_due(step):
            want = _state(model, opt)
            t = time.perf_counter()
            ck.save_memory(step)
            assert not done and time.perf_counter() - t < 0.3  # returned before the copy
    ck.close()
    assert len(done) == 1
    model2, opt2 = _fresh()
    events: list[tuple[str, dict]] = []
    ck2 = CheckpointManager(tmp_path / "ckpt", cfg=cfg, run_id="r", total_steps=9,
                            emit=lambda kind, **f: events.append((kind, f)))
    assert ck2.load_latest(model_parts=[model2], optimizers=[opt2]) == 4
    ck2.close()
    assert [(f["step"], f["tier"]) for k, f in events if k == "checkpoint_loaded"] == [(4, "memory")]
    assert all(torch.equal(a, b) for a, b in zip(want, _state(model2, opt2), strict=True))


def test_a_ram_write_that_fails_midway_is_recorded_and_leaves_no_loadable_step(tmp_path, monkeypatch) -> None:
    real_save = memory_mod.dcp.save

    def half(state, *, storage_writer, no_dist):  # writes step 2's files, then the "node" fails mid-save
        real_save(state, storage_writer=storage_writer, no_dist=no_dist)
        if ck._last_memory_step == 2:
            raise OSError("simulated crash after the shard files")

    monkeypatch.setattr(memory_mod.dcp, "save", half)
    events: list[tuple[str, dict]] = []
    cfg = CheckpointConfig(memory_every_steps=1, memory_dir=str(tmp_path / "shm"), async_mode="thread")
    model, opt = _fresh()
    ck = CheckpointManager(tmp_path / "ckpt", cfg=cfg, run_id="r", total_steps=9,
                           emit=lambda kind, **f: events.append((kind, f)))
    ck.load_latest(model_parts=[model], optimizers=[opt])
    for step in (1, 2):
        _train(model, opt, step)
        ck.save_memory(step)
    ck.wait_memory()
    assert [(k, f["step"]) for k, f in events if k.startswith("checkpoint_") and k != "checkpoint_none"] == [
        ("checkpoint_saved", 1), ("checkpoint_failed", 2)]
    assert [p.name for p in (ck.memory_root / "rank_0").iterdir() if not p.name.endswith(".tmp")] == ["step_1"]
    ck.close()
    model2, opt2 = _fresh()
    ck2 = CheckpointManager(tmp_path / "ckpt", cfg=cfg, run_id="r", total_steps=9)
    assert ck2.load_latest(model_parts=[model2], optimizers=[opt2]) == 1  # the half-written step 2 is no candidate
    ck2.close()
    assert not list((ck2.memory_root / "rank_0").glob("*.tmp"))  # its leftover is removed at load
