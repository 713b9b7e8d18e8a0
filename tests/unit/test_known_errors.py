"""The planner's known errors against the papers they cite, one test per error."""

from __future__ import annotations

import pytest

from jobs.config import compose
from jobs.planner import arith as P
from jobs.planner.gate import build_plan, validate_for_planning
from jobs.planner.measure import stage_shapes
from jobs.telemetry import model_flops_per_token

LLAMA3_405B = ["llama3_405b_8k_8192gpu", "llama3_405b_8k_16384gpu", "llama3_405b_131k_16384gpu"]


@pytest.mark.parametrize("preset", LLAMA3_405B)
def test_llama3_405b_first_chunk_holds_only_the_embedding_with_v8(preset):
    """ "The Llama 3 Herd of Models" (arXiv 2407.21783) §3.3.2, pipeline parallelism: "we reduce one
    Transformer layer each from the first and the last stages. This means that the first model chunk on
    the first stage has only the embedding, and the last model chunk on the last stage has only output
    projection and loss calculation." 126 layers in 1-layer chunks on pp 16: v = 128 / 16 = 8."""
    cfg = compose([f"+experiment={preset}"])
    d, _ = validate_for_planning(cfg)
    assert d.stages_per_rank == 8 and d.num_stages == 128
    shapes = stage_shapes(cfg, d)
    first, last = shapes[0][0], shapes[15][-1]
    assert first.first and first.layers == () and last.last and last.layers == ()
    assert all(len(s.layers) == 1 for r in range(16) for s in shapes[r] if s is not first and s is not last)
    assert [sum(len(s.layers) for s in shapes[r]) for r in (0, 1, 15)] == [7, 8, 7]
    assert P.bubble_fraction(
        pp=16, microbatches=d.microbatches, stages_per_rank=8, schedule="interleaved_1f1b"
    ) == pytest.approx(15 / (8 * d.microbatches + 15))


def test_context_parallel_all_gathers_k_and_v_as_llama3():
    """Llama 3 paper §3.3.2, context parallelism: "we first all-gather the key (K) and value (V) tensors,
    and then compute attention output for the local query (Q) tensor chunk" (not ring attention).
    Table 4 row 3 (131K): tp 8, cp 16. Per block and microbatch one K/V all-gather forward, again in the
    recompute (full AC), one dK/dV reduce-scatter backward; each moves (cp-1) local chunks of K/V:
    8 KV heads / tp 8 = 1 head x (128 + 128) dims x 2 bytes x 131072 / 16 tokens."""
    plan = build_plan(compose(["+experiment=llama3_405b_131k_16384gpu"]), measure=False)
    cp = [c for c in plan.comm if c["axis"] == "cp"]
    assert {c["collective"] for c in cp} == {"all_gather", "reduce_scatter"}
    layers = int(plan.peak_role.split("[")[1].split()[0])
    kv_local = 1 * 256 * 2 * 131072 // 16
    ag = next(c for c in cp if c["collective"] == "all_gather")
    rs = next(c for c in cp if c["collective"] == "reduce_scatter")
    mb = 16  # global batch 128 / dp 8 / micro batch 1
    assert ag["count"] == mb * 2 * layers and ag["bytes"] == ag["count"] * 15 * kv_local
    assert rs["count"] == mb * layers and rs["bytes"] == rs["count"] * 15 * kv_local


def test_mla_heads_are_192_for_queries_and_keys_and_128_for_values():
    """ "DeepSeek-V3 Technical Report" (arXiv 2412.19437) §4.2: 128 heads of d_h = 128 plus a decoupled
    RoPE part d_h^R = 64 for queries and keys, values of d_h = 128; 671B total, 37B activated. The
    attention FLOPs use those dims (not dim / n_heads = 56), and the trainer's MFU and the planner
    count with the one formula."""
    m = compose(["model=deepseek_v3"]).model
    assert P.attention_head_dims(m) == (192, 128)
    pc = P.count_params(m)
    assert pc.total / 1e9 == pytest.approx(671, abs=0.5) and pc.active / 1e9 == pytest.approx(37, abs=0.6)
    matmul = pc.active - pc.embedding - sum(b.norms for b in pc.blocks) - pc.final_norm
    assert P.flops_per_token(m, seq_len=4096) == 6 * matmul + 6 * 61 * 4096 * 128 * (192 + 128) / 2
    assert model_flops_per_token(m, seq_len=4096) == P.flops_per_token(m, seq_len=4096)
    assert P.kv_bytes_per_token(m) == 2 * 128 * (192 + 128)
    with pytest.raises(ValueError, match="model.qk_rope_head_dim"):
        P.attention_head_dims(compose(["model=deepseek_v3", "model.qk_rope_head_dim=0"]).model)


def test_deepseek_v3_dispatch_is_priced_as_the_trainer_sends_it_seven_copies_per_token_across_nodes():
    """DeepSeek-V3 (report §2.1.2, §4.2: M = 4 nodes per token) on ep 64 over 8 nodes of 8:
    jobs.train's dispatch (parallel/ep.py) sends each of a token's 8 copies straight to its expert's rank, no
    per-node deduplication (DeepEP's, §3.2.2: one IB copy per target node, min(8, 4, 8) x 7/8 = 3.5 copies): 8 x 7/8
    = 7 copies cross nodes, 8 x 7/64 = 0.875 stay in the node on another GPU; together all 8 x 63/64 that leave the
    rank, as without the node limit. Twice the deduplicated inter-node bytes (551 GiB planned before, 1.1e3 now)."""
    plan = build_plan(compose(["+experiment=deepseek_v3_2048gpu"]), measure=False)
    ep = {c["axis"]: c for c in plan.comm if c["collective"] == "all_to_all"}
    assert ep["ep"]["link"] == "inter" and ep["ep_intra"]["link"] == "intra"
    unlimited = build_plan(compose(["+experiment=deepseek_v3_2048gpu", "model.moe_max_nodes=0"]), measure=False)
    old = next(c for c in unlimited.comm if c["collective"] == "all_to_all")
    assert ep["ep"]["count"] == old["count"]
    assert ep["ep"]["bytes"] / old["bytes"] == pytest.approx((8 * 7 / 8) / (8 * 63 / 64), rel=1e-6)
    assert ep["ep_intra"]["bytes"] / old["bytes"] == pytest.approx((8 * 7 / 64) / (8 * 63 / 64), rel=1e-6)
    assert ep["ep"]["bytes"] / ((4 * 7 / 8) / (8 * 63 / 64) * old["bytes"]) == pytest.approx(2.0, rel=1e-6)


def test_llama3_8b_and_70b_presets_run_on_the_a100s_their_torchtitan_source_names():
    """pytorch/torchtitan torchtitan/models/llama3/train_configs/llama3_8b.toml and llama3_70b.toml open
    with "NOTE: this toml config is a preset for 64 A100 GPUs"; NVIDIA A100 datasheet: 312 dense bf16
    TFLOPS, 80 GB."""
    for preset in ("llama3_8b", "llama3_70b"):
        cl = compose([f"+experiment={preset}"]).cluster
        assert (cl.name, cl.gpu_bf16_tflops, cl.gpu_mem_gib, cl.intra_node_bw_GBps) == ("a100_ib", 312.0, 80.0, 300.0)


def test_h800_nvlink_is_the_160_gbps_the_deepseek_report_measured():
    """DeepSeek-V3 report §3.2.2: "NVLink offers a bandwidth of 160 GB/s, roughly 3.2 times that of IB
    (50 GB/s)"."""
    cl = compose(["cluster=h800_ib"]).cluster
    assert cl.intra_node_bw_GBps == 160.0 and cl.intra_node_bw_GBps / cl.inter_node_bw_GBps == pytest.approx(3.2)


def test_h100_node_mtbf_is_derived_from_llama3s_interruptions():
    """Llama 3 paper §3.3.4: 419 unexpected interruptions in a 54-day snapshot on 16,384 GPUs (2,048
    nodes): job MTBF 54·24/419 h, node MTBF that x 2048."""
    for name in ("h100_ib", "llama3_h100"):
        assert compose([f"cluster={name}"]).cluster.node_mtbf_hours == pytest.approx(54 * 24 / 419 * 2048, rel=1e-3)
