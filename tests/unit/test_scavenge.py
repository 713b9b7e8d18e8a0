"""The scavenge of the RAM tier (checkpoint/scavenge.py) without Slurm: which RAM step is flushed, that a flushed
step loads through the filesystem tier bitwise, that a newer or committed filesystem step is never overwritten,
that a partial flush never becomes loadable, and that the ranks' shards merge into one checkpoint at their global
offsets."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from checkpoint.manifest import read_manifest, step_dirs, write_manifest
from checkpoint.scavenge import (
    Flush,
    ScavengeError,
    copy_shares,
    flush_tmp,
    list_run,
    main,
    newest_committed,
    plan_flush,
)
from checkpoint.scavenge_commit import commit_flush
from tests.unit.test_memory_tier import _resume, _run

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _ids(rank: int, attempt: str = "7.0", run: str = "R", world: int = 2) -> dict:
    return {
        "run_id": run,
        "world_size": world,
        "mesh": "dp2",
        "config_hash": "c",
        "attempt": attempt,
        "rollbacks": 0,
        "rank": rank,
    }


def test_the_newest_ram_step_every_rank_holds_from_one_save_above_the_filesystems_is_planned() -> None:
    listings = {
        "n1": {"n1": {"rank_0": {8: _ids(0), 10: _ids(0)}, "partner_of_rank_1": {8: _ids(1), 10: _ids(1)}}},
        # node 2 lost rank 1's own step 10 (only its partner copy on n1 has it); its 12 is from another attempt
        "n2": {"n2": {"rank_1": {8: _ids(1), 12: _ids(1, attempt="7.1")}, "partner_of_rank_0": {8: _ids(0)}}},
    }
    plan = plan_flush(listings, newer_than=6, run_id="R")
    assert plan == Flush(10, "7.0", {0: ("n1", "n1", "rank_0"), 1: ("n1", "n1", "partner_of_rank_1")})
    assert plan.shares("n1") == [("n1", "partner_of_rank_1", 1), ("n1", "rank_0", 0)] and plan.shares("n2") == []
    # step 8: own saves first, wherever they are
    del listings["n1"]["n1"]["partner_of_rank_1"][10]
    assert plan_flush(listings, newer_than=6, run_id="R") == Flush(
        8, "7.0", {0: ("n1", "n1", "rank_0"), 1: ("n2", "n2", "rank_1")}
    )
    assert plan_flush(listings, newer_than=8, run_id="R") is None  # not newer than the filesystem's
    assert plan_flush(listings, newer_than=0, run_id="other") is None  # another run's copies
    listings["n2"]["n2"]["rank_1"][8] = _ids(1, world=4)  # another identity for the same save: never mixed in
    del listings["n1"]["n1"]["partner_of_rank_1"][8]
    assert plan_flush(listings, newer_than=0, run_id="R") is None


def _flush(tmp_path: Path, ck, *, newer_than: int) -> Path:
    root = ck.memory_root.parent
    listing = json.loads(json.dumps(list_run(root)))  # as it crosses srun: JSON, step keys as strings
    plan = plan_flush({"h": listing}, newer_than=newer_than, run_id="runA")
    assert plan is not None
    tmp = flush_tmp(tmp_path / "ckpt", plan.step, "9")
    assert copy_shares(root, tmp, plan.step, plan.shares("h"), checksum=True) == []
    return commit_flush(tmp_path / "ckpt", tmp, plan, world_size=1)


def test_a_flushed_ram_step_is_committed_on_the_filesystem_and_resumed_from_bitwise(tmp_path) -> None:
    want, _, ck = _run(tmp_path, steps=5)  # filesystem steps 2 and 4, RAM step 5
    newest = newest_committed(tmp_path / "ckpt")
    assert newest == 4
    final = _flush(tmp_path, ck, newer_than=newest)
    assert final.name == "step_5" and read_manifest(final, step=5)["scavenged"]["from"] == "memory"
    assert [p.name for p in (tmp_path / "ckpt").iterdir() if "tmp" in p.name] == []
    shutil.rmtree(ck.memory_root.parent)  # the RAM tier is gone (the nodes went to other jobs)
    step, got, ev, _ = _resume(tmp_path)
    assert step == 5 and [(f["step"], f["tier"]) for k, f in ev if k == "checkpoint_loaded"] == [(5, "filesystem")]
    assert all(torch.equal(a, b) for a, b in zip(want, got, strict=True))


def test_a_flush_never_replaces_a_committed_or_newer_filesystem_step(tmp_path) -> None:
    _, _, ck = _run(tmp_path, steps=5)
    root = ck.memory_root.parent
    plan = plan_flush({"h": list_run(root)}, newer_than=4, run_id="runA")
    shutil.copytree(tmp_path / "ckpt" / "step_4", tmp_path / "ckpt" / "step_6")  # a newer step committed meanwhile
    m = read_manifest(tmp_path / "ckpt" / "step_6", step=4)
    write_manifest(tmp_path / "ckpt" / "step_6", {**m, "step": 6})
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    tmp = flush_tmp(tmp_path / "ckpt", 5, "9")
    assert copy_shares(root, tmp, 5, plan.shares("h"), checksum=True) == []
    with pytest.raises(ScavengeError, match="newer step is on the filesystem"):
        commit_flush(tmp_path / "ckpt", tmp, plan, world_size=1)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before  # its temporary folder removed too


def test_a_flush_missing_a_ranks_copy_or_holding_a_damaged_one_leaves_nothing_loadable(tmp_path) -> None:
    _, _, ck = _run(tmp_path, steps=5)
    root, folder = ck.memory_root.parent, tmp_path / "ckpt"
    plan = plan_flush({"h": list_run(root)}, newer_than=4, run_id="runA")
    shard = next((ck.memory_root / "rank_0" / "step_5").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    tmp = flush_tmp(folder, 5, "9")
    problems = copy_shares(root, tmp, 5, plan.shares("h"), checksum=True)
    assert len(problems) == 1 and "crc32" in problems[0]
    with pytest.raises(ScavengeError, match="rank 0's copy of step 5 did not arrive"):
        commit_flush(folder, tmp, plan, world_size=1)
    assert [s for s, _ in step_dirs(folder)] == [4, 2] and not tmp.exists()
    # a flush cut off before its commit (a node killed mid-copy) is a `step_*.tmp`: the next load removes it
    tmp.mkdir()
    step, _, ev, _ = _resume(tmp_path)
    assert step == 4 and not tmp.exists()  # the damaged RAM step is skipped there too


def test_the_ranks_shards_merge_into_one_checkpoint_at_their_global_offsets(tmp_path) -> None:
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    root = tmp_path / "shm" / "meshjob-R"
    for rank in (0, 1):  # two ranks, rows 0-2 and 3-5 of `w`, a replicated `b`, one blob each and a shared one
        d = root / f"node{rank}" / f"rank_{rank}"
        step = d / "step_3"
        tree = {"w": full[3 * rank : 3 * rank + 3].clone(), "b": torch.ones(2), "rng": {f"rank{rank}": bytes([rank])}}
        tree["train_state"] = b"shared"
        dcp.save(tree, checkpoint_id=str(step), no_dist=True)
        from checkpoint.manifest import file_record

        files = {p.name: file_record(p) for p in sorted(step.iterdir())}
        write_manifest(
            step, {**_ids(rank, run="R"), "step": 3, "files": files, "shards": {"w": [[6, 4], [3 * rank, 0]]}}
        )
    plan = plan_flush({f"node{r}": list_run(root) for r in (0,)}, newer_than=0, run_id="R")
    assert plan is not None and plan.step == 3
    folder = tmp_path / "ckpt"
    tmp = flush_tmp(folder, 3, "x")
    assert copy_shares(root, tmp, 3, plan.shares("node0"), checksum=True) == []
    final = commit_flush(folder, tmp, plan, world_size=2)
    got = {"w": torch.zeros(6, 4), "b": torch.zeros(2), "rng": {"rank0": b"", "rank1": b""}, "train_state": b""}
    dcp.load(got, checkpoint_id=str(final), no_dist=True)
    assert torch.equal(got["w"], full) and torch.equal(got["b"], torch.ones(2))
    assert got["rng"] == {"rank0": b"\x00", "rank1": b"\x01"} and got["train_state"] == b"shared"
    assert sorted(p.name for p in final.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]


def test_the_node_side_command_lists_flushes_and_removes_the_runs_folder(tmp_path, capsys) -> None:
    _, _, ck = _run(tmp_path, steps=3)
    root = ck.memory_root.parent
    assert main(["list", str(root)]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert list(listing[ck.node]["rank_0"]) == ["3"]
    tmp = flush_tmp(tmp_path / "ckpt", 3, "1")
    assert main(["flush", str(root), str(tmp), "3", json.dumps([[ck.node, "rank_0", 0]]), "--clean"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["problems"] == [] and out["removed_bytes"] > 0 and not root.exists()
    assert sorted(p.name for p in tmp.iterdir()) == [".ram-manifest.0.json", ".ram-metadata.0", "__0_0.distcp"]
