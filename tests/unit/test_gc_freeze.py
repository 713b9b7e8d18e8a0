"""What a command's process built before a fork or before its exit is frozen out of the garbage collector: forked
ranks (the CPU memory tracker collects at every tracked step) and the interpreter's finalization do not scan torch's
~300k objects again."""

from __future__ import annotations

import ast
import gc
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from jobs.launch import local
from tests.conftest import REPO


def test_forked_ranks_find_the_launchers_objects_frozen_and_the_launcher_collects_them_again(
    tmp_path: Path, monkeypatch
) -> None:
    def rank_main(cfg, env, parent) -> int:  # runs in the forked rank, in place of the trainer
        seen = {"tracked": len(gc.get_objects()), "frozen": gc.get_freeze_count(), "enabled": gc.isenabled()}
        (tmp_path / f"rank{env.rank}.json").write_text(json.dumps({**seen, "parent": parent}))
        return 0

    monkeypatch.setattr(local, "_rank_main", rank_main)
    gc.unfreeze()  # a launcher that froze nothing before (tests/conftest.py freezes the session's imports)
    try:
        before = len(gc.get_objects())  # this pytest process: torch, jobs and every test module imported so far
        pids = local._fork_ranks(SimpleNamespace(), [SimpleNamespace(rank=r) for r in range(2)])
        after = gc.get_freeze_count(), gc.isenabled()
    finally:
        gc.enable()
        gc.freeze()
    codes = {rank: os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid, rank in pids.items()}
    assert codes == {0: 0, 1: 0}
    assert after == (0, True)  # the launcher's own collections go on from here, over everything
    for r in range(2):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen["parent"] == os.getpid() and seen["enabled"]  # the ranks collect what they make
        # Without the freeze a rank's collector tracks everything the launcher had (~300k objects under jobs.train)
        # (a few of the launcher's objects may be freed between the count and the fork)
        assert min(seen["frozen"], before) > 100 * seen["tracked"], (before, seen)


def test_a_fork_leaves_frozen_what_was_frozen_before() -> None:
    # gc.unfreeze() thaws everything: after a fork the caller's own freeze (this session's) must still hold
    frozen = gc.get_freeze_count()
    with local.frozen_for_fork():
        pass
    assert frozen > 0 and gc.get_freeze_count() >= frozen


_AT_EXIT = r"""
import gc, runpy, sys
sys.argv = ["jobs.train", "mesh.tpp=2"]  # a config error: exit 2 after composing
try:
    runpy.run_module("jobs.train", run_name="__main__", alter_sys=True)
except SystemExit as e:
    print(e.code, gc.get_freeze_count(), int(gc.isenabled()))
"""


def test_python_m_jobs_train_exits_with_its_code_and_its_objects_frozen() -> None:
    p = subprocess.run([sys.executable, "-c", _AT_EXIT], cwd=REPO, capture_output=True, text=True, timeout=120)
    code, frozen, collecting = map(int, p.stdout.split())
    assert code == 2 and "did you mean mesh.tp?" in p.stderr, p.stderr[-2000:]
    assert frozen > 10_000  # hydra, omegaconf and jobs at least; 0 without jobs.exitcodes.exit_command
    assert collecting == 1  # on: only the launchers and ranks turn it off, around their imports, and on again


def test_the_collector_is_off_only_inside_collector_off_and_stays_off_if_it_was_off_before() -> None:
    with local.collector_off():  # where the local launcher imports torch and the trainer
        inside = gc.isenabled()
    assert not inside and gc.isenabled()
    gc.disable()
    try:
        with local.collector_off():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_every_command_that_composes_exits_through_exit_command() -> None:
    # The `__main__` block of each module that uses jobs.cli.main_for (the commands that import torch or Hydra)
    for path in sorted((REPO / "jobs").glob("*.py")):
        tree = ast.parse(path.read_text())
        if "main_for" not in {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}:
            continue
        (block,) = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)]
        assert ast.unparse(block.body[-1]) == "exitcodes.exit_command(main())", path.name
    # and every step of a rendered sbatch script (ranks, agents, batch steps): the module's last `__main__` block
    tree = ast.parse((REPO / "jobs" / "launch" / "slurm.py").read_text())
    block = [n for n in tree.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test)][-1]
    assert ast.unparse(block.body[-1]).startswith("exitcodes.exit_command(_script_cli(")
