"""The planner checked against what it was not fitted to (issue 22): every expert-parallel leg on the
critical path, achieved bandwidths taken as achieved, pipeline buffers counted once, selective AC chosen per
stage, unknown restart costs said to be unknown, and held-out published runs predicted within 15%."""

from __future__ import annotations

import pytest

from jobs.config import compose
from jobs.planner import arith as P
from jobs.planner.gate import _stage_shapes, build_plan, render, validate_for_planning


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


def test_pipeline_receive_buffers_have_their_own_column_and_are_not_counted_twice_under_ac():
    # A non-first stage's received activations are the first block's input; under AC that input is what the
    # checkpoint keeps: one tensor, in `p2p_bytes` (one buffer per microbatch, allocated up front), not again
    # in the activations.
    m = compose(["model=llama3_8b"]).model
    stages = [P.StageShape((4, 5), False, False), P.StageShape((12, 13), False, False)]  # interleaved, not the ends
    kw = dict(tp=1, fsdp=1, pp=4, microbatches=8, stages_per_rank=2, schedule="interleaved_1f1b", seq_len=1024,
              micro_batch=1, pp_rank=1)
    full = P.rank_memory(m, stages, activation_checkpointing="full", **kw)
    hop = 2 * 1024 * m.dim
    assert full.p2p_bytes == 8 * hop * 2 * 2  # 8 microbatches x (activation in + gradient in) x 2 stages
    per_block_mb = P.layers_in_flight(pp=4, microbatches=8, layers_on_rank=4, stages_per_rank=2,
                                      schedule="interleaved_1f1b", pp_rank=1) / 4
    biggest = P.layer_activation_bytes(m, layer=13, seq_len=1024, micro_batch=1, tp=1)
    # 4 checkpointed inputs per microbatch in flight, 2 of which (each stage's first) are receive buffers
    assert full.activation_bytes == int(per_block_mb * 4 * hop) - int(2 * hop * per_block_mb) + biggest
    none = P.rank_memory(m, stages, activation_checkpointing="none", **kw)  # no checkpoint keeps the input
    assert none.activation_bytes == int(per_block_mb * 4 * P.layer_activation_bytes(m, layer=4, seq_len=1024,
                                                                                     micro_batch=1, tp=1))
    text = render(build_plan(compose(["+experiment=llama3_405b_8k_8192gpu"]), measure=False))
    assert any(line.startswith("memory per rank") and "pp_recv" in line for line in text.splitlines())


def test_selective_ac_checkpoints_half_of_every_pipeline_rank_not_all_of_one():
    # Llama 3 405B at 8K, interleaved 1-layer chunks: pp rank r holds layers r, r+16, ... (one parity); by the
    # global layer index rank 0 recomputed none and rank 1 all. Chosen per rank, each recomputes half.
    cfg = compose(["+experiment=llama3_405b_8k_16384gpu", "train.activation_checkpointing=selective"])
    shapes = _stage_shapes(cfg, validate_for_planning(cfg)[0])
    for stages in shapes.values():
        layers = [i for st in stages for i in st.layers]
        assert len(P.checkpointed_layers(layers, mode="selective", every=2)) == len(layers) // 2
    acts = [r["activation_bytes"] for r in build_plan(cfg, measure=False).roles]
    assert max(acts) / min(acts) < 1.5, acts


def test_an_unknown_restart_cost_gives_an_unknown_goodput_not_one_that_looks_measured(tmp_path):
    # No ledger in run.dir and no plan.restart_overhead_s: the restart is the load alone (2.4 s of 4.87 TB at
    # 2 TB/s), which once printed goodput 0.999 at a 12 s interval as if known.
    plan = build_plan(compose(["+experiment=llama3_405b_8k_16384gpu", f"run.dir={tmp_path}"]), measure=False)
    assert plan.goodput_expected is None and not plan.checkpoint["restart_known"]
    row = next(r for r in plan.readiness if r["question"] == "what happens when a rank dies?")
    assert row["status"] == "warn" and "restart unknown" in row["answer"] and "goodput unknown" in row["answer"]
    assert "lower bound" in row["answer"]  # the 12 s interval rests on a save cost without its fixed part
    check = next(c for c in plan.checks if c.name == "goodput")
    assert "unknown" in check.why and "Llama 3" in check.why and "§3.3.4" in check.why  # a labelled reference
    assert "expected goodput unknown" in render(plan)
    # An explicit assumption gives a number again, labelled as the user's.
    told = build_plan(compose(["+experiment=llama3_405b_8k_16384gpu", f"run.dir={tmp_path}",
                               "plan.restart_overhead_s=300", "plan.save_fixed_s=5"]), measure=False)
    assert told.goodput_expected == pytest.approx(0.944, abs=0.005)
    assert "user assumption" in told.checkpoint["restart_source"]
    assert next(r for r in told.readiness if r["question"] == "what happens when a rank dies?")["status"] == "ok"
