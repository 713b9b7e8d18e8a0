"""Out-of-sample check of the calibrated compute rate: fit on one model's GEMMs, predict another's.

    python scripts/bench/calibration_held_out.py [--rounds 30 --threads 1 --clock cpu]

`jobs.calibrate` measures one achieved rate on the model it is given (`matmul_tflops`: the model's forward +
backward FLOPs over its time) and the planner then divides any model's FLOPs by it. This script asks how well
that carries to shapes it was not measured on. The calibration set is tiny at micro-batch 2 (what the tests
calibrate with); the held-out sets are the same model twice as wide (dim 128, ffn 384) and tiny at micro-batch 8.

Protocol, for a shared box: one process, `--threads` torch threads, timed on this process's CPU time (`--clock
cpu`, the default: time the process waits for a core while neighbours run is not counted); every GEMM shape of every set (torch.mm on
fp32 tensors allocated once) and every set's whole forward + backward are timed in each of `--rounds` rounds,
in a new random order each round (so load drift hits every shape alike), and each keeps its fastest round
(a GEMM's time is a floor the load only adds to). Two models of the calibration set's GEMMs predict each held-out
set's GEMM seconds (`jobs.planner.gemm`): the single rate (total FLOPs over total seconds, what `matmul_tflops`
says) and Hockney's t = alpha + flops / rate per call, fitted on relative error. Printed: predicted / measured for
both, and for the whole step what `jobs.calibrate`'s whole-model rate predicts. One JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from jobs.config import compose  # noqa: E402
from jobs.planner import arith as P  # noqa: E402
from jobs.planner.gemm import RateFit, fit_gemm_rate, fit_rate, model_gemms, predict_seconds, single_rate  # noqa: E402
from jobs.planner.steptime import stage_flops  # noqa: E402

CALIBRATION = ("tiny_mb1", "tiny_mb4")  # the model you train, at two micro-batches: the fit needs two sizes
SETS = {  # name -> overrides
    "tiny_mb1": ["model=tiny", "train.micro_batch=1"],
    "tiny_mb4": ["model=tiny", "train.micro_batch=4"],
    "wide2x_mb2": ["model=tiny", "model.dim=128", "model.ffn_dim=384", "train.micro_batch=2"],
    "tiny_mb8": ["model=tiny", "train.micro_batch=8"],
}
BLOCK_S = 2e-3  # each timing repeats its call for about this long (a GEMM of a few microseconds is timed as many)


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def _timer(fn, clock) -> callable:
    """A function that returns the seconds of one call of `fn` on `clock`, timed over a block of calls sized on
    first use."""
    fn(), fn()
    t0 = time.perf_counter()
    fn()
    reps = max(1, min(1000, int(BLOCK_S / max(time.perf_counter() - t0, 1e-7))))

    def once() -> float:
        t0 = clock()
        for _ in range(reps):
            fn()
        return (clock() - t0) / reps

    return once


def _gemm_fn(shape: tuple[int, int, int]):
    m, n, k = shape
    a, b, out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    return lambda: torch.mm(a, b, out=out)


def _step_fn(cfg):
    """One microbatch's forward + backward of the unsharded model, as `jobs.planner.probes.matmul_rate` times it."""
    from jobs.models.model import Transformer

    torch.manual_seed(0)
    model = Transformer(cfg.model)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.micro_batch, cfg.train.seq_len))
    return lambda: F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()


def measure(cfgs: dict, *, rounds: int, seed: int, clock) -> tuple[dict, dict]:
    """(fastest seconds per GEMM shape, fastest seconds per set's whole step), interleaved in random order."""
    gemms = {name: model_gemms(c.model, tokens=c.train.micro_batch * c.train.seq_len) for name, c in cfgs.items()}
    shapes = sorted({(g.m, g.n, g.k) for gs in gemms.values() for g in gs})
    timers = {("gemm", s): _timer(_gemm_fn(s), clock) for s in shapes}
    timers.update({("step", name): _timer(_step_fn(c), clock) for name, c in cfgs.items()})
    best = dict.fromkeys(timers, float("inf"))
    order, rng = list(timers), random.Random(seed)
    for _ in range(rounds):
        rng.shuffle(order)
        for key in order:
            best[key] = min(best[key], timers[key]())
    return ({s: best[("gemm", s)] for s in shapes}, {name: best[("step", name)] for name in cfgs})


def _train_flops(c) -> float:
    """One microbatch's forward + backward FLOPs of the unsharded model, as the planner counts them."""
    m, t = c.model, c.train
    stages = [P.StageShape(tuple(range(m.n_layers)), True, True)]
    return stage_flops(m, stages, tokens=t.micro_batch * t.seq_len, seq_len=t.seq_len, tp=1, recomputed=[])[1]


def report(cfgs: dict, gemm_s: dict, step_s: dict) -> dict:
    """Predicted / measured of every set from the CALIBRATION sets' figures alone, for both models, at the GEMM
    level (the sets' GEMMs, each shape timed alone) and for the whole step (one microbatch's forward + backward:
    a fixed cost per block and head, the framework's per-op work, plus FLOPs at the rate)."""
    gemms = {n: model_gemms(c.model, tokens=c.train.micro_batch * c.train.seq_len) for n, c in cfgs.items()}
    measured = {n: sum(g.count * gemm_s[(g.m, g.n, g.k)] for g in gs) for n, gs in gemms.items()}
    points = [(g, gemm_s[(g.m, g.n, g.k)]) for n in CALIBRATION for g in gemms[n]]
    fits = {"single_rate": single_rate(points), "hockney": fit_gemm_rate(points)}
    units = {n: c.model.n_layers + 1 for n, c in cfgs.items()}  # blocks and the head
    step_points = [(_train_flops(cfgs[n]) / units[n], step_s[n] / units[n]) for n in CALIBRATION]  # per unit
    step_fits = {
        "single_rate": RateFit(0.0, sum(f for f, _ in step_points) / sum(t for _, t in step_points) / 1e12),
        "hockney": fit_rate(step_points),
    }
    out = {
        "calibration_sets": list(CALIBRATION),
        "threads": torch.get_num_threads(),
        "gemm_fits": {k: _fit_dict(f) for k, f in fits.items()},
        "step_fits": {k: _fit_dict(f) for k, f in step_fits.items()},
        "sets": {},
    }
    for n in cfgs:
        out["sets"][n] = {
            "held_out": n not in CALIBRATION,
            "gemm_ms": round(measured[n] * 1e3, 4),
            "step_ms": round(step_s[n] * 1e3, 4),
            "gemm_share_of_step": round(measured[n] / step_s[n], 3),
            **{f"gemm_ratio_{k}": round(predict_seconds(f, gemms[n]) / measured[n], 3) for k, f in fits.items()},
            **{
                f"step_ratio_{k}": round(units[n] * f.seconds(_train_flops(cfgs[n]) / units[n]) / step_s[n], 3)
                for k, f in step_fits.items()
            },
        }
    return out


def _fit_dict(f: RateFit) -> dict:
    return {"alpha_us": round(f.alpha_s * 1e6, 3), "gflops": round(f.tflops * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="cpu",
        help="cpu: this process's CPU time (what other processes' load does not add to); wall: elapsed",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfgs = {name: compose(ov) for name, ov in SETS.items()}
    t0 = time.perf_counter()
    gemm_s, step_s = measure(cfgs, rounds=args.rounds, seed=args.seed, clock=CLOCKS[args.clock])
    out = {"clock": args.clock, "rounds": args.rounds, **report(cfgs, gemm_s, step_s)}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    g, st = out["gemm_fits"], out["step_fits"]
    print(
        f"calibrated on {' + '.join(CALIBRATION)} ({out['threads']} thread(s), {args.clock} clock, min of "
        f"{args.rounds} rounds); GEMMs: single rate "
        f"{g['single_rate']['gflops']} GFLOP/s, hockney {g['hockney']['alpha_us']} us/call + {g['hockney']['gflops']} "
        f"GFLOP/s; step: single rate {st['single_rate']['gflops']} GFLOP/s, hockney {st['hockney']['alpha_us']} us "
        f"per block + {st['hockney']['gflops']} GFLOP/s"
    )
    print("predicted / measured  (GEMM: the set's GEMMs; step: one microbatch's forward + backward)")
    print(
        f"{'set':12s} {'held out':>8s} {'GEMM ms':>8s} {'step ms':>8s} {'GEMM/step':>9s} {'GEMM single':>11s} "
        f"{'GEMM hockney':>12s} {'step single':>11s} {'step hockney':>12s}"
    )
    for n, r in out["sets"].items():
        print(
            f"{n:12s} {'yes' if r['held_out'] else 'no':>8s} {r['gemm_ms']:8.3f} {r['step_ms']:8.3f} "
            f"{r['gemm_share_of_step']:9.2f} {r['gemm_ratio_single_rate']:11.3f} {r['gemm_ratio_hockney']:12.3f} "
            f"{r['step_ratio_single_rate']:11.3f} {r['step_ratio_hockney']:12.3f}"
        )
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
