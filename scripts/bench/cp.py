"""Measures context parallel's ring attention against all-gathered K/V: step time on the same ranks, same run.

    python scripts/bench/cp.py [--cp 2 --seq 4096 --rounds 4 --block 2 --warmup 1]

Every rank builds the same small Llama-style model twice (parallel/cp.py's apply_cp with
mesh.cp_impl=allgather and with ring; dim 64, 4 heads, 2 KV heads, 2 blocks, fp32, batch 1), warms
each up, then alternates blocks of forward+backward steps (ABBA order per round). A step's time is the
slowest rank's, each started after a barrier. At long sequences attention dominates: all-gather
computes every (query, key) score and masks half, the ring skips the blocks above the diagonal
(2 causal + 2cp-1 full blocks per rank instead of 4cp), but sends cp-1 point-to-point hops per layer.
Rank 0 prints the ratio ring / allgather (below 1 = ring is faster) and a JSON line.
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
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from jobs.config import ModelConfig  # noqa: E402
from jobs.launch.local import free_port  # noqa: E402
from jobs.model import Transformer, init_weights  # noqa: E402
from jobs.trainer import cross_entropy  # noqa: E402
from parallel.cp import apply_cp  # noqa: E402
from _fork import run_forked_ranks  # noqa: E402

IMPLS = ("allgather", "ring")


def _model(cp_mesh, *, impl: str, seq: int) -> Transformer:
    cfg = ModelConfig(name="cp_bench", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128,
                      max_seq_len=seq)
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_cp(model, cp_mesh, impl=impl, seq_len=seq)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    return model


def _step(model: Transformer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One forward+backward after a barrier; the slowest rank's seconds."""
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
    dist.init_process_group("gloo", rank=rank, world_size=args.cp, timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (args.cp,), mesh_dim_names=("cp",))
    models = {impl: _model(mesh["cp"], impl=impl, seq=args.seq) for impl in IMPLS}
    toks = torch.randint(0, 256, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    pos = models["ring"].rope_positions
    x, y = toks[:, pos], toks[:, pos + 1]
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    for impl in IMPLS:
        for _ in range(args.warmup):
            _step(models[impl], x, y)
    for r in range(args.rounds):
        for impl in (IMPLS if r % 2 == 0 else IMPLS[::-1]):  # ABBA: drift in machine load hits both alike
            times[impl] += [_step(models[impl], x, y) for _ in range(args.block)]
    if rank == 0:
        med = {impl: statistics.median(ts) for impl, ts in times.items()}
        ratio = med["ring"] / med["allgather"]
        print(f"cp{args.cp} seq {args.seq}: allgather {med['allgather'] * 1e3:.1f} ms/step, ring {med['ring'] * 1e3:.1f} "
              f"ms/step (medians of {len(times['ring'])}); ring / allgather = {ratio:.3f}")
        print(json.dumps({"bench": "cp", "cp": args.cp, "seq_len": args.seq, "allgather_s": med["allgather"],
                          "ring_s": med["ring"], "ratio_ring_over_allgather": ratio, "steps": len(times["ring"])}))
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--block", type=int, default=2)
    p.add_argument("--warmup", type=int, default=1)
    args = p.parse_args()
    port = free_port()
    failed = run_forked_ranks(args.cp, lambda rank: rank_main(rank, args, port))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
