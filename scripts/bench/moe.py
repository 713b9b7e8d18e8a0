"""Measures expert parallelism against replicated experts: tiny_moe's step time with ep2 and ep1 on the same ranks, same run.

    python scripts/bench/moe.py [--ranks 2 --ep 2 --batch 4 --seq 256 --rounds 4 --block 2 --warmup 1]

Every rank builds `model=tiny_moe` twice through the trainer's own `parallelize()` with FSDP over
dp_shard = ranks: once with every expert on every rank (ep1: each rank computes all 8 experts on its own
tokens), once with the experts sharded ep-ways (parallel/ep.py: counts exchanged, two token all-to-alls
per MoE block forward and two backward, experts' gradients reduced over edp only). It warms each up, then
alternates blocks of forward+backward steps (ABBA order per round). A step's time is the slowest rank's,
each started after a barrier. Rank 0 prints the ratio ep / ep1 (below 1 = expert parallel is faster)
and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402 - imported once in the parent, before forking the ranks
import torch.distributed as dist  # noqa: E402

from jobs.config import compose  # noqa: E402
from jobs.launch.local import free_port  # noqa: E402
from jobs.model import Transformer, init_weights  # noqa: E402
from jobs.trainer import cross_entropy  # noqa: E402
from parallel.config import MeshConfig  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
from parallel.recipe import parallelize  # noqa: E402
from _fork import run_forked_ranks  # noqa: E402


def _model(*, ranks: int, ep: int, seq: int) -> torch.nn.Module:
    dims = ParallelDims.from_config(MeshConfig(dp_shard=ranks, ep=ep), world_size=ranks)
    mesh = dims.build_mesh("cpu")
    ep_mesh = dims.build_ep_mesh("cpu") if dims.ep_enabled else None
    with torch.device("meta"):
        model = Transformer(compose(["model=tiny_moe"]).model)
    (model,), _ = parallelize(model, dims=dims, mesh=mesh, stages_per_rank=1, pp_schedule="1f1b",
                              sequence_parallel=False, loss_parallel=False, ep_mesh=ep_mesh, seq_len=seq)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    return model


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """One forward+backward (FSDP's gradient reduction included) after a barrier; the slowest rank's seconds."""
    dist.barrier()
    t0 = time.perf_counter()
    cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    dt = torch.tensor(time.perf_counter() - t0)
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt)


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks, timeout=timedelta(seconds=300))
    names = ("ep1", f"ep{args.ep}")
    models = {"ep1": _model(ranks=args.ranks, ep=1, seq=args.seq),
              names[1]: _model(ranks=args.ranks, ep=args.ep, seq=args.seq)}
    toks = torch.randint(0, 256, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(rank))
    x, y = toks[:, :-1], toks[:, 1:]
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        for _ in range(args.warmup):
            _step(models[n], x, y)
    for r in range(args.rounds):
        for n in (names if r % 2 == 0 else names[::-1]):  # ABBA: drift in machine load hits both alike
            times[n] += [_step(models[n], x, y) for _ in range(args.block)]
    if rank == 0:
        med = {n: statistics.median(ts) for n, ts in times.items()}
        ratio = med[names[1]] / med["ep1"]
        print(f"tiny_moe on {args.ranks} ranks, batch {args.batch} x {args.seq} per rank: ep1 {med['ep1'] * 1e3:.1f} "
              f"ms/step, {names[1]} {med[names[1]] * 1e3:.1f} ms/step (medians of {len(times['ep1'])}); "
              f"{names[1]} / ep1 = {ratio:.3f}")
        print(json.dumps({"bench": "moe", "ranks": args.ranks, "ep": args.ep, "batch": args.batch, "seq_len": args.seq,
                          "ep1_s": med["ep1"], "ep_s": med[names[1]], "ratio_ep_over_ep1": ratio,
                          "steps": len(times["ep1"])}))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--block", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    port = free_port()
    failed = run_forked_ranks(args.ranks, lambda rank: rank_main(rank, args, port))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
