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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402 - imported once in the parent, before forking the ranks
from _abba import abba_main, abba_medians  # noqa: E402 - scripts/bench is on sys.path

from jobs.config import compose  # noqa: E402
from jobs.models.model import Transformer, init_weights  # noqa: E402
from parallel.config import MeshConfig  # noqa: E402
from parallel.dims import ParallelDims  # noqa: E402
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    return abba_main(p, world=lambda args: args.ranks, body=rank_body)


if __name__ == "__main__":
    sys.exit(main())
