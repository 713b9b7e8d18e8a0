"""Expert parallelism trains like one process: tiny_moe's loss and every gradient on ep2 / ep4 / ep2 x edp2 / ep2 folded
over cp2 (the two ranks hold different chunks of the same sequences) / ep2 beside dp_replicate2 (HSDP) equal the
single-process forward/backward of the same global batch, with exactly two token all-to-alls per MoE layer each way."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from jobs.config import compose
from jobs.model import Transformer, init_weights
from jobs.trainer import cross_entropy
from parallel.config import MeshConfig
from parallel.cp import zigzag_positions
from parallel.dims import ParallelDims
from parallel.recipe import parallelize
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.multiproc

GLOBAL_BATCH, SEQ = 8, 16


def _model_cfg():
    return compose(["model=tiny_moe"]).model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    toks = torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def _reference() -> tuple[float, dict[str, torch.Tensor]]:
    model = Transformer(_model_cfg())
    init_weights(model, seed=0)
    x, y = _batch()
    loss = cross_entropy(model(x), y)
    loss.backward()
    return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


def _ep_rank(rank: int, world: int, *, ep: int, cp: int = 1, dp_replicate: int = 1) -> dict:
    """This rank's share of one forward/backward under (dp_replicate, dp_shard=world/cp/dp_replicate, cp, ep); returns
    the loss, the full grads and the all_to_all_single calls counted by phase and kind (token rows vs the int64 count
    exchange)."""
    dims = ParallelDims.from_config(MeshConfig(dp_replicate=dp_replicate, dp_shard=world // cp // dp_replicate, cp=cp,
                                               ep=ep), world_size=world)
    mesh, ep_mesh = dims.build_mesh("cpu"), dims.build_ep_mesh("cpu")
    with torch.device("meta"):
        model = Transformer(_model_cfg())
    (model,), _ = parallelize(model, dims=dims, mesh=mesh, stages_per_rank=1, pp_schedule="1f1b",
                              sequence_parallel=False, loss_parallel=False, ep_mesh=ep_mesh, cp_impl="allgather",
                              seq_len=SEQ)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    calls: Counter = Counter()
    phase = ["forward"]
    real = dist.all_to_all_single

    def counting(out, inp, *args, **kwargs):
        calls[f"{phase[0]}_{'counts' if inp.dtype == torch.int64 else 'tokens'}"] += 1
        return real(out, inp, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        x, y = _batch()
        local, dp_rank = GLOBAL_BATCH // dims.dp, dims.dp_rank(mesh)
        pos = zigzag_positions(SEQ, cp=cp, cp_rank=mesh["cp"].get_local_rank()) if cp > 1 else torch.arange(SEQ)
        rows = slice(dp_rank * local, (dp_rank + 1) * local)
        loss = cross_entropy(model(x[rows][:, pos]), y[rows][:, pos])
        phase[0] = "backward"
        loss.backward()
    finally:
        dist.all_to_all_single = real
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for n, p in model.named_parameters()}
    return {"loss": float(total) / world, "grads": grads, "calls": dict(calls)}


@pytest.mark.parametrize("world,ep,cp,dp_replicate", [(2, 2, 1, 1), (4, 4, 1, 1), (4, 2, 1, 1), (2, 2, 2, 1), (4, 2, 1, 2)],
                         ids=["ep2", "ep4", "ep2_edp2", "ep2_folded_over_cp2", "ep2_hsdp_dp_replicate2"])
def test_expert_parallel_loss_and_every_gradient_equal_the_single_process_run(world: int, ep: int, cp: int,
                                                                              dp_replicate: int) -> None:
    ref_loss, ref_grads = _reference()
    out = run_ranks(_ep_rank, world, ep=ep, cp=cp, dp_replicate=dp_replicate, timeout=240).results
    moe_layers = sum(1 for i in range(_model_cfg().n_layers) if i >= _model_cfg().n_dense_layers)
    for rank, r in out.items():
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
        assert r["grads"].keys() == ref_grads.keys()
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"rank {rank} grad {name}")
        # Per MoE layer and microbatch: dispatch + combine forward, their reverses backward, one count exchange.
        assert r["calls"] == {"forward_tokens": 2 * moe_layers, "forward_counts": moe_layers,
                              "backward_tokens": 2 * moe_layers}, r["calls"]
    assert any(n.endswith("experts.w1") for n in ref_grads)
