"""`python -m jobs.plan plan.search=true`: the ranked mesh search, its rejections and its top-K sweep."""

from __future__ import annotations

import shlex
import time

import pytest

from jobs.config import compose
from jobs.planner.gate import build_plan
from jobs.planner.search import Shape, predicted, render_search, search, visit_shape, write_top_k
from jobs.validate import validate

# The tiny model on 8 ranks of an H100 node: every shape fits, so the search space is the whole story.
SMALL = [
    "model=tiny",
    "cluster=h100_ib",
    "launcher.nodes=1",
    "launcher.tasks_per_node=8",
    "train.global_batch=8",
    "checkpoint.interval=auto",
]


@pytest.fixture(scope="module")
def small():
    cfg = compose(SMALL)
    return cfg, search(cfg)


def test_a_small_world_prints_a_ranked_table_with_the_config_marked(small):
    cfg, r = small
    table = render_search(r, cfg, rows=5)
    assert table.splitlines()[0].startswith(f"search: {r.enumerated} shapes for 8 ranks")
    assert len(r.ranked) >= 20 and r.enumerated == len(r.ranked) + sum(len(v) for v in r.rejected.values())
    rank = r.own_rank()  # conf/mesh/local.yaml: pp2 * dp_shard2 * tp2, 1F1B
    assert rank is not None and r.ranked[rank - 1].shape.label() == "tp2 cp1 pp2 dp1x2 mb2 ac=none"
    assert f"< this config: rank {rank} of {len(r.ranked)}" in table
    own_row = next(line for line in table.splitlines() if line.strip().startswith(f"{rank} "))
    assert "tp2 cp1 pp2 dp1x2 mb2 ac=none" in own_row and " < " in own_row


def test_the_ranking_follows_predicted_tokens_per_s_read_from_the_plan(small):
    cfg, r = small
    # the shapes jobs.train builds first (a planned-only cp > 1 shape on top is no advice), then by rate
    # (the dense tiny model trains every shape now that cp is built: tests/unit/test_search_trainable.py has both)
    built = [c.trainable for c in r.ranked]
    assert built == sorted(built, reverse=True) and built[0]
    for group in (True, False):
        rates = [c.numbers["tokens_per_s"] for c in r.ranked if c.trainable is group]
        assert rates == sorted(rates, reverse=True) and (not rates or rates[0] > rates[-1])
    assert all(c.numbers["in_flight"] > 0 for c in r.ranked)  # printed: what drove the AC choice
    assert "in flight" in render_search(r, cfg, rows=3).splitlines()[2]
    for c in (r.ranked[0], r.ranked[-1]):  # the number is the plan's own: re-plan the shape and compare
        plan = build_plan(c.shape.apply(cfg), measure=False)
        tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        assert c.numbers["tokens_per_s"] == pytest.approx(tokens_per_step / plan.step["step_s"])
        assert predicted(plan) == c.numbers


def test_a_rejected_shape_names_its_reason(small):
    cfg, r = small
    why = {label: msg for items in r.rejected.values() for label, msg in items}
    assert why["tp8 cp1 pp1 dp1x1 mb1 ac=none"] == "model.n_kv_heads(4) % mesh.tp(8) != 0"  # tiny: 4 KV heads
    assert why["tp1 cp1 pp4 dp1x2 mb2 ac=none"] == "microbatches(2) < mesh.pp(4)"
    assert "train.global_batch(N) % (dp(N) * train.micro_batch(N)) != N" in r.rejected
    # memory: Llama 3 8B on 16 GPUs of 26 GiB, FSDP over all 16 does not fit even fully checkpointed
    # (read off the one plan without checkpointing), so 2 replicas of 8 (larger shards) are rejected
    # without being planned, and 4 of 4 by the 16 bytes/parameter floor alone. (30 GiB before: the peak
    # counted fp32 gradient copies that only exist after the activations they would add to are freed: 28.3 GiB.)
    big = compose(["+experiment=llama3_8b", "launcher.nodes=2", "train.global_batch=16", "cluster.gpu_mem_gib=26"])
    too_big: dict = {}
    cand, msg, calls = visit_shape(big, Shape(1, 1, 1, 1, 16, 1), 8_030_261_248, too_big)
    assert cand is None and calls == 1 and msg.startswith("memory even with full AC: peak 24.6 GiB > 23.4 GiB usable")
    cand, msg, calls = visit_shape(big, Shape(1, 1, 1, 2, 8, 1), 8_030_261_248, too_big)
    assert cand is None and calls == 0 and "larger dp_shard" in msg
    cand, msg, calls = visit_shape(big, Shape(1, 1, 1, 4, 4, 1), 8_030_261_248, too_big)
    assert cand is None and calls == 0 and msg.startswith("memory floor: 16 B x params")


def test_the_top_k_override_lines_parse_as_a_valid_sweep(small, tmp_path):
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    cfg, r = small
    lines = write_top_k(r, cfg, k=3, out=str(tmp_path))
    command = shlex.split(lines[-1])
    assert command[:4] == ["python", "-m", "jobs.train", "-m"]
    jobs = BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(command[4:]), max_batch_size=None)[0]
    assert len(jobs) == 3
    points = [c for c in r.ranked if c.trainable][:3]
    for job, point, line in zip(jobs, points, lines[-4:-1]):
        swept = compose(job)
        d = validate(swept)  # the training validator accepts every point
        assert (d.dims.tp, d.dims.pp, d.dims.dp_replicate, d.dims.dp_shard, swept.train.micro_batch) == (
            point.shape.tp,
            point.shape.pp,
            point.shape.dp_replicate,
            point.shape.dp_shard,
            point.shape.micro_batch,
        )
        assert swept.mesh.pp_schedule == point.shape.schedule and swept.model == cfg.model
        one = compose(SMALL + line.split(": ", 1)[1].split())  # the per-point override line gives the same mesh
        assert one.mesh == swept.mesh and one.train == swept.train


@pytest.mark.slow
def test_the_16384_gpu_search_finishes_and_ranks_the_llama3_table4_mesh():
    cfg = compose(["+experiment=llama3_405b_8k_16384gpu", "train.activation_checkpointing=full"])
    cpu = time.process_time()
    r = search(cfg)
    cpu = time.process_time() - cpu
    assert r.enumerated > 20_000 and r.planned < r.enumerated / 2  # pruned before planning
    # 103 ranked since CP is kept for a sequence that needs it (plan.search_cp_only_when_needed; 2,060 before)
    assert r.own_rank() is not None and len(r.ranked) > 100
    assert cpu < 120, cpu  # measured 13 s of CPU on an idle core


def test_pruning_by_dominance_changes_no_result(monkeypatch):
    # Llama 3 8B on 16 GPUs of 40 GiB: memory decides, so the dominance rule skips plans; ranking and
    # rejections must be those of planning every shape.
    cfg = compose(["+experiment=llama3_8b", "launcher.nodes=2", "train.global_batch=16", "cluster.gpu_mem_gib=40"])
    pruned = search(cfg)
    from jobs.planner import search as S

    monkeypatch.setattr(S, "_dominated", lambda s, too_big: False)
    full = search(cfg)
    assert pruned.planned < full.planned
    assert [(c.shape, c.numbers) for c in pruned.ranked] == [(c.shape, c.numbers) for c in full.ranked]
    assert sorted(lab for v in pruned.rejected.values() for lab, _ in v) == sorted(
        lab for v in full.rejected.values() for lab, _ in v
    )


def test_jobs_plan_runs_the_search_and_refuses_a_profile_without_a_peak(capsys, tmp_path):
    from jobs import exitcodes
    from jobs.plan import main

    assert (
        main(SMALL + ["plan.search=true", "plan.search_rows=3", "plan.search_top_k=2", f"plan.search_out={tmp_path}"])
        == exitcodes.OK
    )
    out = capsys.readouterr().out
    assert "ranked by predicted tokens/s" in out and "+search=top1,top2" in out
    assert sorted(p.name for p in (tmp_path / "search").iterdir()) == ["top1.yaml", "top2.yaml"]
    assert main(["model=tiny", "cluster=local", "plan.search=true"]) == exitcodes.CONFIG_ERROR
    assert "cluster.gpu_bf16_tflops=0" in capsys.readouterr().err


def test_context_parallelism_is_ranked_only_where_the_sequence_needs_it():
    # Llama 3 405B at 8K on 16,384 GPUs: the step-time model prices a CP rank's shorter GEMMs at the full rate, and
    # ranked tp4 cp16 pp32 (512 tokens per rank) first, then tp8 cp4 pp32; nobody runs CP at 8K (Llama 3 §3.3.2: the
    # long-context stage only). Without CP the same meshes fit or fail for the batch, not the sequence.
    cfg = compose(["+experiment=llama3_405b_8k_16384gpu"])
    r = search(cfg)
    assert r.ranked[0].shape.label().startswith("tp8 cp1 pp8 v8 ")
    assert r.own_rank() is not None and r.own_rank() <= 20  # the paper's mesh, with the full AC it needs here
    # what CP is left: meshes whose version without CP does not fit, ranked last (tp8 cp128 pp4, tp8 cp256 pp4)
    assert all(c.shape.cp == 1 for c in r.ranked[: r.own_rank()])
    why = dict(r.rejected["cp not needed for the sequence"])["tp8 cp4 pp32 dp1x16 mb1 ac=none"]
    assert why.startswith("cp not needed for the sequence: without it tp8 cp1 pp32 dp1x64 mb1 ac=full fits")
    # 131K context: the sequence does not fit without CP, so cp16 (the paper's) is ranked
    long = search(compose(["+experiment=llama3_405b_131k_16384gpu"]))
    assert any(c.shape.cp > 1 for c in long.ranked)
