"""Measures expert parallelism against replicated experts: tiny_moe's step time with ep2 and ep1 on the same ranks, same run.

    python scripts/bench/moe.py [--ranks 2 --ep 2 --batch 4 --seq 256 --rounds 4 --block 2 --warmup 1]

Every rank builds `model=tiny_moe` twice through the trainer's own `parallelize()` with FSDP over
dp_shard = ranks: once with every expert on every rank (ep1: each rank computes all 8 experts on its own
tokens), once with the experts sharded ep-ways (parallel/ep.py: counts exchanged, two token all-to-alls
per MoE block forward and two backward, experts' gradients reduced over edp only). It warms each up, then
alternates blocks of forward+backward steps (ABBA order per round). A step's time is the slowest rank's,
each started after a barrier. Rank 0 prints the ratio ep / ep1 (below 1 = expert parallel is faster)
and a JSON line.

--diagnose then runs --rounds more ep steps and says where ep's extra time goes: per MoE layer, the rows each
rank's experts received (max / mean over the ranks: the expert load) and the time from its dispatch to its
combine (the experts' forward); per all-to-all (tokens or counts), the time each rank spent in it, split into
waiting for the last rank to arrive (their skew) and the time the last rank itself spent in it (the
collective's own cost; the ranks share one clock, on one machine). A JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402 - imported once in the parent, before forking the ranks
import torch.distributed as dist  # noqa: E402
from _abba import abba_main, abba_medians, step_time  # noqa: E402 - scripts/bench is on sys.path

from jobs.config import compose  # noqa: E402
from jobs.models.model import Transformer, init_weights  # noqa: E402
from parallel.config import MeshConfig  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.ep import is_grouped_experts  # noqa: E402
from parallel.recipe import parallelize  # noqa: E402


def _model(*, ranks: int, ep: int, seq: int) -> torch.nn.Module:
    dims = ParallelDims.from_config(MeshConfig(dp_shard=ranks, ep=ep), world_size=ranks)
    mesh = dims.build_mesh("cpu")
    ep_mesh = dims.build_ep_mesh("cpu") if dims.ep_enabled else None
    with torch.device("meta"):
        model = Transformer(compose(["model=tiny_moe"]).model)
    (model,), _ = parallelize(
        model,
        dims=dims,
        mesh=mesh,
        stages_per_rank=1,
        pp_schedule="1f1b",
        sequence_parallel=False,
        loss_parallel=False,
        ep_mesh=ep_mesh,
        seq_len=seq,
    )
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    return model


def _timed_steps(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int) -> tuple[dict, list]:
    """`steps` more steps of `model`: (per MoE layer, the rows this rank's experts received and the median seconds
    of their forward; per step, the (start, end) of each all_to_all_single this rank ran, in order)."""
    rows: dict[str, tuple[int, float]] = {}  # rows received, and when its experts started
    compute: dict[str, list[float]] = {}  # seconds from the dispatch's end to the combine's start, per forward
    for name, m in model.named_modules():
        if is_grouped_experts(m):  # after the dispatcher's pre-hook (its rows), before its combine hook
            m.register_forward_pre_hook(
                lambda _m, args, n=name: rows.__setitem__(n, (args[0].shape[0], time.perf_counter()))
            )
            m.register_forward_hook(
                lambda _m, _a, _o, n=name: compute.setdefault(n, []).append(time.perf_counter() - rows[n][1]),
                prepend=True,
            )
    calls: list[tuple[float, float]] = []
    real = dist.all_to_all_single

    def timed(*a, **k):
        t0 = time.perf_counter()
        real(*a, **k)
        calls.append((t0, time.perf_counter()))

    dist.all_to_all_single = timed
    per_step = []
    try:
        for _ in range(steps):
            calls.clear()
            step_time(model, x, y)
            per_step.append(list(calls))
    finally:
        dist.all_to_all_single = real
    return {n: (r, statistics.median(compute[n])) for n, (r, _) in rows.items()}, per_step


def _report(gathered: list[tuple[dict, list]]) -> dict:
    """Rank 0's summary of every rank's `_timed_steps`: rows per layer and rank with their max / mean and the experts'
    forward ms; per rank and step, ms in all-to-alls, of which waiting for the last to arrive; the last arriver's ms
    in one call (median)."""
    ranks, steps = len(gathered), len(gathered[0][1])
    layers = {n: [g[0][n][0] for g in gathered] for n in gathered[0][0]}
    expert_ms = {n: [round(g[0][n][1] * 1e3, 2) for g in gathered] for n in gathered[0][0]}
    inside, waiting, last_own = [0.0] * ranks, [0.0] * ranks, []
    for s in range(steps):
        for call in zip(*(g[1][s] for g in gathered)):  # the i-th all-to-all on every rank
            last = max(t0 for t0, _ in call)
            last_own.append(next(t1 - t0 for t0, t1 in call if t0 == last))
            for r, (t0, t1) in enumerate(call):
                inside[r] += (t1 - t0) / steps
                waiting[r] += (last - t0) / steps
    return {
        "rows": {
            n: {
                "per_rank": v,
                "max_over_mean": round(max(v) / statistics.mean(v), 3),
                "expert_forward_ms": expert_ms[n],
            }
            for n, v in layers.items()
        },
        "all_to_alls_per_step": len(gathered[0][1][0]),
        "ms_in_all_to_alls_per_step": [round(v * 1e3, 2) for v in inside],
        "ms_waiting_for_last_arrival_per_step": [round(v * 1e3, 2) for v in waiting],
        "last_arrival_ms_in_one_call_median": round(statistics.median(last_own) * 1e3, 3),
    }


def rank_body(rank: int, args: argparse.Namespace) -> None:
    names = ("ep1", f"ep{args.ep}")
    models = {
        "ep1": _model(ranks=args.ranks, ep=1, seq=args.seq),
        names[1]: _model(ranks=args.ranks, ep=args.ep, seq=args.seq),
    }
    toks = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(rank))
    med, steps = abba_medians(models, toks[:, :-1], toks[:, 1:], args)
    if rank == 0:
        ratio = med[names[1]] / med["ep1"]
        print(
            f"tiny_moe on {args.ranks} ranks, batch {args.batch} x {args.seq} per rank: ep1 {med['ep1'] * 1e3:.1f} "
            f"ms/step, {names[1]} {med[names[1]] * 1e3:.1f} ms/step (medians of {steps}); "
            f"{names[1]} / ep1 = {ratio:.3f}"
        )
        print(
            json.dumps(
                {
                    "bench": "moe",
                    "ranks": args.ranks,
                    "ep": args.ep,
                    "batch": args.batch,
                    "seq_len": args.seq,
                    "ep1_s": med["ep1"],
                    "ep_s": med[names[1]],
                    "ratio_ep_over_ep1": ratio,
                    "steps": steps,
                }
            )
        )
    if args.diagnose:
        gathered = [None] * args.ranks
        dist.all_gather_object(gathered, _timed_steps(models[names[1]], toks[:, :-1], toks[:, 1:], args.rounds))
        if rank == 0:
            print(json.dumps({"bench": "moe_diagnose", "ep": args.ep, **_report(gathered)}))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument(
        "--diagnose", action="store_true", help="then: the experts' load and the all-to-alls' time, per rank"
    )
    return abba_main(p, world=lambda args: args.ranks, body=rank_body)


if __name__ == "__main__":
    sys.exit(main())
