"""The local launcher's forked ranks leave what the launcher built before the fork to a frozen generation: their
garbage collector (the CPU memory tracker collects at every tracked step) does not scan it again in every rank."""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from types import SimpleNamespace

from jobs.launch import local


def test_forked_ranks_find_the_launchers_objects_frozen_and_the_launcher_collects_them_again(
    tmp_path: Path, monkeypatch
) -> None:
    def rank_main(cfg, env, parent) -> int:  # runs in the forked rank, in place of the trainer
        (tmp_path / f"rank{env.rank}.json").write_text(
            json.dumps({"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count(), "parent": parent})
        )
        return 0

    monkeypatch.setattr(local, "_rank_main", rank_main)
    before = len(gc.get_objects())  # this pytest process: torch, jobs and every test module imported so far
    pids = local._fork_ranks(SimpleNamespace(), [SimpleNamespace(rank=r) for r in range(2)])
    codes = {rank: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid, rank in pids.items()}
    assert codes == {0: 0, 1: 0}
    assert gc.get_freeze_count() == 0  # the launcher's own collections go on as before
    for r in range(2):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen["parent"] == os.getpid()
        # Without the freeze a rank's collector tracks everything the launcher had (~300k objects under jobs.train)
        assert seen["frozen"] >= before > 100 * seen["tracked"], (before, seen)
