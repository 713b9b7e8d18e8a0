"""The planner's arithmetic (jobs/planner/arith.py) against published figures; each row cites its source."""

from __future__ import annotations

import math

import pytest
from omegaconf import OmegaConf

from checkpoint.interval import daly_interval, job_mtbf_s, plan_interval, young_interval
from jobs.config import CONF_DIR, ModelConfig
from jobs.planner import arith as P


def model(name: str, **overrides) -> ModelConfig:
    d = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml"))
    d.update(overrides)
    return ModelConfig(**d)


@pytest.mark.parametrize(
    "name, published",
    [
        ("llama3_8b", 8.03e9),  # Llama 3 8B model card (huggingface meta-llama/Meta-Llama-3-8B): 8.03B
        ("llama3_70b", 70.6e9),  # Llama 3 70B model card: 70.6B
        ("llama3_405b", 405e9),  # "The Llama 3 Herd of Models" (arXiv 2407.21783) Table 3: 405B
    ],
)
def test_llama3_parameter_counts_are_within_1_percent_of_published(name, published):
    total = P.count_params(model(name)).total
    assert abs(total / published - 1) < 0.01, total


def test_deepseek_v3_total_671b_and_activated_37b_within_2_percent():
    # "DeepSeek-V3 Technical Report" (arXiv 2412.19437), abstract: 671B total, 37B activated per token
    # (the 14B multi-token-prediction module is excluded from both, as there).
    pc = P.count_params(model("deepseek_v3"))
    assert abs(pc.total / 671e9 - 1) < 0.02, pc.total
    assert abs(pc.active / 37e9 - 1) < 0.02, pc.active
    assert pc.total == 671_026_404_352  # exact count from config.json's shapes
    assert pc.active == 37_552_282_624


def test_dense_model_activates_every_parameter():
    pc = P.count_params(model("llama3_8b"))
    assert pc.active == pc.total == 8_030_261_248


@pytest.mark.parametrize(
    "pp, m, expected",
    [
        (4, 4, 3 / 7),  # GPipe (Huang et al. 2019) §2.2: bubble O((K-1)/(M+K-1)); K=4 stages, M=4
        (4, 32, 3 / 35),  # same, M=32 >= 4K: the paper's "negligible" regime (8.6%)
        (16, 16, 15 / 31),  # Llama 3 405B Table 4 row 2 shape without interleaving: 48%
    ],
)
def test_gpipe_bubble_is_p_minus_1_over_m_plus_p_minus_1(pp, m, expected):
    assert P.bubble_fraction(pp=pp, microbatches=m, schedule="gpipe") == pytest.approx(expected)
    assert P.bubble_fraction(pp=pp, microbatches=m, schedule="1f1b") == pytest.approx(expected)


def test_interleaved_bubble_divides_by_stages_per_rank():
    # Narayanan et al. 2021 (Megatron-LM, SC21) §2.2.2: bubble time fraction (p-1)/(v·m) of the
    # ideal time, i.e. (p-1)/(v·m + p-1) of the step; p=16, m=16, v=4 -> 15/79.
    assert P.bubble_fraction(pp=16, microbatches=16, stages_per_rank=4, schedule="interleaved_1f1b") == pytest.approx(
        15 / 79
    )
    assert P.bubble_fraction(pp=1, microbatches=8) == 0.0


def test_llama3_failure_rate_gives_a_job_mtbf_of_3_1_hours():
    # "The Llama 3 Herd of Models" §3.3.4: 419 unexpected interruptions in a 54-day snapshot at 16,384 GPUs.
    mtbf = 54 * 24 * 3600 / 419
    assert mtbf == pytest.approx(11_135.1, abs=0.1)
    assert mtbf / 3600 == pytest.approx(3.093, abs=1e-3)
    # conf/cluster/llama3_h100.yaml stores it per node: 6,335 h over 2,048 nodes gives back ~3.09 h
    assert job_mtbf_s(mtbf_job_hours=None, mtbf_node_hours=6335.0, nodes=2048) / 3600 == pytest.approx(3.093, abs=2e-3)


def test_interval_at_the_llama3_failure_rate_lands_in_20_to_30_minutes_for_a_100_s_save():
    # Daly 2006 eq. 37 via checkpoint/interval.py at M = 11,135 s. A 100 s blocking save (e.g. a
    # synchronous 4.9 TB save at ~50 GB/s) gives 23.8 min; Young's first-order 24.9 min.
    mtbf = 54 * 24 * 3600 / 419
    assert daly_interval(100.0, mtbf) == pytest.approx(1426.5, abs=0.5)
    assert young_interval(100.0, mtbf) == pytest.approx(1492.3, abs=0.5)
    for delta in (70.0, 100.0, 140.0):
        assert 20 * 60 <= daly_interval(delta, mtbf) <= 30 * 60
    # Outside that band of save costs, it does not land there: the interval follows sqrt(2 δ M).
    assert daly_interval(5.0, mtbf) == pytest.approx(330.4, abs=0.5)  # async save on Tectonic: ~5.5 min
    assert daly_interval(300.0, mtbf) > 30 * 60


def test_goodput_at_the_llama3_failure_rate_with_a_5_s_save():
    # Expected useful fraction (Daly 2006 eq. 20): 5 s saves, 302 s restarts, M = 3.09 h.
    ip = plan_interval(delta=5.0, mtbf=54 * 24 * 3600 / 419, restart=302.0)
    assert ip.goodput == pytest.approx(0.9443, abs=1e-3)


def test_sixteen_bytes_per_parameter_heuristic():
    # ZeRO (Rajbhandari et al. 2020) §3.1: mixed-precision Adam holds 16 bytes per parameter
    # (2 + 2 + 12); FSDP2 with fp32 sharded params/grads + AdamW is 4 + 4 + 8 = 16 as well.
    assert P.PARAM_BYTES + P.GRAD_BYTES + P.OPTIM_BYTES == P.HEURISTIC_BYTES_PER_PARAM == 16
    # Llama 3 405B over pp16 * tp8 * dp_shard128 = 16,384 model shards: 0.396 GB per rank
    assert P.heuristic_bytes_per_rank(405_853_388_800, model_shards=16384) == 396_341_200


def test_full_activation_checkpointing_keeps_2sbh_over_t_per_layer():
    # Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.2/Table 2:
    # with tensor + sequence parallelism and full recomputation a layer stores its input, 2·s·b·h/t bytes.
    b = P.checkpointed_layer_bytes(seq_len=8192, micro_batch=1, dim=16384, tp=8)
    assert b == 2 * 8192 * 1 * 16384 // 8 == 33_554_432
    # context parallel shards the sequence: cp16 at 131K stores the same as cp1 at 8K
    assert P.checkpointed_layer_bytes(seq_len=131072, micro_batch=1, dim=16384, tp=8, cp=16) == b


def test_activation_without_checkpointing_counts_the_saved_tensors():
    # Llama 3 8B block, s=8192, b=1, no TP: norm inputs fp32 (2·4sbh) + the norms' bf16 outputs the weight product
    # saves (2·2sbh) + gathered linear inputs (2·2sbh) + SDPA q,k,v 3·2sbh + output 2sbh + lse 4·s·b·heads + SwiGLU
    # 4·2sbf. (It once counted q/k before RoPE, 2sb(h+h_kv), which RoPE's products do not save, and not the
    # norms' outputs: 1.5 sbh short on this GQA block; saved_tensors_hooks measure it in test_planner_memory_published.)
    m = model("llama3_8b")
    s, h, f = 8192, 4096, 14336
    expected = 8 * s * h + 4 * s * h + 4 * s * h + 6 * s * h + 2 * s * h + 4 * s * 32 + 8 * s * f
    assert P.layer_activation_bytes(m, layer=0, seq_len=s, micro_batch=1, tp=1) == expected


def test_fsdp_collective_counts_match_commdebugmode():
    # measured with CommDebugMode on torch 2.13, gloo (10-block model, per-block + root wrapping, one step):
    # reshard_after_forward=True: 11 all-gathers forward + 10 backward, 11 reduce-scatters;
    # with a pipeline (reshard_after_forward=False): 11 all-gathers, 11 reduce-scatters.
    m = model("tiny", n_layers=10)
    stages = [P.StageShape(tuple(range(10)), True, True)]
    kw = dict(
        dp_replicate=1,
        fsdp=2,
        tp=1,
        cp=1,
        ep=1,
        microbatches=1,
        seq_len=32,
        micro_batch=2,
        sequence_parallel=False,
        activation_checkpointing="none",
    )
    flat = {c.collective: c.count for c in P.comm_per_step(m, stages, pp=1, **kw)}
    assert flat == {"all_gather": 21, "reduce_scatter": 11}
    piped = {c.collective: c.count for c in P.comm_per_step(m, stages, pp=2, **kw) if c.axis == "dp_shard"}
    assert piped == {"all_gather": 11, "reduce_scatter": 11}


def test_fsdp_bytes_are_the_ring_share_of_the_unsharded_stage():
    m = model("llama3_8b")
    stages = [P.StageShape(tuple(range(32)), True, True)]
    items = {
        c.collective: c
        for c in P.comm_per_step(
            m,
            stages,
            pp=2,
            dp_replicate=1,
            fsdp=64,
            tp=1,
            cp=1,
            ep=1,
            microbatches=1,
            seq_len=8192,
            micro_batch=1,
            sequence_parallel=False,
            activation_checkpointing="none",
        )
    }
    assert items["all_gather"].bytes == int(63 / 64 * 2 * 8_030_261_248)  # bf16, (n-1)/n of the buffer
    assert items["reduce_scatter"].bytes == int(63 / 64 * 4 * 8_030_261_248)  # fp32 reduction


def test_expert_parameters_shard_over_ep_then_the_experts_own_dp():
    # DeepSeek-V3 on pp16 * ep64 * dp2 (dp_shard 128 = ep 64 * 2): the dense part shards 128 ways, the
    # routed experts 64 (ep) * 2 ways: the same 1/128 of each, as FSDP over ep x dp in the notes §7.
    m = model("deepseek_v3")
    stage = [P.StageShape((3,), False, False)]  # one MoE block
    dense, experts = P.stage_elems(m, stage, tp=1, ep=64)
    b = P.block_params(m, 3)
    assert experts == b.experts // 64 == 4 * 3 * 7168 * 2048
    assert P.shard_elems(m, stage, tp=1, fsdp=128, ep=64) == -(-dense // 128) + experts // 2


def test_axis_spans_nodes_follows_the_row_major_mesh():
    shape = {"pp": 16, "dp_replicate": 1, "dp_shard": 128, "cp": 1, "tp": 8, "ep": 1}
    assert not P.axis_spans_nodes("tp", shape, nvlink_domain=8)
    assert P.axis_spans_nodes("dp_shard", shape, nvlink_domain=8)
    assert P.axis_spans_nodes("pp", shape, nvlink_domain=8)
    assert P.axis_spans_nodes("tp", {**shape, "tp": 16}, nvlink_domain=8)


def test_flops_per_token_is_6n_plus_causal_attention():
    # Kaplan et al. 2020 §2.1 (C ≈ 6N per token) plus attention 6·L·s·d/2 for a causal mask.
    m = model("llama3_405b")
    pc = P.count_params(m)
    n_matmul = pc.total - pc.embedding - sum(b.norms for b in pc.blocks) - pc.final_norm
    assert P.flops_per_token(m, seq_len=8192) == pytest.approx(6 * n_matmul + 6 * 126 * 8192 * 16384)
    # Llama 3 paper Table 4 row 2 reports 400 TFLOPs/GPU at 41% MFU on 16,384 GPUs: 16M tokens / step
    # at this FLOP count gives 6.4 s / step, i.e. 2.6 M tokens/s.
    tokens_per_s = 16384 * 400e12 / P.flops_per_token(m, seq_len=8192)
    assert tokens_per_s == pytest.approx(2.60e6, rel=0.01)


def test_checkpoint_holds_weights_and_adamw_moments():
    assert P.checkpoint_bytes(405_853_388_800) == 12 * 405_853_388_800  # 4.87 TB for Llama 3 405B
    assert math.isclose(P.checkpoint_bytes(405_853_388_800) / 1e12, 4.870, abs_tol=1e-3)
