"""`plan.search_trainable_only`: by default the search ranks only the shapes `jobs.train` builds
(its own validation accepts them) and lists the others under one rejection with the trainer's message; `=false`
ranks them too, after the trainable ones, marked `~`."""

from __future__ import annotations

import pytest

from jobs.config import PlanConfig, compose
from jobs.planner.search import PLANNED_ONLY, render_search, search

# tiny_mla_moe with ep 2 on an H100 node: MLA with tp or cp is refused by the trainer (ep beside pp, dp_replicate
# and tp is built), so both kinds are feasible. The composed config itself (MLA with tp2, on pp2) is one that the
# planner plans and jobs.train refuses.
MOE = [
    "model=tiny_mla_moe",
    "mesh.ep=2",
    "cluster=h100_ib",
    "launcher.nodes=1",
    "launcher.tasks_per_node=8",
    "train.global_batch=8",
    "checkpoint.interval=auto",
    "mesh.tp=2",
    "mesh.pp=2",
    "mesh.dp_shard=2",
    "train.micro_batch=1",
]


@pytest.fixture(scope="module")
def both():
    only, full = compose(MOE), compose(MOE + ["plan.search_trainable_only=false"])
    return (only, search(only)), (full, search(full))


def test_the_default_ranks_only_what_jobs_train_builds():
    assert PlanConfig().search_trainable_only is True
    assert compose(MOE).plan.search_trainable_only is True


def test_the_filtered_ranking_is_the_full_rankings_trainable_shapes_in_the_same_order(both):
    (cfg, only), (_, full) = both
    assert only.trainable_only and not full.trainable_only
    refused = [c for c in full.ranked if not c.trainable]
    assert refused and len(refused) < len(full.ranked)  # the case has both kinds
    assert all(c.trainable for c in only.ranked)
    assert [c.shape for c in only.ranked] == [c.shape for c in full.ranked if c.trainable]
    assert [c.numbers for c in only.ranked] == [c.numbers for c in full.ranked if c.trainable]
    # nothing is lost silently: each refused shape is one rejection, with the trainer's own message
    moved = only.rejected[PLANNED_ONLY]
    assert sorted(label for label, _ in moved) == sorted(c.shape.label() for c in refused)
    label, why = next((lab, w) for lab, w in moved if lab.startswith("tp2 "))
    assert why.startswith(PLANNED_ONLY + ": ") and "model.attention=mla" in why
    count = lambda r: len(r.ranked) + sum(len(v) for v in r.rejected.values())  # noqa: E731
    assert count(only) == count(full)


def test_the_composed_config_that_jobs_train_refuses_is_named_not_ranked(both):
    (cfg, only), (full_cfg, full) = both
    own = next(c for c in full.ranked if c.own)
    assert not own.trainable and own.shape.pp == 2  # ranked among the planned-only shapes in the full list
    assert only.own_rank() is None and only.own_why.startswith(PLANNED_ONLY)
    table = render_search(only, cfg, rows=len(only.ranked))
    assert f"this config is not ranked: {PLANNED_ONLY}" in table
    assert "only the shapes jobs.train builds (plan.search_trainable_only=true" in table.splitlines()[1]
    rows = table.splitlines()[3 : 3 + len(only.ranked)]
    assert not any(row[6:54].rstrip().endswith("~") for row in rows)  # no planned-only row
    full_rows = render_search(full, full_cfg, rows=len(full.ranked)).splitlines()[3 : 3 + len(full.ranked)]
    assert sum(row[6:54].rstrip().endswith("~") for row in full_rows) == len(only.rejected[PLANNED_ONLY])
