"""The search's "trainable" mark is the trainer's own validation: a shape jobs.train would refuse is planned only,
and one it builds (cp, MoE with ep folded over dp_shard * cp) is not marked planned-only by a stale list."""

from __future__ import annotations

import pytest

from jobs.config import compose
from jobs.planner.search import render_search, search

MOE = [
    "model=tiny_moe",
    "mesh.ep=2",
    "cluster=h100_ib",
    "launcher.nodes=1",
    "launcher.tasks_per_node=8",
    "train.global_batch=8",
    "checkpoint.interval=auto",
    "plan.search_trainable_only=false",
    "plan.search_cp_only_when_needed=false",  # every cp shape fits without CP here: rank them to check their mark
]  # the full list


@pytest.fixture(scope="module")
def moe():
    cfg = compose(MOE)
    return cfg, search(cfg)


def test_an_moe_search_marks_trainable_exactly_the_shapes_the_trainer_builds(moe):
    cfg, r = moe
    # parallel/dims.py builds ep folded over dp_shard * cp, beside pp, dp_replicate and tp (etp = tp): every shape
    assert {c.shape: c.trainable for c in r.ranked} == {c.shape: True for c in r.ranked}
    assert any(c.shape.pp > 1 for c in r.ranked) and any(c.shape.dp_replicate > 1 for c in r.ranked)
    assert any(c.shape.tp > 1 for c in r.ranked)
    assert any(c.trainable and c.shape.cp > 1 for c in r.ranked)  # cp is built (the old list said planned only)
    built = [c.trainable for c in r.ranked]
    assert built == sorted(built, reverse=True)  # what jobs.train builds first


def test_the_table_marks_only_the_refused_shapes_planned_only(moe):
    cfg, r = moe
    rows = render_search(r, cfg, rows=len(r.ranked)).splitlines()[3 : 3 + len(r.ranked)]
    assert [row[6:54].rstrip().endswith("~") for row in rows] == [not c.trainable for c in r.ranked]  # the label column
