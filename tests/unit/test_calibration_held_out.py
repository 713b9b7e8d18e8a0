"""The deterministic parts of the out-of-sample calibration check
(scripts/bench/calibration_held_out.py measures): the GEMMs a model runs, the per-call rate fit, and the held-out
bookkeeping on timings that follow a known law. These prove the arithmetic, not the machine: what the machine gave
is in docs/planner.md ("Out of sample"), measured by the script, since on a loaded 2-core box a timing assertion would
be a coin toss."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from jobs.config import compose
from jobs.planner import arith as P
from jobs.planner.gemm import fit_gemm_rate, fit_rate, linear_counts, model_gemms, predict_seconds, single_rate
from jobs.planner.steptime import stage_flops

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location(
        "calibration_held_out", ROOT / "scripts/bench/calibration_held_out.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_models_gemms_are_three_per_linear_and_hold_the_planners_matmul_flops():
    m = compose(["model=tiny"]).model
    tokens = 48  # not a width of the model, so that only the shapes below coincide
    gemms = model_gemms(m, tokens=tokens)
    stages = [P.StageShape(tuple(range(m.n_layers)), True, True)]
    # seq_len=0 drops stage_flops' attention term: what is left is 3 x 2 x tokens x the matmul parameters
    _, train, _ = stage_flops(m, stages, tokens=tokens, seq_len=0, tp=1, recomputed=[])
    assert sum(g.count * g.flops for g in gemms) == pytest.approx(train, rel=1e-12)
    # the head (64 -> 256): forward, input gradient, weight gradient
    head = {(g.m, g.n, g.k): g.count for g in gemms if m.vocab_size in (g.m, g.n, g.k)}
    assert head == {(tokens, 256, 64): 1, (tokens, 64, 256): 1, (256, 64, tokens): 1}
    # (tokens x 64) @ (64 x 192): w1's and w3's forward and w2's input gradient, in every block
    assert next(g.count for g in gemms if (g.m, g.n, g.k) == (tokens, 192, 64)) == 3 * m.n_layers
    with pytest.raises(ValueError, match="dense GQA model only"):
        model_gemms(compose(["model=tiny_moe"]).model, tokens=tokens)


def test_a_tensor_parallel_ranks_gemms_are_its_shards_and_hold_the_planners_flops_over_tp():
    # Llama 3 405B on one tp8 rank (parallel/tp.py): wq, wk, wv, w1, w3 and the head column-wise, wo and w2 row-wise;
    # what scripts/gpu_preflight.py's `gemms` check times on a GPU
    m = compose(["model=llama3_405b"]).model
    assert linear_counts(m, tp=8) == [
        (2048, 16384, 126),
        (6656, 16384, 126),
        (16384, 128, 252),
        (16384, 2048, 126),
        (16384, 6656, 252),
        (16384, 16032, 1),
    ]
    stages = [P.StageShape(tuple(range(m.n_layers)), True, True)]
    _, train, _ = stage_flops(m, stages, tokens=8192, seq_len=0, tp=8, recomputed=[])
    assert sum(g.count * g.flops for g in model_gemms(m, tokens=8192, tp=8)) == pytest.approx(train, rel=1e-12)
    with pytest.raises(ValueError, match="tp=3 does not divide"):
        linear_counts(m, tp=3)


def test_the_fit_recovers_a_per_call_cost_and_a_rate_and_never_a_negative_cost():
    law = lambda f: 2e-6 + f / 50e9  # noqa: E731 - 2 us per call + 50 GFLOP/s
    fit = fit_rate([(f, law(f)) for f in (1e5, 1e6, 1e7)])
    assert fit.alpha_s == pytest.approx(2e-6, rel=1e-9) and fit.tflops == pytest.approx(0.05, rel=1e-9)
    # faster than proportional at the small end (a negative intercept): the rate alone, through the origin
    fit = fit_rate([(1e6, 1e-5), (2e6, 3e-5)])
    assert fit.alpha_s == 0.0 and fit.tflops > 0
    with pytest.raises(ValueError, match="2 or more sizes"):
        fit_rate([(1e6, 1e-5), (1e6, 2e-5)])


def test_held_out_gemms_that_follow_the_law_are_predicted_exactly_and_the_single_rate_misses_them():
    law = lambda g: 1.5e-6 + g.flops / 90e9  # noqa: E731 - the 2-core box's GEMMs, roughly (1 thread)
    tiny, wide = compose(["model=tiny"]).model, compose(["model=tiny", "model.dim=128", "model.ffn_dim=384"]).model
    points = [(g, law(g)) for g in model_gemms(tiny, tokens=64)]
    held_out = model_gemms(wide, tokens=64)
    truth = sum(g.count * law(g) for g in held_out)
    assert predict_seconds(fit_gemm_rate(points), held_out) / truth == pytest.approx(1.0, rel=1e-9)
    single = predict_seconds(single_rate(points), held_out) / truth
    assert 1.05 < single < 1.5  # the small calibration GEMMs' fixed cost, charged per FLOP of bigger ones


def test_the_bench_reports_held_out_ratios_from_the_calibration_sets_alone():
    bench = _bench()
    cfgs = {name: compose(ov) for name, ov in bench.SETS.items()}
    law = lambda g: 1.5e-6 + g.flops / 90e9  # noqa: E731
    gemm_s = {
        (g.m, g.n, g.k): law(g)
        for c in cfgs.values()
        for g in model_gemms(c.model, tokens=c.train.micro_batch * c.train.seq_len)
    }
    # whole step: 2 ms per block and head + FLOPs at 60 GFLOP/s
    step_s = {n: (c.model.n_layers + 1) * 2e-3 + bench._train_flops(c) / 60e9 for n, c in cfgs.items()}
    out = bench.report(cfgs, gemm_s, step_s)
    assert out["calibration_sets"] == list(bench.CALIBRATION) and set(out["sets"]) == set(bench.SETS)
    for name, r in out["sets"].items():
        assert r["held_out"] == (name not in bench.CALIBRATION)
        assert r["gemm_ratio_hockney"] == pytest.approx(1.0, abs=1e-3)
        assert r["step_ratio_hockney"] == pytest.approx(1.0, abs=1e-3)
    held = [r for r in out["sets"].values() if r["held_out"]]
    assert held and all(r["step_ratio_single_rate"] > 1.2 for r in held)  # a fixed cost charged per FLOP
    assert out["step_fits"]["hockney"]["alpha_us"] == pytest.approx(2000.0, rel=1e-6)
