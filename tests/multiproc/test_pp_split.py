"""A user's pipeline split and the fused AdamW change the speed, not the losses."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_train
from tests.multiproc._references import SINGLE_RUN, SINGLE_STEPS

pytestmark = pytest.mark.multiproc

COMMON = [f"train.steps={SINGLE_STEPS}", "checkpoint.enabled=false"]
PP2 = ["mesh.pp=2", "mesh.dp_shard=1", "mesh.tp=1", "launcher.tasks_per_node=2"]


def _losses(overrides: list[str], run_dir) -> list[float]:
    run = run_train([*COMMON, *overrides], run_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.losses()


# Both cases compare with one process (the session's shared SINGLE_RUN, also test_compile's eager run) within the
# parity bound of tests/multiproc/test_parity.py (rel 1e-5; meshes differ from one process by ~1e-6 relative):
# a split or an AdamW kernel that changed the numbers beyond reduction order differs from it as it would from the
# default split / the foreach kernel on the same mesh, which were their references before (one more run each).


def test_a_user_split_trains_with_the_default_splits_losses(data_path: str, tmp_path, shared_run) -> None:
    single = shared_run([*SINGLE_RUN, f"data.path={data_path}"]).losses()  # what the default split [2, 2] equals too
    user = _losses([*PP2, f"data.path={data_path}", "mesh.pp_layers_per_stage=[3,1]"], tmp_path / "user")
    starts = [json.loads(line) for line in (tmp_path / "user" / "events.jsonl").read_text().splitlines()]
    logged = [e["pp_layers_per_stage"] for e in starts if e["kind"] == "train_start"]
    assert logged == [[3, 1], [3, 1]]  # each rank's train_start event names the split
    assert len(single) == len(user) == SINGLE_STEPS
    for step, (a, b) in enumerate(zip(user, single), start=1):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: split [3, 1] loss {a} vs one process {b}"
    assert user[-1] < user[0]


def test_fused_adamw_gives_the_foreach_losses(data_path: str, tmp_path, shared_run) -> None:
    # FSDP2 on 2 ranks: the optimizer steps DTensor shards. The reference is one process with foreach AdamW
    # (optim.fused=null is foreach on CPU).
    foreach = shared_run([*SINGLE_RUN, f"data.path={data_path}"]).losses()
    fsdp = ["mesh.pp=1", "mesh.dp_shard=2", "mesh.tp=1", "launcher.tasks_per_node=2", f"data.path={data_path}"]
    fused = _losses([*fsdp, "optim.fused=true"], tmp_path / "fused")
    assert len(fused) == len(foreach) == SINGLE_STEPS
    for step, (a, b) in enumerate(zip(fused, foreach), start=1):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: fused {a} vs foreach {b}"
