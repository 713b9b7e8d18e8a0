"""Costs the step-time model once left out on a GPU profile, each from first principles: GEMM shapes that do not fill
their tile waves (NVIDIA's Matrix Multiplication Background guide), FSDP2's copy-out and copy-in through HBM, and the
optimizer step's bytes; and Megatron's strong-scaling rows, whose per-GPU rate falls as the paper's does."""

from __future__ import annotations

import dataclasses

import pytest

from jobs.config import compose
from jobs.planner import arith as P
from jobs.planner import hardware as H
from jobs.planner import steptime as S
from jobs.planner.gate import build_plan
from jobs.planner.gemm import Gemm, gemms_wave_efficiency, model_gemms, rank_gemms, wave_efficiency


def test_a_gemm_whose_tiles_do_not_fill_the_last_wave_runs_at_its_share_of_the_rate():
    # NVIDIA's guide: 108 SMs of an A100 hold 108 tiles of 256x128 at once. An 8192x4096 output is 32 x 32 = 1,024
    # tiles: 10 waves, the last one 52 of 108 full
    assert wave_efficiency(Gemm(8192, 4096, 4096), 108) == pytest.approx(1024 / 1080)
    # GPT-3's query projection on one tp8 rank (2,048 tokens x 12,288 / 8): 8 x 12 = 96 tiles, one wave of 108
    assert wave_efficiency(Gemm(2048, 1536, 12288), 108) == pytest.approx(96 / 108)
    # Llama 3 405B's key projection at tp8 (128 columns) pads every 256-wide tile to twice its work: 32 tiles of 132
    assert wave_efficiency(Gemm(8192, 128, 16384), 132) == pytest.approx(8192 * 128 / (132 * 256 * 128))
    assert wave_efficiency(Gemm(8192, 4096, 4096), 0) == 1.0  # no SM count: every shape at the best one's rate


def test_a_ranks_gemms_are_its_blocks_and_the_head_and_their_efficiency_is_flop_weighted():
    m = compose(["model=llama3_8b"]).model
    whole = rank_gemms(m, tokens=8192, tp=1, blocks=m.n_layers, head=True)
    assert sum(g.count * g.flops for g in whole) == sum(g.count * g.flops for g in model_gemms(m, tokens=8192))
    four = rank_gemms(m, tokens=8192, tp=1, blocks=4, head=False)
    flops = sum(g.count * g.flops for g in four)
    assert flops == 3 * 2 * 8192 * sum(b.active - b.norms for b in P.count_params(m).blocks[:4])
    padded = sum(g.count * g.flops / wave_efficiency(g, 108) for g in four)
    assert gemms_wave_efficiency(four, 108) == pytest.approx(flops / padded)
    assert gemms_wave_efficiency(four, 108) == pytest.approx(0.953, abs=0.0005)


def test_the_predicted_compute_divides_the_gemms_by_their_shapes_efficiency_and_not_attention():
    cfg = compose(["+experiment=llama3_8b"])
    hw = H.hardware(cfg.cluster, dtype="bf16", tasks_per_node=8)
    assert hw.gemm_sms == 108  # a100_ib's cluster.gpu_sms
    m, stages = cfg.model, [P.StageShape(tuple(range(4)), False, False)]
    kw = dict(role="pp0", shape={"dp_shard": 64}, microbatches=1, micro_batch=1, seq_len=8192, bubble=0.0)
    kw |= dict(recomputed=[], world=64)
    shaped = S.predict_rank(m, stages, [], hw, **kw).parts["compute_s"]
    flat = S.predict_rank(m, stages, [], dataclasses.replace(hw, gemm_sms=0), **kw).parts["compute_s"]
    attention = 3 * 4 * S.attention_flops(m, tokens=8192, seq_len=8192, tp=1) / (hw.attention_at(8192) * 1e12)
    eff = S.gemm_efficiency(m, stages, hw, tokens=8192, tp=1)
    assert eff == pytest.approx(0.953, abs=0.0005)
    assert shaped - attention == pytest.approx((flat - attention) / eff)


def test_the_plan_prints_the_share_of_the_rate_the_gemm_shapes_reach_and_its_source():
    from jobs.planner.render import render

    text = render(build_plan(compose(["+experiment=llama3_8b"]), measure=False))
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("GEMM shapes at"))
    assert "0.955 of it" in line and "Matrix Multiplication Background" in line and "(108 SMs)" in line


def test_a_calibrated_rate_is_not_priced_by_shape_again():
    # the calibration timed the model's own shapes: its rate holds their quantization already
    cl = dataclasses.replace(compose(["cluster=a100_ib"]).cluster, matmul_tflops={"bf16": 250.0})
    hw = H.hardware(cl, dtype="bf16", tasks_per_node=8)
    assert hw.matmul_tflops == 250.0 and hw.gemm_sms == 0 and hw.attention_tflops == 0.0


def test_fsdp2_copy_out_and_copy_in_move_their_bytes_through_hbm(monkeypatch):
    # an all-gather of 2 GB gathered (bf16) is copied out once: read + write 4 GB; a reduce-scatter of 4 GB of fp32
    # input is built from bf16 gradients: 2 GB read + 4 GB written. tp's collectives move no FSDP buffer.
    hw = H.hardware(compose(["cluster=a100_ib"]).cluster, dtype="bf16", tasks_per_node=8)
    items = [
        {"collective": "all_gather", "axis": "dp_shard", "group": 64, "bytes": 2e9 * 63 / 64},
        {"collective": "reduce_scatter", "axis": "dp_shard*cp", "group": 64, "bytes": 4e9 * 63 / 64},
        {"collective": "all_reduce", "axis": "tp", "group": 8, "bytes": 1e12},
    ]
    assert S.fsdp_copy_s(items, hw, compute_bytes=2) == pytest.approx(10e9 / 2039e9)
    cfg = compose(["+experiment=llama3_8b", "train.activation_checkpointing=selective"])
    plan = build_plan(cfg, measure=False)
    copies = S.fsdp_copy_s(plan.comm, hw, compute_bytes=2)
    # 8B (8.0e9 parameters), one microbatch: the blocks gathered for forward and again for backward, the root (embedding,
    # head) once, 4 B a copy-out; every parameter reduced once, 6 B: 0.053 s at 2,039 GB/s
    assert copies == pytest.approx(0.053, abs=0.001)
    monkeypatch.setattr(S, "fsdp_copy_s", lambda *a, **k: 0.0)
    assert plan.step["memory_bound_s"] - build_plan(cfg, measure=False).step["memory_bound_s"] == pytest.approx(copies)


def test_the_optimizer_step_on_a_gpu_profile_is_its_bytes_at_the_hbm_rate():
    # fused AdamW reads p, g, m, v and writes p, m, v (28 B per fp32 parameter), the norm pass reads g (4 B)
    hw = H.hardware(compose(["cluster=a100_ib"]).cluster, dtype="bf16", tasks_per_node=8)
    assert hw.optimizer_ns_per_param == pytest.approx(32 / 2039.0)
    plan = build_plan(compose(["+experiment=llama3_8b"]), measure=False)
    shard = max(r["params_elems"] for r in plan.roles)
    assert plan.step["optimizer_s"] == pytest.approx(shard * 32 / 2039e9)


def test_megatron_strong_scaling_loses_per_gpu_rate_as_the_paper_does():
    # Narayanan et al. 2021 Table 2: 153, 149, 141 teraFLOP/s per GPU on 384, 768, 1,536 A100 (the bubble of 12
    # stages grows as the 1,536 sequences are spread over more pipelines)
    from tests.unit.test_planner_held_out import HELD_OUT

    rows = [f"megatron_gpt3_175b_{n}gpu_tflops" for n in (384, 768, 1536)]
    rates = [HELD_OUT[r][2](build_plan(compose(HELD_OUT[r][0]), measure=False)) for r in rows]
    assert rates[0] > rates[1] > rates[2]
    assert rates[2] / rates[0] == pytest.approx(141 / 153, abs=0.03)
