"""The planner's step-time model (jobs.planner.steptime, jobs.planner.hardware): predicted, not assumed."""

from __future__ import annotations

import pytest

from jobs.cli import is_config_error
from jobs.config import compose
from jobs.planner import hardware as H
from jobs.planner.gate import build_plan, validate_for_planning
from jobs.planner.measure import stage_shapes
from jobs.planner.steptime import attention_flops


def test_plan_mfu_is_no_longer_an_input():
    with pytest.raises(Exception) as e:
        compose(["plan.mfu=0.4"])
    assert is_config_error(e.value)


def test_llama3_405b_step_parts_each_follow_their_own_definition():
    # "The Llama 3 Herd of Models" Table 4: 16,384 GPUs, TP 8, PP 16, DP 128, no activation checkpointing at 8K
    # (§3.3.2). How close the prediction comes to the published 41% MFU is the held-out table's business
    # (tests/unit/test_planner_held_out.py); here each part is checked against its own definition.
    plan = build_plan(compose(["+experiment=llama3_405b_8k_16384gpu"]), measure=False)
    s = plan.step
    assert s["recompute_s"] == 0.0  # no activation checkpointing: nothing runs forward twice
    assert s["tokens_per_s"] == pytest.approx(2048 * 8192 / s["step_s"])
    assert s["mfu"] == pytest.approx(s["flops_per_token"] * s["tokens_per_s"] / (16384 * 989e12))
    # interleaved 1F1B, p = 16, v = 8 one-layer chunks (Llama 3 section 3.3.2): bubble (p-1)/(v*m + p-1) = 15/143,
    # so the stage stretches by 15/128
    busy = s["compute_s"] + s["memory_bound_s"] + s["interference_s"] + s["comm_exposed_s"] + s["host_s"]
    assert s["bubble_s"] == pytest.approx(busy * 15 / 128)
    # memory-bound ops at the H100's 3.35 TB/s: a few percent of a 405B's compute at tp8 (dim 16,384)
    assert 0.02 < s["memory_bound_s"] / s["compute_s"] < 0.2
    assert "Bekman" in s["matmul_source"]
    assert any("nccl-tests#212" in c["source"] for c in plan.comm)
    tp = [c for c in plan.comm if c["axis"] == "tp"]
    assert tp and all(c["exposed_s"] == c["seconds"] for c in tp)  # TP collectives are never hidden
    fsdp = next(c for c in plan.comm if c["axis"] == "dp_shard" and c["collective"] == "all_gather")
    assert fsdp["exposed_s"] < fsdp["seconds"]  # FSDP prefetch hides all but the first gather


# FlashAttention-2's forward + backward TFLOP/s, causal, head dim 128, in its count (backward 2.5x forward), by sequence
# length 512 .. 16k: Dao 2023 (arXiv 2307.08691) Fig. 4(d) on A100 80GB SXM4, Fig. 7(d) on H100 80GB SXM5
FA2_CAUSAL_HD128 = {
    312.0: (99, 133, 155, 173, 182, 189),
    989.0: (163, 221, 265, 294, 308, 328),
}


@pytest.mark.parametrize("experiment", ["llama3_405b_8k_16384gpu", "llama3_8b"])
def test_attention_runs_at_flashattention2s_causal_rate_at_the_runs_sequence_length_and_the_rest_at_the_gemm_rate(
    experiment,
):
    # SDPA's flash backend is FlashAttention-2; both presets run 8K causal attention of head dim 128: FA2's 8k bar
    # (182 on A100, 308 on H100) in our count (backward 2x forward): x 3 / 3.5
    cfg = compose([f"+experiment={experiment}"])
    published = FA2_CAUSAL_HD128[cfg.cluster.gpu_bf16_tflops]
    assert cfg.model.dim // cfg.model.n_heads == 128 and cfg.train.seq_len == 8192
    hw = H.hardware(cfg.cluster, dtype="bf16", tasks_per_node=8)
    rates = [hw.attention_at(512 << i) for i in range(6)]
    assert rates == [pytest.approx(r * 3 / 3.5, abs=0.15) for r in published]
    assert hw.attention_at(128) == rates[0] and hw.attention_at(131072) == rates[-1]  # the nearest end outside
    assert rates[3] < hw.attention_at(6144) < rates[4]  # between two lengths: in log2 of the length
    on, off = (
        build_plan(compose([f"+experiment={experiment}", *ov]), measure=False).step
        for ov in ([], ["cluster.gpu_attention_tflops=0"])
    )
    assert off["attention_tflops"] == 0 and on["attention_tflops"] == pytest.approx(published[4] * 3 / 3.5, abs=0.15)
    # the difference is exactly the attention FLOPs of every microbatch (forward + backward = 3x) moved from the GEMM
    # rate to the attention rate: every block of the slowest role, at its tokens per microbatch
    derived = validate_for_planning(cfg)[0]
    pp_rank = next(r["pp_rank"] for r in build_plan(cfg, measure=False).roles if r["role"] == on["slowest_role"])
    blocks = sum(len(st.layers) for st in stage_shapes(cfg, derived)[pp_rank])
    t = cfg.train
    att = 3 * attention_flops(cfg.model, tokens=t.micro_batch * t.seq_len, seq_len=t.seq_len, tp=cfg.mesh.tp)
    att *= blocks * derived.microbatches
    extra = att / (on["attention_tflops"] * 1e12) - att / (on["matmul_tflops"] * 1e12)
    assert on["compute_s"] - off["compute_s"] == pytest.approx(extra, rel=1e-9) and extra > 0


def test_without_a_sequence_share_attention_runs_at_the_one_rate_at_every_length():
    # a rate measured at the model's own length (the GPU preflight's `gemms` line) is set without the published table
    cfg = compose(["+experiment=llama3_8b", "cluster.gpu_attention_tflops=150", "cluster.gpu_attention_seq_share=null"])
    hw = H.hardware(cfg.cluster, dtype="bf16", tasks_per_node=8)
    assert [hw.attention_at(s) for s in (512, 8192, 131072)] == [150.0, 150.0, 150.0]
    assert H.seq_share(((512, 0.5), (2048, 0.8)), 1024) == pytest.approx(0.65)


def test_an_attention_share_outside_0_to_1_is_a_config_error_naming_the_key():
    cfg = compose(["+experiment=llama3_8b", "cluster.gpu_attention_seq_share={8192: 0}"])
    with pytest.raises(
        ValueError, match=r"cluster.gpu_attention_seq_share has shares outside \(0, 1\] at \{8192: 0"
    ) as e:
        validate_for_planning(cfg)
    assert is_config_error(e.value)


def test_a_calibrated_rate_holds_attention_already():
    # jobs.calibrate (and the GPU preflight's `gemms` block rate) time attention inside the one rate: no second term
    cfg = compose(["+experiment=llama3_8b"]).cluster
    cited = H.hardware(cfg, dtype="bf16", tasks_per_node=8)
    cfg.matmul_tflops = {"bf16": 200.0}
    calibrated = H.hardware(cfg, dtype="bf16", tasks_per_node=8)
    assert cited.attention_tflops == pytest.approx(162.0) and calibrated.attention_tflops == 0.0


def test_deepseek_v3_exposed_all_to_all_is_a_warning_not_ok():
    plan = build_plan(compose(["+experiment=deepseek_v3_2048gpu"]), measure=False)
    row = next(r for r in plan.readiness if r["question"] == "where does the step time go?")
    assert row["status"] == "warn" and "all_to_all/ep" in row["answer"]


def test_which_axes_cross_nodes_and_pods_in_our_order_and_in_llama3s():
    # Llama 3 §3.3.2 orders ranks [TP, CP, PP, DP], DP outermost, so a PP group (16 x tp 8 = 128 ranks apart at
    # most) stays inside a 3,072-GPU pod (§3.3.1) while DP groups cross pods; our order puts PP outermost.
    plan = build_plan(compose(["+experiment=llama3_405b_8k_16384gpu", "cluster.pod_gpus=3072"]), measure=False)
    axes = {a["axis"]: a for a in plan.axes}
    assert (axes["tp"]["ours_scope"], axes["tp"]["llama3_scope"]) == ("intra", "intra")
    assert (axes["pp"]["ours_span"], axes["pp"]["ours_scope"]) == (16384, "inter-pod")
    assert (axes["pp"]["llama3_span"], axes["pp"]["llama3_scope"]) == (128, "inter")
    assert (axes["dp_shard"]["ours_span"], axes["dp_shard"]["llama3_scope"]) == (1024, "inter-pod")


def test_cpu_ranks_overlap_nothing_and_a_calibrated_profile_is_used():
    cfg = compose(["mesh.pp=1", "mesh.dp_shard=4", "mesh.tp=1", "launcher.tasks_per_node=4"])
    assert "step_s" not in build_plan(cfg, measure=False).step  # no figures, no guess
    cfg.cluster.calibrated = "2026-12-03 test"
    cfg.cluster.matmul_tflops = {"fp32": 0.002}
    cfg.cluster.collectives = {f"{op}.intra": {"alpha_s": 1e-3, "bus_GBps": 0.5} for op in H.OPS}
    plan = build_plan(cfg, measure=False)
    s = plan.step
    assert s["matmul_source"].startswith("cluster.matmul_tflops.fp32 calibrated (2026-12-03 test)")
    assert all(c["exposed_s"] == c["seconds"] for c in plan.comm)
    # dp4 without pp or tp: each rank does a quarter of the model FLOPs (6N + causal attention per token)
    assert s["compute_s"] * 0.002e12 == pytest.approx(s["model_tflop_per_rank"] * 1e12, rel=1e-9)
    assert s["bubble_s"] == 0 and s["step_s"] > s["compute_s"]


def _event(kind: str, t: float, attempt: str = "local.0", **fields) -> str:
    import json

    return json.dumps({"time": t, "kind": kind, "rank": 0, "restart": 0, "attempt": attempt, **fields}) + "\n"


def test_save_and_restart_costs_come_from_the_runs_own_ledger(tmp_path):
    # Three saves blocking 2.5, 3.5 and 9.0 s (median 3.5) and two attempts taking 40 and 60 s from start
    # to first step (median 50), no failure: those, not a constant, set Daly's interval and the goodput.
    (tmp_path / "events.jsonl").write_text(
        _event("attempt_start", 0.0)
        + _event("first_step", 40.0, step=1)
        + "".join(_event("checkpoint_saved", 100.0 + i, step=i, blocking_s=b) for i, b in enumerate((2.5, 9.0, 3.5)))
        + _event("attempt_end", 200.0, cause="completed")
        + _event("attempt_start", 300.0, attempt="local.1")
        + _event("first_step", 360.0, attempt="local.1", step=5)
    )
    plan = build_plan(compose(["+experiment=llama3_405b_8k_16384gpu", f"run.dir={tmp_path}"]), measure=False)
    ck = plan.checkpoint
    assert ck["blocking_s"] == pytest.approx(3.5) and "median blocking_s of 3 saves" in ck["blocking_source"]
    assert ck["restart_s"] == pytest.approx(50.0) and "median start-up" in ck["restart_source"]
    # Without a ledger: the profile's bytes and commit cost, and the restart says what it leaves out.
    plan = build_plan(compose(["+experiment=llama3_405b_8k_16384gpu", f"run.dir={tmp_path / 'none'}"]), measure=False)
    assert "cluster.host_copy_GBps" in plan.checkpoint["blocking_source"]
    assert "cluster.fs_fsync_s not measured" in plan.checkpoint["blocking_source"]
    assert "not counted" in plan.checkpoint["restart_source"] and "unknown" in plan.checkpoint["restart_source"]


def _calibrated(overrides: list[str], **figures):
    cfg = compose(["launcher.tasks_per_node=4", "train.global_batch=16", "train.micro_batch=2", *overrides])
    cfg.cluster.calibrated = "2026-12-03 test"
    cfg.cluster.matmul_tflops = {"fp32": 0.002}
    cfg.cluster.collectives = {f"{op}.intra": {"alpha_s": 1e-3, "bus_GBps": 0.5} for op in H.OPS}
    for key, value in figures.items():
        setattr(cfg.cluster, key, value)
    return build_plan(cfg, measure=False).step


def test_host_time_of_fsdp_units_and_pipeline_actions_is_part_of_the_cpu_step():
    # tiny: 4 blocks. FSDP over 4 ranks, no pipeline: 4 blocks + the root = 5 units, gathered in every one of
    # the 16 / (4 x 2) = 2 microbatches.
    fsdp = ["mesh.pp=1", "mesh.dp_shard=4", "mesh.tp=1"]
    s = _calibrated(fsdp, fsdp_unit_host_s={"tp1": 0.01}, pp_action_host_s=0.002)
    assert s["host_s"] == pytest.approx(5 * 0.01 * 2)
    assert s["step_s"] == pytest.approx(_calibrated(fsdp)["step_s"] + s["host_s"])  # nothing else moved
    # pp 2 x dp_shard 2: a stage holds 2 blocks (+ its root = 3 units), gathered once per step; its
    # 16 / (2 x 2) = 4 microbatches are 8 schedule actions (a forward and a backward each).
    pp = ["mesh.pp=2", "mesh.dp_shard=2", "mesh.tp=1", "mesh.pp_schedule=1f1b"]
    s = _calibrated(pp, fsdp_unit_host_s={"tp1": 0.01}, pp_action_host_s=0.002)
    assert s["host_s"] == pytest.approx(3 * 0.01 + 8 * 0.002)
    # no data parallelism: no FSDP units
    assert _calibrated(["mesh.pp=1", "mesh.dp_shard=1", "mesh.tp=4"], fsdp_unit_host_s={"tp1": 0.01})["host_s"] == 0


def test_fsdp_host_time_is_the_one_calibrated_at_the_mesh_tp():
    # FSDP2 over tp-sharded DTensor parameters costs more host time per unit than over plain ones (measured
    # 2026-12-03 on the 2-core box, tiny, 4 ranks busy: 5 ms plain, 21 ms at tp 2): the tp 2 mesh takes the
    # "tp2" figure; tp 4, not timed, the nearest smaller one. tp2 x dp_shard 2, 16 / (2 x 2) = 4 microbatches
    # of 4 blocks + the root.
    figures = {"fsdp_unit_host_s": {"tp1": 0.005, "tp2": 0.021}}
    tp2 = _calibrated(["mesh.pp=1", "mesh.dp_shard=2", "mesh.tp=2"], **figures)
    assert tp2["host_s"] == pytest.approx(5 * 0.021 * 4)
    tp4 = _calibrated(["mesh.pp=1", "mesh.dp_shard=1", "mesh.dp_replicate=1", "mesh.tp=4"], **figures)
    assert tp4["host_s"] == 0  # no FSDP
    cl = compose([]).cluster
    cl.fsdp_unit_host_s = figures["fsdp_unit_host_s"]
    assert H._fsdp_unit_host_s(cl, 4) == 0.021 and H._fsdp_unit_host_s(cl, 1) == 0.005
    cl.fsdp_unit_host_s = {}
    assert H._fsdp_unit_host_s(cl, 2) == 0.0


def test_on_a_gpu_host_time_hides_behind_the_device_compute_it_queues():
    cfg = compose(["+experiment=llama3_405b_8k_16384gpu"])
    base = build_plan(cfg, measure=False).step
    cfg.cluster.fsdp_unit_host_s, cfg.cluster.pp_action_host_s = {"tp1": 1e-4, "tp8": 1e-4}, 1e-4
    s = build_plan(cfg, measure=False).step
    assert s["host_s"] == 0 and s["step_s"] == pytest.approx(base["step_s"])


def test_parameters_and_activations_travel_in_the_compute_dtype():
    # fp32 ranks (CPU) gather fp32 parameters and send fp32 activations: twice the bytes of bf16. The plan
    # counted bf16 for every run, so an fp32 run's collectives were timed at half their bytes.
    def rows(mp: str) -> dict[tuple[str, str], dict]:
        cfg = compose(
            ["launcher.tasks_per_node=4", "mesh.pp=2", "mesh.dp_shard=2", "mesh.tp=1", f"train.mixed_precision={mp}"]
        )
        return {(r["collective"], r["axis"]): r for r in build_plan(cfg, measure=False).comm}

    fp32, bf16 = rows("fp32"), rows("bf16")
    for key in (("all_gather", "dp_shard"), ("send_recv", "pp")):
        assert fp32[key]["bytes"] == 2 * bf16[key]["bytes"] > 0
        assert fp32[key]["what"].startswith("fp32") and bf16[key]["what"].startswith("bf16")
    assert (
        fp32[("reduce_scatter", "dp_shard")]["bytes"] == bf16[("reduce_scatter", "dp_shard")]["bytes"]
    )  # fp32 reduction
