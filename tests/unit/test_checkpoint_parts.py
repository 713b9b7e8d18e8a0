"""The checkpoint manager as composed parts: each part is built with exactly what it needs and
reads only what it holds. Read off the source (no class in checkpoint/ reads a `self.` name it neither defines nor
assigns: a mixin does), and each part built alone from its narrow inputs and exercised on real files."""

from __future__ import annotations

import ast
import json
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from checkpoint import CheckpointConfig
from checkpoint.cadence import Cadence
from checkpoint.commit import Committer
from checkpoint.fs_restore import FsRestore
from checkpoint.group import Group
from checkpoint.memory_tier import FILESYSTEM, MEMORY, MemoryTier, load_local
from checkpoint.partner import Placement
from checkpoint.state import TrainState
from checkpoint.statedict import BoundState
from checkpoint.writer import RecordingWriter
from tests.conftest import REPO


def _borrowed_names(path: Path) -> list[str]:
    """`file:line: Class.name` for every `self.name` a class reads that it neither defines (a method, a property, a
    class-level name or field) nor assigns in one of its methods, and `file:line: Class(Base)` for every base named
    `*Mixin`. A class with another base (it may inherit the name) is checked for the base's name only."""
    out = []
    for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
        bases = [ast.unparse(b) for b in cls.bases]
        out += [f"{path.name}:{cls.lineno}: {cls.name}({b})" for b in bases if b.endswith("Mixin")]
        if bases:
            continue
        own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
        own |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
        own |= {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
        attrs = [
            n
            for n in ast.walk(cls)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
        ]
        own |= {n.attr for n in attrs if isinstance(n.ctx, ast.Store)}
        borrowed = {n for n in attrs if n.attr not in own and not n.attr.startswith("__")}  # __slots__ and alike
        out += sorted({f"{path.name}:{n.lineno}: {cls.name}.{n.attr}" for n in borrowed})
    return out


def test_no_class_in_checkpoint_reads_a_name_of_self_it_was_not_given_and_none_is_a_mixin():
    borrowed = [b for p in sorted((REPO / "checkpoint").glob("*.py")) for b in _borrowed_names(p)]
    assert borrowed == []


def _long_functions(path: Path, limit: int) -> list[str]:
    """`file:line: name (n lines)` for every function in `path` longer than `limit` lines, decorators and docstring
    included."""
    tree = ast.parse(path.read_text())
    return [
        f"{path.name}:{n.lineno}: {n.name} ({n.end_lineno - n.lineno + 1} lines)"
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > limit
    ]


def test_every_function_in_checkpoint_is_at_most_60_lines():
    assert [f for p in sorted((REPO / "checkpoint").glob("*.py")) for f in _long_functions(p, 60)] == []


def test_the_borrowed_name_check_finds_a_mixin_and_the_names_it_borrows(tmp_path):
    (tmp_path / "m.py").write_text(
        "class CommitMixin:\n    def commit(self):\n        return self.folder\n\n"
        "class Manager(CommitMixin):\n    def __init__(self):\n        self.folder = 1\n"
    )
    assert _borrowed_names(tmp_path / "m.py") == ["m.py:3: CommitMixin.folder", "m.py:5: Manager(CommitMixin)"]


def _write(tmp: Path, value: float) -> RecordingWriter:
    """One rank's DCP files of a small state in `tmp`, written as a save writes them."""
    writer = RecordingWriter(tmp, thread_count=1)
    dcp.save({"w": torch.full((4,), value)}, storage_writer=writer, no_dist=True)
    return writer


def test_the_committer_alone_commits_each_save_with_its_manifest_and_retires_all_but_the_newest_two(tmp_path):
    events: list[tuple[str, dict]] = []
    committer = Committer(
        tmp_path,
        cfg=CheckpointConfig(keep=2, async_mode="none"),
        rank=0,
        world_size=1,
        io=Group(None, world_size=1),
        emit=lambda kind, **f: events.append((kind, f)),
        attempt="7.0",
        env={"torch": "x"},
        manifest_extra={"mesh": "dp1", "config_hash": "abc"},
        interval=lambda: {"delta_s": 1.5, "step_time_s": 0.25},
    )
    for step in (1, 2, 3):
        tmp, final = tmp_path / f"step_{step}.7.0.tmp", tmp_path / f"step_{step}"
        committer.prepare(tmp)
        committer.commit(step, tmp, final, None, None, time.perf_counter(), None, _write(tmp, step))
        committer.wait_retention()
    committer.close()
    manifest = json.loads((tmp_path / "step_3" / "manifest.json").read_text())
    assert sorted(manifest) == sorted(
        ["step", "time", "world_size", "files", "bytes", "env", "data_cursor", "rng_keys", "interval", "async_mode"]
        + ["mesh", "config_hash", "format", "manifest_crc32"]
    )
    assert (manifest["step"], manifest["env"], manifest["interval"]) == (
        3,
        {"torch": "x"},
        {"delta_s": 1.5, "step_time_s": 0.25},
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]
    assert [(k, f["step"], f["tier"]) for k, f in events if k == "checkpoint_saved"] == [
        ("checkpoint_saved", s, "filesystem") for s in (1, 2, 3)
    ]
    assert [f["step"] for k, f in events if k == "checkpoint_deleted"] == [1]
    assert committer.list_steps() == [3, 2]


def test_the_ram_tier_alone_saves_lists_checks_and_reads_back_its_newest_step_then_drops_its_folders(tmp_path):
    events: list[tuple[str, dict]] = []
    local = Group(None, world_size=1)
    root = tmp_path / "shm" / "meshjob-r" / "a"
    at = Placement(root, rank=0, node="a", nodes=["a"])
    cfg = CheckpointConfig(memory_every_steps=1, memory_dir=str(tmp_path / "shm"), async_mode="none")
    emit = lambda kind, **f: events.append((kind, f))  # noqa: E731
    cadence = Cadence(cfg=cfg, mtbf_s=None, tier_shares={FILESYSTEM: 1.0}, rank=0, agree_max=local.max, emit=emit)
    tier = MemoryTier(
        cfg,
        at,
        run_id="r",
        world_size=1,
        manifest_extra={"mesh": "dp1"},
        attempt="7.0",
        ctl=local,
        mem=local,
        emit=emit,
        state=BoundState(rank=0, stager=None),
        cadence=cadence,
        total_steps=None,
    )
    for step in (1, 2):
        tier.submit(step, lambda s=step: {"w": torch.full((4,), float(s))}, rollbacks=0, t0=time.perf_counter())
    assert tier.last_step == 2 and tier.take_cost() is not None and tier.take_cost() is None
    assert [p.name for p in (root / "rank_0").iterdir()] == ["step_2"]  # the older step retired
    assert tier.candidates(rollbacks=0) == [2] and tier.candidates(rollbacks=1) == []  # a step before a rollback
    tier.candidates(rollbacks=0)
    d, problems, manifest, kind = tier.validate(2)
    assert (d, problems, manifest["rank"], manifest["mesh"], kind) == (root / "rank_0" / "step_2", [], 0, "dp1", MEMORY)
    assert torch.equal(load_local(d, {"w": torch.zeros(4)})["w"], torch.full((4,), 2.0))
    assert [(k, f["step"], f["tier"]) for k, f in events] == [
        ("checkpoint_saved", 1, MEMORY),
        ("checkpoint_saved", 2, MEMORY),
    ]
    tier.drop()
    tier.close()
    assert not root.parent.exists()


def test_the_filesystem_restore_alone_lists_checks_and_loads_a_committed_step_refusing_half_written_ones(tmp_path):
    """Steps 3 and 5 committed by the Committer from a bound model (weight = the step); then step 5's shard cut short,
    step 7 a folder of DCP files whose save never committed (no manifest) and an earlier attempt's temporary folder
    left over. The restore, built alone, lists 7, 5, 3, refuses 7 and 5 with their reasons, loads 3 into the model
    (on the saving mesh as saved, on another resharded), and a rollback to 3 moves 5 and 7 aside."""
    events: list[tuple[str, dict]] = []
    emit = lambda kind, **f: events.append((kind, f))  # noqa: E731
    cfg, local = CheckpointConfig(async_mode="none", verify="checksum"), Group(None, world_size=1)
    committer = Committer(
        tmp_path,
        cfg=cfg,
        rank=0,
        world_size=1,
        io=local,
        emit=emit,
        attempt="7.0",
        env={"torch": "x"},
        manifest_extra={"mesh": "dp1"},
        interval=lambda: {},
    )
    model = torch.nn.Linear(2, 2, bias=False)
    state, train = BoundState(rank=0, stager=None), TrainState()
    state.bind([model], [torch.optim.SGD(model.parameters(), lr=0.1)], [], train)
    for step in (3, 5):
        torch.nn.init.constant_(model.weight, float(step))
        train.step, tmp = step, tmp_path / f"step_{step}.7.0.tmp"
        committer.prepare(tmp)
        writer = RecordingWriter(tmp, thread_count=1)
        dcp.save(state.save_state_dict(), storage_writer=writer, no_dist=True)
        committer.commit(step, tmp, tmp_path / f"step_{step}", None, None, time.perf_counter(), None, writer)
        committer.wait_retention()
    shard = tmp_path / "step_5" / "__0_0.distcp"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-8])
    (tmp_path / "step_7").mkdir()
    for f in ("__0_0.distcp", ".metadata"):
        (tmp_path / "step_7" / f).write_bytes((tmp_path / "step_3" / f).read_bytes())
    (tmp_path / "step_9.6.0.tmp").mkdir()
    torch.nn.init.constant_(model.weight, 0.0)
    train.step = 0

    def restore(mesh: str) -> FsRestore:
        return FsRestore(
            tmp_path,
            cfg=cfg,
            rank=0,
            world_size=1,
            ctl=local,
            state=state,
            committer=committer,
            env={"torch": "x"},
            mesh=mesh,
            emit=emit,
        )

    fs = restore("dp1")
    assert fs.candidates() == [7, 5, 3] and not (tmp_path / "step_9.6.0.tmp").exists()
    assert fs.validate(7) == (tmp_path / "step_7", ["no manifest.json (save never committed)"], None)
    assert fs.validate(5) == (
        tmp_path / "step_5",
        [f"__0_0.distcp has {size - 8} bytes, manifest says {size} (truncated?)"],
        None,
    )
    d, problems, manifest = fs.validate(3)
    assert (d, problems, manifest["step"], manifest["mesh"]) == (tmp_path / "step_3", [], 3, "dp1")
    assert fs.load(d, manifest)["resharded"] is False
    assert torch.equal(model.weight.detach(), torch.full((2, 2), 3.0)) and train.step == 3
    torch.nn.init.constant_(model.weight, 0.0)
    assert restore("dp2").load(d, manifest)["resharded"] is True
    assert torch.equal(model.weight.detach(), torch.full((2, 2), 3.0))
    fs.abandon_above(3)
    assert fs.candidates() == [3]
    assert [(k, f.get("step")) for k, f in events if k != "checkpoint_saved"] == [
        ("checkpoint_tmp_removed", None),
        ("checkpoint_abandoned", 7),
        ("checkpoint_abandoned", 5),
    ]
