"""The planner checked against what it was not fitted to: every expert-parallel leg on the
critical path, achieved bandwidths taken as achieved, pipeline buffers counted once, selective AC chosen per
stage, unknown restart costs said to be unknown, and held-out published runs predicted within 15%."""

from __future__ import annotations

import functools

import pytest

from jobs.config import compose
from jobs.planner import arith as P
from jobs.planner.gate import build_plan, validate_for_planning
from jobs.planner.measure import stage_shapes
from jobs.planner.render import render


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
    kw = dict(
        tp=1,
        fsdp=1,
        pp=4,
        microbatches=8,
        stages_per_rank=2,
        schedule="interleaved_1f1b",
        seq_len=1024,
        micro_batch=1,
        pp_rank=1,
    )
    full = P.rank_memory(m, stages, activation_checkpointing="full", **kw)
    hop = 2 * 1024 * m.dim
    assert full.p2p_bytes == 8 * hop * 2 * 2  # 8 microbatches x (activation in + gradient in) x 2 stages
    per_block_mb = (
        P.layers_in_flight(
            pp=4, microbatches=8, layers_on_rank=4, stages_per_rank=2, schedule="interleaved_1f1b", pp_rank=1
        )
        / 4
    )
    biggest = P.layer_activation_bytes(m, layer=13, seq_len=1024, micro_batch=1, tp=1)
    # 4 checkpointed inputs per microbatch in flight, 2 of which (each stage's first) are receive buffers
    assert full.activation_bytes == int(per_block_mb * 4 * hop) - int(2 * hop * per_block_mb) + biggest
    none = P.rank_memory(m, stages, activation_checkpointing="none", **kw)  # no checkpoint keeps the input
    assert none.activation_bytes == int(
        per_block_mb * 4 * P.layer_activation_bytes(m, layer=4, seq_len=1024, micro_batch=1, tp=1)
    )
    text = render(build_plan(compose(["+experiment=llama3_405b_8k_8192gpu"]), measure=False))
    assert any(line.startswith("memory per rank") and "pp_recv" in line for line in text.splitlines())


def test_selective_ac_checkpoints_half_of_every_pipeline_rank_not_all_of_one():
    # Llama 3 405B at 8K, interleaved 1-layer chunks: pp rank r holds layers r, r+16, ... (one parity); by the
    # global layer index rank 0 recomputed none and rank 1 all. Chosen per rank, each recomputes half.
    cfg = compose(["+experiment=llama3_405b_8k_16384gpu", "train.activation_checkpointing=selective"])
    shapes = stage_shapes(cfg, validate_for_planning(cfg)[0])
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
    told = build_plan(
        compose(
            [
                "+experiment=llama3_405b_8k_16384gpu",
                f"run.dir={tmp_path}",
                "plan.restart_overhead_s=300",
                "plan.save_fixed_s=5",
            ]
        ),
        measure=False,
    )
    assert told.goodput_expected == pytest.approx(0.944, abs=0.005)
    assert "user assumption" in told.checkpoint["restart_source"]
    assert next(r for r in told.readiness if r["question"] == "what happens when a rank dies?")["status"] == "ok"


# ----------------------------------------------------------------------------------- held-out published runs
# None of these rows set a constant of the step-time model: its constants come from elsewhere (docs/planner.md
# "Held-out validation"): each GPU's achieved GEMM (Bekman's max-achievable matmul table: A100 SXM 0.869, H100
# SXM 0.803), NCCL's 370/450 NVLink and 47/50 IB bus efficiencies and 46 us latency (nccl-tests#212, #290,
# nccl#1244), a group's NICs per node (nccl-tests#119, nccl#1168, nccl#412), the datasheet peaks, HBM bandwidths
# and SM counts (NVIDIA), DeepSeek-V3's 20 communication SMs (§3.2.2), each GEMM shape's tile waves at 256x128 tiles
# (NVIDIA's Matrix Multiplication Background guide), attention at FlashAttention-2's causal forward + backward rate
# at the row's sequence length (Dao 2023, Fig. 4(d) and 7(d)), and the bytes FSDP2's copies and AdamW move (torch's
# source).
# The Megatron-LM GPT rows in our block's terms: MHA (n_kv_heads = n_heads), and a SwiGLU of 2/3 x 4h hidden (the same
# parameters and FLOPs as GeLU's 4h; rounded to a multiple of 8 where 8h/3 is not whole), vocab 51,200, sequence 2,048,
# on a100_ib (Selene: 8 A100 80GB and 8 HDR NICs a node). Two fields as the papers ran them, not as our defaults:
# - every pipeline rank holds L/p blocks ("a given device only has L/p layers", Korthikanti et al. 2022, arXiv
#   2205.05198, §4.2.3; MT-NLG 530B: "only three layers per device", §5), where our balanced split gives the first
#   and last stage fewer (GPT-3 on 12 stages: 9 blocks on pp1, 530B on 35: 4);
# - sequence parallelism only where the run had it: it was introduced by Korthikanti et al. 2022, so Narayanan et al.
#   2021's runs ran without (`mesh.sequence_parallel=false`), as did the 2022 paper's "full recompute" column;
# - attention materialised, as Megatron-LM ran it: QK^T, softmax (and dropout) and the product with V as separate
#   kernels over the s x s scores (Korthikanti et al. §4.1 and §5 count those "QK^T matrix multiply, softmax, softmax
#   dropout, and attention over V" activations; FlashAttention, Dao et al. 2022, came after both papers' runs):
#   torch's math backend, `model.sdpa_backend=math`;
# - norms fused, as Megatron-LM ran them: its LayerNorm is one CUDA kernel each way (megatron/model/fused_layer_norm.py,
#   MixedFusedLayerNorm over its fused_mix_prec_layer_norm_cuda extension), beside the element-wise fusions of
#   Narayanan et al. §4.2 (bias + GeLU, bias + dropout + add, scale + mask + softmax): torch's fused RMSNorm,
#   `model.norm_kernel=fused`.
def _megatron(
    *,
    h: int,
    layers: int,
    heads: int,
    tp: int = 8,
    pp: int,
    dp: int,
    batch: int,
    micro_batch: int = 1,
    ac: str = "full",
    sp: bool = False,
    schedule: str = "1f1b",
    stages_per_rank: int = 1,
) -> list[str]:
    stages = pp * stages_per_rank
    return [
        "model=llama3_70b",
        f"model.name=gpt_{h}x{layers}",
        f"model.dim={h}",
        f"model.n_layers={layers}",
        f"model.n_heads={heads}",
        f"model.n_kv_heads={heads}",
        f"model.ffn_dim={round(8 * h / 3 / 8) * 8}",
        "model.vocab_size=51200",
        "model.max_seq_len=2048",
        "model.sdpa_backend=math",
        "model.norm_kernel=fused",
        "cluster=a100_ib",
        "launcher=slurm",
        f"launcher.nodes={tp * pp * dp // 8}",
        "launcher.tasks_per_node=8",
        f"mesh.tp={tp}",
        f"mesh.pp={pp}",
        f"mesh.dp_replicate={dp}",
        "mesh.dp_shard=1",
        f"mesh.pp_schedule={schedule}",
        f"mesh.pp_stages_per_rank={stages_per_rank}",
        f"mesh.sequence_parallel={str(sp).lower()}",
        "train.seq_len=2048",
        f"train.micro_batch={micro_batch}",
        f"train.global_batch={batch}",
        f"train.activation_checkpointing={ac}",
    ] + ([f"mesh.pp_layers_per_stage=[{','.join([str(layers // stages)] * stages)}]"] if pp > 1 else [])


GPT3_175B = dict(h=12288, layers=96, heads=96)
GPT_530B = dict(h=20480, layers=105, heads=128)
GPT_1T = dict(h=25600, layers=128, heads=160)
GPT_22B = dict(h=6144, layers=48, heads=64)
GPT3_175B_MEGATRON = _megatron(**GPT3_175B, pp=12, dp=4, batch=1536)


def _megatron_gpus(gpus: int, **kw) -> list[str]:
    """Narayanan et al. 2021 Table 2's strong scaling: the same t8 x p12 model-parallel group (96 GPUs) and batch,
    data parallel over `gpus` / 96."""
    return _megatron(**GPT3_175B, pp=12, dp=gpus // 96, batch=1536, **kw)


def _megatron_530b(gpus: int, *, batch: int = 2240, **kw) -> list[str]:
    """Narayanan et al. 2021 Table 2, PTD parallelism: 529.6B, model-parallel size 280 (t8 x p35, Table 1's
    configuration), batch 2240, microbatch 1, data parallel over `gpus` / 280."""
    return _megatron(**GPT_530B, pp=35, dp=gpus // 280, batch=batch, **kw)


def _megatron_tflops(plan, *, B=1536, s=2048, l=96, h=12288, V=51200) -> float:
    """Megatron-LM's achieved teraFLOP/s per GPU: its own count, 96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration
    (Narayanan et al. 2021, §5.1: with activation recomputation), over the predicted iteration."""
    flops = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    return flops / (plan.step["step_s"] * plan.world_size) / 1e12


def _tflops(B: int, model: dict):
    return lambda p: _megatron_tflops(p, B=B, l=model["layers"], h=model["h"])


def _per_s(p) -> float:
    """Iterations per second: a published iteration time enters the table as its inverse, so that the ratio is
    predicted throughput over published throughput like every other row."""
    return 1.0 / p.step["step_s"]


# torchtitan's Llama 2 on its 64 A100 80GB, FSDP2 over all 64 (tp 1), 4K context (pytorch/torchtitan
# docs/performance.md, "Llama 2 performance numbers"; models as torchtitan/models/llama llama2_configs: vocab 32,000;
# 13B dim 5120, 40 layers, 40 heads, hidden 13,824; 70B the Llama 3 70B block with hidden 28,672)
LLAMA2_13B = [
    "model=llama3_8b",
    "model.name=llama2_13b",
    "model.dim=5120",
    "model.n_layers=40",
    "model.n_heads=40",
    "model.n_kv_heads=40",
    "model.ffn_dim=13824",
    "model.vocab_size=32000",
    "model.max_seq_len=4096",
    "model.rope_theta=10000",
]
LLAMA2_70B = ["model=llama3_70b", "model.name=llama2_70b", "model.vocab_size=32000", "model.max_seq_len=4096"]


def _torchtitan_llama2(model: list[str], *, batch: int, ac: str) -> list[str]:
    return [
        "+experiment=llama3_8b",  # 64 A100 (a100_ib), FSDP over all 64
        "mesh.tp=1",
        *model,
        "train.seq_len=4096",
        f"train.micro_batch={batch}",
        f"train.global_batch={64 * batch}",
        f"train.activation_checkpointing={ac}",
    ]


def _tok_s_per_gpu(p) -> float:
    return p.step["tokens_per_s"] / p.world_size


# Each row: overrides, the published figure, what the plan predicts for it. Not rows: torchtitan's "selective op"
# rows (its per-op AC policy is not modelled: this planner's selective is every other layer).
HELD_OUT = {
    # "The Llama 3 Herd of Models" (arXiv 2407.21783) Table 4; no activation checkpointing at 8K (§3.3.2)
    "llama3_405b_8192gpu_mfu": (["+experiment=llama3_405b_8k_8192gpu"], 0.43, lambda p: p.step["mfu"]),
    "llama3_405b_16384gpu_mfu": (["+experiment=llama3_405b_8k_16384gpu"], 0.41, lambda p: p.step["mfu"]),
    # pytorch/torchtitan docs/performance.md, Llama 3 on 64 A100 80GB, FSDP2, local batch 1, seq 8,192
    "torchtitan_8b_selective_layer_tok_s": (
        ["+experiment=llama3_8b", "train.activation_checkpointing=selective"],
        2904,
        _tok_s_per_gpu,
    ),
    "torchtitan_70b_full_tok_s": (["+experiment=llama3_70b", "mesh.tp=1", "train.micro_batch=1"], 331, _tok_s_per_gpu),
    # the same page, Llama 2 on 64 A100 80GB, FSDP2, seq 4,096: 13B batch 2 no AC 2162, selective layer 1914;
    # 70B batch 2 full AC 353
    "torchtitan_llama2_13b_no_ac_tok_s": (_torchtitan_llama2(LLAMA2_13B, batch=2, ac="none"), 2162, _tok_s_per_gpu),
    "torchtitan_llama2_13b_selective_layer_tok_s": (
        _torchtitan_llama2(LLAMA2_13B, batch=2, ac="selective"),
        1914,
        _tok_s_per_gpu,
    ),
    "torchtitan_llama2_70b_full_tok_s": (_torchtitan_llama2(LLAMA2_70B, batch=2, ac="full"), 353, _tok_s_per_gpu),
    # Narayanan et al. 2021 (arXiv 2104.04473) Table 2, PTD parallelism: GPT 174.6B, t8 x p12 on 384 A100,
    # batch 1536, microbatch 1: 153 teraFLOP/s per GPU. Its schedule is not stated (§5.1 says Table 1's runs were
    # interleaved): an assumption, planned 1F1B, the interleaved alternative (v2, not stated either) in the `_alt` row.
    "megatron_gpt3_175b_384gpu_tflops": (GPT3_175B_MEGATRON, 153, _megatron_tflops),
    # the same table's strong scaling of that run: 768 GPUs 149, 1,536 GPUs 141 teraFLOP/s per GPU (43 and 23 days
    # for 300B tokens against 84 on 384)
    "megatron_gpt3_175b_768gpu_tflops": (_megatron_gpus(768), 149, _megatron_tflops),
    "megatron_gpt3_175b_1536gpu_tflops": (_megatron_gpus(1536), 141, _megatron_tflops),
    "megatron_gpt3_175b_384gpu_tflops_alt_interleaved_v2": (
        _megatron_gpus(384, schedule="interleaved_1f1b", stages_per_rank=2),
        153,
        _megatron_tflops,
    ),
    "megatron_gpt3_175b_768gpu_tflops_alt_interleaved_v2": (
        _megatron_gpus(768, schedule="interleaved_1f1b", stages_per_rank=2),
        149,
        _megatron_tflops,
    ),
    "megatron_gpt3_175b_1536gpu_tflops_alt_interleaved_v2": (
        _megatron_gpus(1536, schedule="interleaved_1f1b", stages_per_rank=2),
        141,
        _megatron_tflops,
    ),
    # the same Table 2, PTD parallelism: GPT 529.6B, model-parallel size 280, batch 2240, microbatch 1 on 560, 1,120
    # and 2,240 A100: 171, 167, 159 teraFLOP/s per GPU. Schedule as for 175B (assumed 1F1B; `_alt`: interleaved
    # with one block per virtual stage, v3, the 2022 paper's choice for this model)
    "megatron_530b_560gpu_tflops": (_megatron_530b(560), 171, _tflops(2240, GPT_530B)),
    "megatron_530b_1120gpu_tflops": (_megatron_530b(1120), 167, _tflops(2240, GPT_530B)),
    "megatron_530b_2240gpu_tflops": (_megatron_530b(2240), 159, _tflops(2240, GPT_530B)),
    "megatron_530b_560gpu_tflops_alt_interleaved_v3": (
        _megatron_530b(560, schedule="interleaved_1f1b", stages_per_rank=3),
        171,
        _tflops(2240, GPT_530B),
    ),
    "megatron_530b_1120gpu_tflops_alt_interleaved_v3": (
        _megatron_530b(1120, schedule="interleaved_1f1b", stages_per_rank=3),
        167,
        _tflops(2240, GPT_530B),
    ),
    "megatron_530b_2240gpu_tflops_alt_interleaved_v3": (
        _megatron_530b(2240, schedule="interleaved_1f1b", stages_per_rank=3),
        159,
        _tflops(2240, GPT_530B),
    ),
    # Narayanan et al. 2021 Table 1 (weak scaling; "we use the interleaved pipeline schedule", §5.1): 529.6B t8 p35 on
    # 2,520 GPUs, batch 2520, 163 teraFLOP/s per GPU; 1008.0B (160 heads, 25600, 128 layers) t8 p64 on 3,072, batch
    # 3072, 163. With L/p = 3 and 2 blocks a rank, equal chunks leave one v each: 3 and 2. The table gives no
    # microbatch: assumed 1 (as Table 2), `_alt` 2.
    **{
        f"megatron_table1_{name}_{gpus}gpu_tflops{alt}": (
            _megatron(
                **model,
                pp=pp,
                dp=gpus // (8 * pp),
                batch=gpus,
                micro_batch=mb,
                schedule="interleaved_1f1b",
                stages_per_rank=v,
            ),
            163,
            _tflops(gpus, model),
        )
        for alt, mb in (("", 1), ("_alt_microbatch_2", 2))
        for name, model, pp, gpus, v in (("530b", GPT_530B, 35, 2520, 3), ("1t", GPT_1T, 64, 3072, 2))
    },
    # Korthikanti et al. 2022 (arXiv 2205.05198) Table 3 configurations (t8, no data parallelism): 22B (64 heads,
    # 6144, 48 layers) p1 on 8 GPUs, batch 4, microbatch 4; 175B p8 on 64, batch 64; 530B p35 on 280, batch 280; 1T
    # p64 on 512, batch 512; microbatch 1. §6: "the interleaving schedule with three interleaving
    # stages" for 175B and 530B (1T: not named, planned 1F1B; `_alt`: interleaved v2). Table 5's iteration seconds:
    # "Full Recompute" (no sequence parallelism) 1.42, 18.13, 49.05, 94.42; "Present Work" (sequence parallelism +
    # selective recompute) 1.10, 13.75, 37.83, 71.49; and §6.3: 530B on 2,240 GPUs (8-way data parallel, batch
    # 2240) 39.15 s. Their selective recompute re-runs the attention core (QK^T, softmax, dropout, PV: +2.7% and
    # +1.6% FLOPs for 175B and 530B, §5) and is planned as `none`: FlashAttention's backward recomputes that core
    # itself, inside the attention rate the profile prices.
    "korthikanti_22b_full_recompute_per_s": (
        _megatron(**GPT_22B, pp=1, dp=1, batch=4, micro_batch=4),
        1 / 1.42,
        _per_s,
    ),
    "korthikanti_175b_full_recompute_per_s": (
        _megatron(**GPT3_175B, pp=8, dp=1, batch=64, schedule="interleaved_1f1b", stages_per_rank=3),
        1 / 18.13,
        _per_s,
    ),
    "korthikanti_530b_full_recompute_per_s": (
        _megatron_530b(280, batch=280, schedule="interleaved_1f1b", stages_per_rank=3),
        1 / 49.05,
        _per_s,
    ),
    "korthikanti_1t_full_recompute_per_s": (_megatron(**GPT_1T, pp=64, dp=1, batch=512), 1 / 94.42, _per_s),
    "korthikanti_22b_selective_sp_per_s": (
        _megatron(**GPT_22B, pp=1, dp=1, batch=4, micro_batch=4, ac="none", sp=True),
        1 / 1.10,
        _per_s,
    ),
    "korthikanti_175b_selective_sp_per_s": (
        _megatron(
            **GPT3_175B, pp=8, dp=1, batch=64, ac="none", sp=True, schedule="interleaved_1f1b", stages_per_rank=3
        ),
        1 / 13.75,
        _per_s,
    ),
    "korthikanti_530b_selective_sp_per_s": (
        _megatron_530b(280, batch=280, ac="none", sp=True, schedule="interleaved_1f1b", stages_per_rank=3),
        1 / 37.83,
        _per_s,
    ),
    "korthikanti_530b_2240gpu_selective_sp_per_s": (
        _megatron_530b(2240, ac="none", sp=True, schedule="interleaved_1f1b", stages_per_rank=3),
        1 / 39.15,
        _per_s,
    ),
    "korthikanti_1t_selective_sp_per_s": (
        _megatron(**GPT_1T, pp=64, dp=1, batch=512, ac="none", sp=True),
        1 / 71.49,
        _per_s,
    ),
    "korthikanti_1t_full_recompute_per_s_alt_interleaved_v2": (
        _megatron(**GPT_1T, pp=64, dp=1, batch=512, schedule="interleaved_1f1b", stages_per_rank=2),
        1 / 94.42,
        _per_s,
    ),
    "korthikanti_1t_selective_sp_per_s_alt_interleaved_v2": (
        _megatron(**GPT_1T, pp=64, dp=1, batch=512, ac="none", sp=True, schedule="interleaved_1f1b", stages_per_rank=2),
        1 / 71.49,
        _per_s,
    ),
}
# Rows outside 15%, each pinned to its measured band (+-0.02 or so) so that a change in either direction is seen: none
# now. The last was Korthikanti et al.'s 22B full-recompute row (0.842) while the Megatron rows ran our eager norms:
# without SP every tp rank runs the norms over the whole sequence, 36 bytes an element in five kernels, where
# Megatron's fused LayerNorm moves 2 + 5 elements (docs/planner.md "The Megatron rows" has the arithmetic).
KNOWN_GAP: dict[str, tuple[float, float]] = {}


@functools.cache
def _ratio(row: str) -> float:
    """Predicted over published for `row`, planned once per session (the table and the per-row test share it)."""
    overrides, published, metric = HELD_OUT[row]
    plan = build_plan(compose(overrides), measure=False)
    hidden = sum(c["seconds"] - c["exposed_s"] for c in plan.comm)  # none without data parallelism
    assert plan.step["memory_bound_s"] > 0 and (plan.step["interference_s"] > 0 or hidden == 0)  # GPU profiles
    return metric(plan) / published


def test_the_held_out_table_prints_every_ratio_and_each_stays_in_its_band():
    ratios = {row: _ratio(row) for row in HELD_OUT}
    table = "\n".join(f"  {row:56s} {r:.3f}" for row, r in ratios.items())
    print("held-out predicted / published:\n" + table)
    for row, r in ratios.items():
        low, high = KNOWN_GAP.get(row, (0.85, 1.15))
        assert low <= r <= high, f"{row}: {r:.3f} outside {low}-{high}\n{table}"


@pytest.mark.parametrize(
    "row",
    [
        pytest.param(
            row,
            marks=pytest.mark.xfail(
                strict=True, raises=AssertionError, reason=f"KNOWN_GAP {KNOWN_GAP[row]}: outside 0.85-1.15x"
            ),
        )
        if row in KNOWN_GAP
        else row
        for row in HELD_OUT
    ],
)
def test_held_out_published_runs_are_predicted_within_15_percent(row):
    assert 0.85 <= _ratio(row) <= 1.15


def test_the_paper_mesh_of_llama3_405b_is_ranked_with_the_ac_torchs_schedule_needs():
    # Without AC the paper's mesh keeps 141 layer-microbatches in flight on pp rank 1 under torch's Interleaved1F1B
    # warm-up (206 GiB > 72 usable), selective AC 122 GiB; full AC fits: the search ranks the mesh with it, and says so
    from jobs.planner.search import own_candidate

    own, note = own_candidate(compose(["+experiment=llama3_405b_8k_8192gpu"]))
    assert own is not None and own.shape.ac == "full" and own.shape.label().startswith("tp8 cp1 pp16 v8* dp1x64")
    assert note.startswith("ranked with train.activation_checkpointing=full: at train.activation_checkpointing=none")
    assert "141 layer-microbatches" in note and "torch's warm-up" in note


def test_the_all_to_all_warning_says_which_schedule_it_is_about():
    # DeepSeek-V3 report §3.2.1: DualPipe overlaps the all-to-all with a paired chunk's compute; our plain 1F1B
    # does not. The warning names our schedule and gives DualPipe's bound, max(0, a2a - compute).
    plan = build_plan(compose(["+experiment=deepseek_v3_2048gpu"]), measure=False)
    row = next(r for r in plan.readiness if r["question"] == "where does the step time go?")
    assert row["status"] == "warn" and "mesh.pp_schedule=1f1b" in row["answer"] and "DualPipe" in row["answer"]
    s = plan.step
    a2a = sum(c["exposed_s"] for c in plan.comm if c["axis"].startswith("ep"))
    bound = max(0.0, a2a - (s["compute_s"] + s["recompute_s"] + s["memory_bound_s"]))
    assert f"= {bound:.3g} s would be" in row["answer"]


def test_context_parallel_counts_the_gathered_whole_sequence_k_v_repeated_to_every_head():
    # All-gather CP (Llama 3 §3.3.2): each rank's SDPA saves K and V of the whole sequence, repeated from the
    # 8 KV heads to all 32: 2 x seq x dim bf16 bytes whatever cp is; everything else is divided by cp.
    m = compose(["model=llama3_8b"]).model
    one = P.layer_activation_bytes(m, layer=0, seq_len=8192, micro_batch=1, tp=1, cp=1)
    two = P.layer_activation_bytes(m, layer=0, seq_len=8192, micro_batch=1, tp=1, cp=2)
    # one = X + 2·2·8192·dim (local K/V, repeated); two = X/2 + the same whole-sequence K/V
    assert two - one // 2 == pytest.approx(2 * 8192 * m.dim, abs=8)


def test_torchtitans_h100_8b_figure_is_predicted_as_the_planner_doc_says():
    # Not a held-out row (its GPUs: 96 GB HBM2e at 2.4 TB/s, 500 W, a peak between 835 and 989 TFLOP/s, torchtitan
    # docs/performance.md Table 1 and footnote 2), but evidence docs/planner.md cites: 5,762 tok/s/GPU measured, the
    # planner 1.17-1.28x above it on H100, as it is 1.12-1.14x above the A100 rows
    base = [
        "+experiment=llama3_8b",
        "cluster=h100_ib",
        "launcher.nodes=1",
        "train.micro_batch=2",
        "train.global_batch=16",
        "train.activation_checkpointing=selective",
        "cluster.gpu_hbm_GBps=2400",
    ]
    per_gpu = [
        (lambda p: p.step["tokens_per_s"] / p.world_size)(build_plan(compose(ov), measure=False))
        for ov in (base, [*base, "cluster.gpu_bf16_tflops=835"])
    ]
    assert per_gpu == [pytest.approx(7351, rel=0.005), pytest.approx(6738, rel=0.005)]
    assert [round(x / 5762, 2) for x in per_gpu] == [1.28, 1.17]


def test_llama3_405b_at_131k_is_predicted_as_the_planner_doc_says():
    # Not a row (the paper does not say how much the 131k run recomputed); attention is 40% of its FLOPs, so the
    # FlashAttention-2 rate decides the prediction (its causal 16k figure, the longest it published): 25.5% MFU
    # with full AC against the paper's 38%
    plan = build_plan(compose(["+experiment=llama3_405b_131k_16384gpu"]), measure=False)
    assert plan.step["mfu"] == pytest.approx(0.255, abs=0.0005)


def test_the_megatron_rows_hold_l_over_p_blocks_on_every_rank_and_sequence_parallelism_only_from_2022():
    # Megatron gives every pipeline rank L/p blocks (Korthikanti et al. 2022 §4.2.3; MT-NLG: "only three layers per
    # device", §5); our balanced split would give pp1 9 of GPT-3's 96 blocks on 12 stages and 4 of 530B's 105 on 35,
    # which made the 175B rows read 1.05-1.08 and the 530B rows 0.93-0.95 on one table. Sequence parallelism came
    # with the 2022 paper: none of Narayanan et al. 2021's runs, nor the 2022 "full recompute" column, had it.
    from parallel.pipeline import balanced_layers_per_stage

    assert balanced_layers_per_stage(96, 12)[1] == 9 and balanced_layers_per_stage(105, 35)[1] == 4
    rows = [r for r in HELD_OUT if r.startswith(("megatron", "korthikanti"))]
    assert len(rows) == 27
    for row in rows:
        ov = dict(o.split("=", 1) for o in HELD_OUT[row][0])  # the overrides as written (composing 27 takes 12 s)
        layers, pp = int(ov["model.n_layers"]), int(ov["mesh.pp"])
        stages = pp * int(ov["mesh.pp_stages_per_rank"])
        if pp > 1:
            assert ov["mesh.pp_layers_per_stage"] == f"[{','.join([str(layers // stages)] * stages)}]", row
            assert layers % stages == 0, row
        assert ov["mesh.sequence_parallel"] == ("true" if "selective_sp" in row else "false"), row
