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
from checkpoint.partner import (
    commit_folder,
    folder_rank,
    pack_folder,
    partner_ranks,
    plan_memory_load,
    plan_step,
    replicas_for,
    transfers,
)
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


def _copies(*folders: str, steps: dict[int, str]) -> dict[str, dict[int, str]]:
    return {f: dict(steps) for f in folders}


def test_a_step_loads_from_own_or_partner_copies_of_one_save_never_a_mix() -> None:
    nodes = ["a", "a", "b", "b"]  # 4 ranks on 2 nodes, the ring 0<->2, 1<->3
    held = {
        "a": {**_copies("rank_0", "rank_1", steps={5: "x", 6: "x"}), "partner_of_rank_2": {5: "x", 6: "x"}},
        "b": {
            **_copies("rank_2", "rank_3", "partner_of_rank_0", steps={5: "x", 6: "x"}),
            "partner_of_rank_1": {5: "x"},
        },
    }  # b lost rank 1's copy of step 6 and rank 3's partner copies
    held["b"]["rank_3"] = {5: "x"}
    plan = plan_memory_load(nodes, held)
    assert [p.step for p in plan] == [5]  # step 6: rank 3 has no copy anywhere
    assert plan[0].sources == (("a", "rank_0"), ("a", "rank_1"), ("b", "rank_2"), ("b", "rank_3"))
    assert plan[0].copied(nodes) == [] and transfers(nodes, plan[0].sources) == []  # all read in place: tier memory
    # step 4: rank 1's own copy is of another save (an attempt saved it again), its partner's copy on b is of the save
    # the others have: that one, sent by b's rank; never a mix of saves
    held = {
        "a": {"rank_0": {7: "x", 4: "x"}, "rank_1": {4: "y"}},
        "b": {"rank_2": {4: "x"}, "partner_of_rank_1": {4: "x"}},
    }
    (p,) = plan_memory_load(["a", "a", "b"], held)
    assert (p.step, p.attempt, p.sources) == (4, "x", (("a", "rank_0"), ("b", "partner_of_rank_1"), ("b", "rank_2")))
    assert p.copied(["a", "a", "b"]) == [1] and transfers(["a", "a", "b"], p.sources) == [(0, 2, 1)]
    assert plan_memory_load(["a", "b"], {"a": {"rank_0": {4: "x"}}, "b": {"rank_1": {4: "y"}}}) == []
    assert plan_memory_load(["a", "b"], {}) == []


def test_the_lost_nodes_ranks_on_an_empty_spare_get_their_copies_from_the_node_that_holds_them() -> None:
    # Before: ranks 0, 1 on a and 2, 3 on b (b's copies on a, a's on b). b lost; spare c runs ranks 2 and 3 now.
    held = {
        "a": _copies("rank_0", "rank_1", "partner_of_rank_2", "partner_of_rank_3", steps={9: "j.0"}),
        "b": _copies("rank_2", "rank_3", "partner_of_rank_0", "partner_of_rank_1", steps={9: "j.0", 10: "j.0"}),
        "c": {},
    }
    nodes = ["a", "a", "c", "c"]
    (p,) = plan_memory_load(nodes, held)  # step 10 held only on b, which is gone: not a candidate
    assert p.sources == (("a", "rank_0"), ("a", "rank_1"), ("a", "partner_of_rank_2"), ("a", "partner_of_rank_3"))
    assert p.copied(nodes) == [2, 3]
    assert transfers(nodes, p.sources) == [(0, 0, 2), (0, 1, 3)]  # a's two copies dealt over a's two ranks
    # one rank per node: node a's single rank sends both, one per round
    assert transfers(["a", "c", "c"], [("a", "rank_0"), ("a", "partner_of_rank_1"), ("a", "partner_of_rank_2")]) == [
        (0, 0, 1),
        (1, 0, 2),
    ]


def test_ranks_moved_between_nodes_read_in_place_what_their_new_node_holds_and_get_the_rest_sent() -> None:
    # Before: 3 nodes a, b, c, one rank each, the ring a->b->c->a (b holds rank 0's copy, c rank 1's, a rank 2's).
    # b lost, spare d appended: a, c, d run ranks 0, 1, 2 now, so rank 2's old node c runs rank 1.
    held = {
        "a": _copies("rank_0", "partner_of_rank_2", steps={12: "j.0"}),
        "c": _copies("rank_2", "partner_of_rank_1", steps={12: "j.0"}),
        "d": {},
    }
    nodes = ["a", "c", "d"]
    (p,) = plan_memory_load(nodes, held)
    # rank 1 reads its partner copy in place on c; rank 2 gets its own save from c (own saves before partner copies,
    # the nodes in the order of their first rank), sent by c's rank, rank 1
    assert p.sources == (("a", "rank_0"), ("c", "partner_of_rank_1"), ("c", "rank_2"))
    assert p.copied(nodes) == [1, 2] and transfers(nodes, p.sources) == [(0, 1, 2)]
    # c's copy of rank 2 found damaged: planned again, rank 2's partner copy on a instead
    p2 = plan_step(nodes, held, 12, exclude=frozenset({("c", "rank_2")}))
    assert (
        p2 is not None and p2.sources[2] == ("a", "partner_of_rank_2") and transfers(nodes, p2.sources) == [(0, 0, 2)]
    )
    assert plan_step(nodes, held, 12, exclude=frozenset({("c", "rank_2"), ("a", "partner_of_rank_2")})) is None


def test_a_copy_held_only_on_a_node_that_is_gone_leaves_an_older_step_or_none() -> None:
    held = {
        "a": {"rank_0": {6: "x", 8: "x"}, "partner_of_rank_1": {6: "x"}},  # 8's partner copy never arrived
        "b": {"rank_1": {6: "x", 8: "x"}, "partner_of_rank_0": {6: "x", 8: "x"}},
    }
    assert [p.step for p in plan_memory_load(["a", "b"], held)] == [8, 6]
    assert [p.step for p in plan_memory_load(["a", "c"], held)] == [6]  # b gone: 8 is incomplete
    assert plan_memory_load(["a", "c"], {"a": {"rank_0": {6: "x", 8: "x"}}, "b": held["b"]}) == []  # the filesystem
    assert folder_rank("partner_of_rank_12") == 12 and folder_rank("rank_3") == 3 and folder_rank("step_3") is None


def test_a_rank_on_a_node_holding_a_copy_of_its_state_reads_it_in_place(tmp_path) -> None:
    """One process: rank 0 saved on node a; its copy is found as a partner copy on node c, where it runs now (as a
    rank moved by a spare swap finds it): it loads that folder in place (tier partner), and once the tier commits a
    step in the new places the old folder goes."""
    cfg = CheckpointConfig(memory_every_steps=1, memory_dir=str(tmp_path / "shm"), async_mode="none")
    model, opt = _fresh()
    ck = CheckpointManager(tmp_path / "ckpt", cfg=cfg, run_id="r", total_steps=9, node="a")
    ck.load_latest(model_parts=[model], optimizers=[opt])
    _train(model, opt, 1)
    ck.save_memory(1)
    want = _state(model, opt)
    ck.close()
    (ck.memory_root.parent / "c").mkdir()
    (ck.memory_root / "rank_0").rename(ck.memory_root.parent / "c" / "partner_of_rank_0")
    events: list[tuple[str, dict]] = []
    model2, opt2 = _fresh()
    ck2 = CheckpointManager(
        tmp_path / "ckpt", cfg=cfg, run_id="r", total_steps=9, node="c", emit=lambda kind, **f: events.append((kind, f))
    )
    assert ck2.load_latest(model_parts=[model2], optimizers=[opt2]) == 1
    (rec,) = [f for k, f in events if k == "checkpoint_loaded"]
    assert (rec["tier"], rec["partner_ranks"], rec["path"]) == (
        "partner",
        [0],
        str(ck2.memory_root / "partner_of_rank_0" / "step_1"),
    )
    assert all(torch.equal(a, b) for a, b in zip(want, _state(model2, opt2), strict=True))
    _train(model2, opt2, 2)
    ck2.save_memory(2)
    assert sorted(p.name for p in ck2.memory_root.iterdir()) == ["rank_0"]  # the copy's old folder retired
    ck2.close()


def test_the_capacity_check_counts_the_partner_copies_a_node_holds() -> None:
    mib = 2**20
    per_rank = [
        ("a", 10 * mib, 60 * mib),
        ("a", 10 * mib, 60 * mib),
        ("b", 10 * mib, 60 * mib),
        ("b", 10 * mib, 60 * mib),
    ]
    assert capacity_error(per_rank, memory_dir="/dev/shm", every=5) is None  # 40 MiB per node
    why = capacity_error(per_rank, memory_dir="/dev/shm", every=5, partners=[2, 3, 0, 1])  # 80 MiB per node
    assert why is not None and "80.0 MiB on node a" in why and "2 ranks' state + 2 partner copies" in why
    assert "checkpoint.memory_replicas=0" in why and "also short: b" in why


def test_a_copy_is_committed_only_when_every_file_matches_its_manifest(tmp_path) -> None:
    model, opt = _fresh()
    ck = CheckpointManager(
        tmp_path / "ckpt",
        cfg=CheckpointConfig(memory_every_steps=1, memory_dir=str(tmp_path / "shm"), async_mode="none"),
        run_id="r",
        total_steps=9,
    )
    ck.load_latest(model_parts=[model], optimizers=[opt])
    _train(model, opt, 1)
    ck.save_memory(1)
    payload = pack_folder(ck.memory_root / "rank_0" / "step_1")
    manifest = commit_folder(
        payload, tmp=tmp_path / "copy" / "step_1.t.tmp", final=tmp_path / "copy" / "step_1", step=1
    )
    assert manifest["rank"] == 0 and sorted(p.name for p in (tmp_path / "copy" / "step_1").iterdir()) == sorted(
        [*manifest["files"], "manifest.json"]
    )
    damaged = bytearray(payload)
    damaged[len(damaged) // 2] ^= 0xFF
    with pytest.raises(Exception):  # noqa: B017 - a damaged pickle or a crc32 mismatch, never a commit
        commit_folder(bytes(damaged), tmp=tmp_path / "bad" / "step_1.t.tmp", final=tmp_path / "bad" / "step_1", step=1)
    assert not (tmp_path / "bad" / "step_1").exists()
    ck.close()


def _slow_stage(monkeypatch, delay_s: float) -> list[float]:
    """Makes the RAM save's staging copy start `delay_s` late; returns when each copy finished."""
    done: list[float] = []
    real = memory_mod.MemoryTier._stage

    def slow(self, tree, path=""):
        if path == "":
            time.sleep(delay_s)
        out = real(self, tree, path)
        if path == "":
            done.append(time.perf_counter())
        return out

    monkeypatch.setattr(memory_mod.MemoryTier, "_stage", slow)
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
    ck2 = CheckpointManager(
        tmp_path / "ckpt", cfg=cfg, run_id="r", total_steps=9, emit=lambda kind, **f: events.append((kind, f))
    )
    assert ck2.load_latest(model_parts=[model2], optimizers=[opt2]) == 4
    ck2.close()
    assert [(f["step"], f["tier"]) for k, f in events if k == "checkpoint_loaded"] == [(4, "memory")]
    assert all(torch.equal(a, b) for a, b in zip(want, _state(model2, opt2), strict=True))


def test_a_ram_write_that_fails_midway_is_recorded_and_leaves_no_loadable_step(tmp_path, monkeypatch) -> None:
    real_save = memory_mod.dcp.save

    def half(state, *, storage_writer, no_dist):  # writes step 2's files, then the "node" fails mid-save
        real_save(state, storage_writer=storage_writer, no_dist=no_dist)
        if ck.memory.last_step == 2:
            raise OSError("simulated crash after the shard files")

    monkeypatch.setattr(memory_mod.dcp, "save", half)
    events: list[tuple[str, dict]] = []
    cfg = CheckpointConfig(memory_every_steps=1, memory_dir=str(tmp_path / "shm"), async_mode="thread")
    model, opt = _fresh()
    ck = CheckpointManager(
        tmp_path / "ckpt", cfg=cfg, run_id="r", total_steps=9, emit=lambda kind, **f: events.append((kind, f))
    )
    ck.load_latest(model_parts=[model], optimizers=[opt])
    for step in (1, 2):
        _train(model, opt, step)
        ck.save_memory(step)
    ck.wait_memory()
    assert [(k, f["step"]) for k, f in events if k.startswith("checkpoint_") and k != "checkpoint_none"] == [
        ("checkpoint_saved", 1),
        ("checkpoint_failed", 2),
    ]
    assert [p.name for p in (ck.memory_root / "rank_0").iterdir() if not p.name.endswith(".tmp")] == ["step_1"]
    ck.close()
    model2, opt2 = _fresh()
    ck2 = CheckpointManager(tmp_path / "ckpt", cfg=cfg, run_id="r", total_steps=9)
    assert ck2.load_latest(model_parts=[model2], optimizers=[opt2]) == 1  # the half-written step 2 is no candidate
    ck2.close()
    assert not list((ck2.memory_root / "rank_0").glob("*.tmp"))  # its leftover is removed at load
