"""The RAM checkpoint tier without processes: which steps count as complete, the capacity check, and a
single-process manager that saves to both tiers and loads the right one (identity, corruption, cleanup)."""

from __future__ import annotations

import collections
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import checkpoint.memory_tier as memory_mod
import checkpoint.statedict as statedict_mod
from checkpoint import CheckpointConfig, CheckpointManager
from checkpoint.errors import CheckpointConfigError
from checkpoint.flatread import read_into
from checkpoint.memory_capacity import capacity_error, state_bytes
from checkpoint.memory_tier import complete_steps
from jobs.failure import ledger


def test_a_step_is_complete_only_when_every_rank_holds_it_from_the_same_save() -> None:
    ranks = [{4: "a.1", 6: "a.1", 8: "a.2"}, {4: "a.1", 6: "a.1", 8: "a.1"}, {4: "a.1", 6: "a.1"}]
    assert complete_steps(ranks) == [6, 4]  # 8: rank 2 lacks it, and ranks 0 and 1 hold it from two attempts
    assert complete_steps([{4: "x"}, {}]) == []
    assert complete_steps([]) == []
    assert complete_steps([{2: "x", 10: "x"}]) == [10, 2]


def test_the_capacity_check_sums_each_nodes_ranks_and_names_the_overrides() -> None:
    mib = 2**20
    # node a: 2 ranks x 10 MiB x 2 copies = 40 MiB needed, 50 free: fits; node b: 1 rank, 30 MiB needed, 20 free
    per_rank = [("a", 10 * mib, 50 * mib), ("a", 10 * mib, 50 * mib), ("b", 15 * mib, 20 * mib)]
    why = capacity_error(per_rank, memory_dir="/dev/shm", every=5)
    assert why is not None and "node b" in why and "30.0 MiB" in why and "20.0 MiB free" in why
    assert "checkpoint.memory_every_steps=5" in why and "checkpoint.memory_dir=/dev/shm" in why
    assert capacity_error(per_rank[:2], memory_dir="/dev/shm", every=5) is None


class _Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _fresh() -> tuple[_Two, torch.optim.Optimizer]:
    torch.manual_seed(1)
    m = _Two()
    return m, torch.optim.AdamW(m.parameters(), lr=0.05)


def _train(model: _Two, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model: _Two, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.clone() for t in model.state_dict().values()] + [
        t.clone() for st in opt.state.values() for t in st.values()
    ]


def _cfg(tmp_path, **kw) -> CheckpointConfig:
    return CheckpointConfig(
        every_steps=2, memory_every_steps=1, memory_dir=str(tmp_path / "shm"), async_mode="none", **kw
    )


def _run(tmp_path, *, steps: int = 5, run_id: str = "runA", **kw):
    """Trains `steps` steps saving the filesystem tier at even steps, the RAM tier at every step; returns
    the state after the last step and the manager's events."""
    events: list[tuple[str, dict]] = []
    model, opt = _fresh()
    ck = CheckpointManager(
        tmp_path / "ckpt",
        cfg=_cfg(tmp_path, **kw),
        run_id=run_id,
        total_steps=100,
        emit=lambda kind, **f: events.append((kind, f)),
    )
    assert ck.load_latest(model_parts=[model], optimizers=[opt]) == 0
    for step in range(1, steps + 1):
        _train(model, opt, step)
        if ck.memory_due(step):
            ck.save_memory(step)
        if ck.due(step):
            ck.save(step)
    ck.close()
    return _state(model, opt), events, ck


def _resume(tmp_path, *, run_id: str = "runA"):
    events: list[tuple[str, dict]] = []
    model, opt = _fresh()
    ck = CheckpointManager(
        tmp_path / "ckpt",
        cfg=_cfg(tmp_path),
        run_id=run_id,
        total_steps=100,
        emit=lambda kind, **f: events.append((kind, f)),
    )
    step = ck.load_latest(model_parts=[model], optimizers=[opt])
    ck.close()
    return step, _state(model, opt), events, ck


def test_a_restart_loads_the_newer_ram_step_bitwise_and_the_tier_keeps_one_copy(tmp_path) -> None:
    want, events, ck = _run(tmp_path, steps=5)
    saved = collections.Counter(f["tier"] for k, f in events if k == "checkpoint_saved")
    assert saved == {"memory": 5, "filesystem": 2}
    assert [p.name for p in (ck.memory_root / "rank_0").iterdir()] == ["step_5"]  # older copies retired
    step, got, ev, _ = _resume(tmp_path)
    assert step == 5
    loaded = [f for k, f in ev if k == "checkpoint_loaded"]
    assert [(f["step"], f["tier"]) for f in loaded] == [(5, "memory")]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_a_corrupted_ram_shard_is_skipped_and_the_filesystem_tier_loads(tmp_path) -> None:
    _, _, ck = _run(tmp_path, steps=5)
    shard = next((ck.memory_root / "rank_0" / "step_5").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum sees it
    shard.write_bytes(bytes(data))
    step, _, ev, _ = _resume(tmp_path)
    assert step == 4
    skipped = [f for k, f in ev if k == "checkpoint_skipped"]
    assert [(f["step"], f["tier"]) for f in skipped] == [(5, "memory")] and "crc32" in skipped[0]["reason"]
    assert [(f["step"], f["tier"]) for k, f in ev if k == "checkpoint_loaded"] == [(4, "filesystem")]


def test_another_runs_ram_tier_is_never_read(tmp_path) -> None:
    _, _, ck = _run(tmp_path, steps=5, run_id="runA")
    # another run with the same checkpoint folder lists its own root only ...
    step, _, ev, other = _resume(tmp_path, run_id="runB")
    assert step == 4 and [f["tier"] for k, f in ev if k == "checkpoint_loaded"] == ["filesystem"]
    # ... and run A's copies put under run B's root are refused by their manifest's run id
    shutil.copytree(ck.memory_root, other.memory_root, dirs_exist_ok=True)
    step, _, ev, _ = _resume(tmp_path, run_id="runB")
    assert step == 4 and [f["tier"] for k, f in ev if k == "checkpoint_loaded"] == ["filesystem"]


def test_a_ram_step_some_rank_never_committed_is_not_loaded_and_is_removed(tmp_path) -> None:
    _, _, ck = _run(tmp_path, steps=5)
    (ck.memory_root / "rank_0" / "step_5" / "manifest.json").unlink()  # as if killed before the rename
    (ck.memory_root / "rank_0" / "step_6.x.tmp").mkdir()
    step, _, ev, _ = _resume(tmp_path)
    assert step == 4 and [f["tier"] for k, f in ev if k == "checkpoint_loaded"] == ["filesystem"]
    assert list((ck.memory_root / "rank_0").iterdir()) == []  # newer than the step loaded: deleted


def test_the_capacity_check_refuses_a_memory_dir_too_small_with_the_override(tmp_path, monkeypatch) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(memory_mod.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    model, opt = _fresh()
    ck = CheckpointManager(tmp_path / "ckpt", cfg=_cfg(tmp_path), run_id="runA")
    with pytest.raises(CheckpointConfigError, match=r"checkpoint.memory_every_steps=1.*checkpoint.memory_dir="):
        ck.load_latest(model_parts=[model], optimizers=[opt])
    ck.close()
    # 8x8+8 + 8x2+2 = 90 fp32 parameters, and AdamW's two moments of each before the first step
    assert state_bytes(ck.state.objects) == 90 * 4 * 3


def test_drop_memory_removes_the_runs_copies(tmp_path) -> None:
    _, _, ck = _run(tmp_path, steps=3)
    assert ck.memory_root.is_dir()
    ck.drop_memory()
    assert not ck.memory_root.exists()


def test_the_attempt_summary_says_which_tier_each_attempt_resumed_from() -> None:
    ev = [
        {"kind": "attempt_start", "attempt": "j.0", "time": 0.0},
        {"kind": "checkpoint_none", "attempt": "j.0", "time": 1.0},
        {"kind": "attempt_start", "attempt": "j.1", "time": 10.0},
        {"kind": "checkpoint_loaded", "attempt": "j.1", "time": 11.0, "step": 8, "tier": "memory"},
        {"kind": "attempt_start", "attempt": "j.2", "time": 20.0},
        {"kind": "checkpoint_loaded", "attempt": "j.2", "time": 21.0, "step": 6},
    ]  # an older ledger: no tier
    rows = ledger.attempts(ev)
    assert [a.resumed_tier for a in rows] == [None, "memory", "filesystem"]
    lines = ledger.render_summary(ev).splitlines()
    assert " from " in lines[1]
    assert [ln.split()[5] for ln in lines[2:]] == ["-", "ram", "fs"]


def test_a_ram_restart_reads_its_copy_without_dcp_load_and_a_filesystem_restart_still_uses_it(
    tmp_path, monkeypatch
) -> None:
    want, _, ck = _run(tmp_path, steps=5)
    calls: list[str] = []
    real = dcp.load
    monkeypatch.setattr(dcp, "load", lambda *a, **k: calls.append(str(k.get("checkpoint_id"))) or real(*a, **k))
    step, got, ev, _ = _resume(tmp_path)
    assert (step, [f["tier"] for k, f in ev if k == "checkpoint_loaded"]) == (5, ["memory"])
    assert calls == []  # the RAM copy went straight into the tensors (checkpoint/flatread.py)
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
    shutil.rmtree(ck.memory_root)  # the RAM tier lost: the filesystem's step 4 goes through DCP's load
    step, _, ev, _ = _resume(tmp_path)
    assert (step, [f["tier"] for k, f in ev if k == "checkpoint_loaded"]) == (4, ["filesystem"])
    assert [p.rsplit("/", 1)[-1] for p in calls] == ["step_4"]


def test_reading_a_ram_copy_into_a_state_of_another_shape_or_dtype_fails_naming_the_key(tmp_path) -> None:
    dcp.save(
        {"w": torch.arange(6.0), "h": torch.ones(2, dtype=torch.bfloat16)}, checkpoint_id=str(tmp_path), no_dist=True
    )
    with pytest.raises(ValueError, match=r"w: the RAM copy holds \(6,\) torch.float32, the state \(3,\) torch.float32"):
        read_into(tmp_path, {"w": torch.zeros(3)})
    with pytest.raises(
        ValueError, match=r"h: the RAM copy holds \(2,\) torch.bfloat16, the state \(2,\) torch.float16"
    ):
        read_into(tmp_path, {"h": torch.zeros(2, dtype=torch.float16)})
    with pytest.raises(ValueError, match=r"lacks 1 keys of the state to load, e.g. \['x'\]"):
        read_into(tmp_path, {"x": torch.zeros(1)})
    got = read_into(tmp_path, {"w": torch.zeros(6)[::1], "h": torch.zeros(4, dtype=torch.bfloat16)[::2]})
    assert got["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0] and got["h"].tolist() == [
        1.0,
        1.0,
    ]  # strided: via the map


def test_a_ram_save_reuses_the_state_dict_structure_built_once_and_saves_each_steps_state(
    tmp_path, monkeypatch
) -> None:
    built: list[int] = []
    real = statedict_mod.get_optimizer_state_dict
    monkeypatch.setattr(statedict_mod, "get_optimizer_state_dict", lambda *a, **k: built.append(1) or real(*a, **k))
    want, events, _ = _run(tmp_path, steps=4)  # RAM saves at every step, filesystem ones at even steps
    assert collections.Counter(f["tier"] for k, f in events if k == "checkpoint_saved") == {
        "memory": 4,
        "filesystem": 2,
    }
    assert len(built) == 1  # the first save builds the structure; every later one, of either tier, only stages
    monkeypatch.undo()
    step, got, ev, _ = _resume(tmp_path)
    assert (step, [f["tier"] for k, f in ev if k == "checkpoint_loaded"]) == (4, ["memory"])
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))
