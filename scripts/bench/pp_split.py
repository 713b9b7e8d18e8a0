"""Measures the cost-balanced pipeline split against the old even split: step time, same mesh, same run.

    python scripts/bench/pp_split.py [--rounds 6 --block 3 --warmup 2] [hydra overrides]

The default is the issue-9 comparison: a 6-block model shaped like torchtitan's llama3 debug model
(dim 256, 16 heads, vocab 2048, about 6.2M parameters), 2 ranks, mesh.pp=2 with interleaved 1F1B
(4 stages), 2 x 512 tokens per step, fp32. The old split gives the first stage the embedding and two
blocks ([2, 2, 1, 1]); the balanced one gives [1, 2, 2, 1]. Every rank builds both pipelines (the
bare loop of step_overhead.py: parallelize + schedule + AdamW), warms each up, then alternates blocks
of steps (ABBA order per round). A step's time is the slowest rank's, each started after a barrier.
Rank 0 prints the ratio balanced / even (below 1 = the balanced split is faster) and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402 - imported once in the parent, before forking the ranks
import torch.distributed as dist  # noqa: E402
from _fork import join_group, published_port, run_forked_ranks  # noqa: E402
from step_overhead import BareLoop, _slowest, _timed  # noqa: E402

from jobs.config import compose  # noqa: E402
from jobs.data import ensure_dataset  # noqa: E402
from jobs.validate import validate  # noqa: E402

DEFAULTS = [  # torchtitan llama3 debugmodel-sized, interleaved 1F1B on 2 ranks
    "model.dim=256",
    "model.n_layers=6",
    "model.n_heads=16",
    "model.n_kv_heads=16",
    "model.vocab_size=2048",
    "model.ffn_dim=768",
    "model.max_seq_len=512",
    "train.seq_len=512",
    "train.global_batch=2",
    "train.micro_batch=1",
    "mesh.pp=2",
    "mesh.dp_shard=1",
    "mesh.tp=1",
    "mesh.pp_schedule=interleaved_1f1b",
    "launcher.tasks_per_node=2",
]


def even_layers_per_stage(n_layers: int, num_stages: int) -> list[int]:
    """The split before the balanced one: as even as possible, earlier stages take the remainder."""
    base, extra = divmod(n_layers, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]


def bench_rank(loops: dict[str, BareLoop], args: argparse.Namespace) -> tuple[dict[str, list[float]], list[float]]:
    """Alternating blocks of steps of each loop; returns the slowest-rank step times and round ratios."""
    cursor = {name: 0 for name in loops}
    times: dict[str, list[float]] = {name: [] for name in loops}
    ratios = []

    def run(name: str, n: int) -> list[float]:
        out = []
        for _ in range(n):
            out.append(_timed(loops[name].step, cursor[name]))
            cursor[name] += 1
        return out

    for name in loops:
        run(name, args.warmup)
    for r in range(args.rounds):
        order = ("even", "balanced") if r % 2 == 0 else ("balanced", "even")
        got = {name: _slowest(run(name, args.block)) for name in order}
        for name in order:
            times[name].extend(got[name])
        ratios.append(statistics.median(got["balanced"]) / statistics.median(got["even"]))
    return times, ratios


def _rank_main(cfg, derived, splits: dict[str, list[int]], rank: int, port, args) -> None:
    world = cfg.world_size
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "OMP_NUM_THREADS": "1",
        }
    )
    torch.set_num_threads(args.threads)
    join_group(rank, world, port, timeout_s=300)  # rank 0 binds the store's port and publishes it
    try:
        loops = {name: BareLoop(cfg, replace(derived, pp_layers_per_stage=tuple(s))) for name, s in splits.items()}
        times, ratios = bench_rank(loops, args)
        for loop in loops.values():
            loop.close()
        if rank != 0:
            return
        med = {name: statistics.median(t) for name, t in times.items()}
        result = {
            "bench": "pp_split",
            "ratio": med["balanced"] / med["even"],
            "median_balanced_s": med["balanced"],
            "median_even_s": med["even"],
            "split_balanced": splits["balanced"],
            "split_even": splits["even"],
            "mesh": derived.dims.describe(),
            "schedule": cfg.mesh.pp_schedule,
            "world_size": world,
            "steps_each": len(times["even"]),
            "rounds": args.rounds,
            "block": args.block,
            "round_ratios": [round(x, 4) for x in ratios],
        }
        print(
            f"pp_split: balanced/even = {result['ratio']:.3f} | balanced {splits['balanced']} "
            f"{med['balanced'] * 1e3:.1f} ms, even {splits['even']} {med['even'] * 1e3:.1f} ms median over "
            f"{result['steps_each']} steps each | {result['mesh']} {cfg.mesh.pp_schedule} on {world} ranks",
            flush=True,
        )
        print(json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=6, help="alternating rounds of (even block, balanced block)")
    p.add_argument("--block", type=int, default=3, help="steps per block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each split first")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    args, overrides = p.parse_known_args(argv)
    cfg = compose([f"run.dir={tempfile.mkdtemp(prefix='pp_split-')}", *DEFAULTS, *overrides])
    derived = validate(cfg)
    splits = {
        "balanced": list(derived.pp_layers_per_stage),
        "even": even_layers_per_stage(cfg.model.n_layers, derived.num_stages),
    }
    ensure_dataset(cfg.data, vocab_size=cfg.model.vocab_size, sample_len=cfg.model.max_seq_len + 1)
    port = published_port()
    failed = run_forked_ranks(cfg.world_size, lambda rank: _rank_main(cfg, derived, splits, rank, port, args))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
