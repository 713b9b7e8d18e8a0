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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402 - imported once in the parent, before forking the ranks
from _abba import abba_main, abba_medians  # noqa: E402 - scripts/bench is on sys.path
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

from jobs.config import ModelConfig  # noqa: E402
from jobs.models.model import Transformer, init_weights  # noqa: E402
from parallel.cp import apply_cp  # noqa: E402

IMPLS = ("allgather", "ring")


def _model(cp_mesh, *, impl: str, seq: int) -> Transformer:
    cfg = ModelConfig(
        name="cp_bench", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=128, max_seq_len=seq
    )
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_cp(model, cp_mesh, impl=impl, seq_len=seq)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    return model


def rank_body(rank: int, args: argparse.Namespace) -> None:
    mesh = init_device_mesh("cpu", (args.cp,), mesh_dim_names=("cp",))
    models = {impl: _model(mesh["cp"], impl=impl, seq=args.seq) for impl in IMPLS}
    toks = torch.randint(0, 256, (1, args.seq + 1), generator=torch.Generator().manual_seed(0))
    pos = models["ring"].rope_positions
    med, steps = abba_medians(models, toks[:, pos], toks[:, pos + 1], args)
    if rank == 0:
        ratio = med["ring"] / med["allgather"]
        print(
            f"cp{args.cp} seq {args.seq}: allgather {med['allgather'] * 1e3:.1f} ms/step, ring {med['ring'] * 1e3:.1f} "
            f"ms/step (medians of {steps}); ring / allgather = {ratio:.3f}"
        )
        print(
            json.dumps(
                {
                    "bench": "cp",
                    "cp": args.cp,
                    "seq_len": args.seq,
                    "allgather_s": med["allgather"],
                    "ring_s": med["ring"],
                    "ratio_ring_over_allgather": ratio,
                    "steps": steps,
                }
            )
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    return abba_main(p, world=lambda args: args.cp, body=rank_body)


if __name__ == "__main__":
    sys.exit(main())
