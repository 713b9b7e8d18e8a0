"""Expert parallelism trains like one process: tiny_moe's loss and every gradient on ep2 / ep4 / ep2 x edp2 / ep2 folded
over cp2 (the two ranks hold different chunks of the same sequences) / ep2 beside dp_replicate2 (HSDP), and with the
experts tensor-parallel (etp = tp: tp2 alone, and dp_shard2 * tp2 with ep2 folded, sequence parallel on), equal the
single-process forward/backward of the same global batch (the sequence-wise balance loss on: under cp its expert
counts are summed over the chunks of a sequence), and so do the router biases after one update; exactly two token
all-to-alls per MoE layer each way, one host read per MoE layer (the dispatch's counts); under tp each rank routes and
dispatches its 1/tp of the tokens (the rows gathered and reduce-scattered over tp around the experts), with or without
sequence parallelism."""

from __future__ import annotations

import contextlib
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from jobs.config import compose
from jobs.models.moe import moe_layers, update_expert_bias
from jobs.trainer import cross_entropy
from parallel.config import MeshConfig
from parallel.cp import zigzag_positions
from parallel.dims import ParallelDims
from tests.multiproc._moe import GroupCollectives, HostSyncs, batch, biases, full_grads, parallel_model, reference
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.multiproc

GLOBAL_BATCH, SEQ = 8, 16


def _model_cfg():
    return compose(["model=tiny_moe", "model.moe_aux_loss_coef=0.1"]).model  # the balance loss on, alpha large


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return batch(seed=7, global_batch=GLOBAL_BATCH, seq=SEQ)


def _ep_rank(
    rank: int,
    world: int,
    *,
    ep: int,
    cp: int = 1,
    dp_replicate: int = 1,
    tp: int = 1,
    sequence_parallel: bool = False,
    activation_checkpointing: str = "none",
    mixed_precision: str = "fp32",
) -> dict:
    """This rank's share of one forward/backward under (dp_replicate, dp_shard=world/cp/tp/dp_replicate, cp, tp, ep) and
    the bias update over the world; returns the loss, the full grads, the biases, the all_to_all_single calls counted by
    phase and kind (token rows vs the int64 count exchange) and the MoE blocks' collectives on the tp axis."""
    cfg = _model_cfg()
    dims = ParallelDims.from_config(
        MeshConfig(dp_replicate=dp_replicate, dp_shard=world // cp // tp // dp_replicate, cp=cp, tp=tp, ep=ep),
        world_size=world,
    )
    mesh = dims.build_mesh("cpu")
    (model,), _ = parallel_model(
        cfg,
        dims=dims,
        mesh=mesh,
        ep_mesh=dims.build_ep_mesh("cpu") if ep > 1 else None,
        seq=SEQ,
        cp_impl="allgather",
        sequence_parallel=sequence_parallel,
        activation_checkpointing=activation_checkpointing,
        mixed_precision=mixed_precision,
    )
    tp_calls = GroupCollectives(mesh["tp"].get_group().group_name)  # a Python dispatch mode: only where tp > 1
    tp_calls.watch([model])
    calls: Counter = Counter()
    phase = ["forward"]
    real = dist.all_to_all_single

    dispatched: list[int] = []  # rows each ep token all-to-all sends in forward (dispatch, combine, per layer)
    tp_name = mesh["tp"].get_group().group_name

    def counting(out, inp, *args, **kwargs):
        calls[f"{phase[0]}_{'counts' if inp.dtype == torch.int64 else 'tokens'}"] += 1
        on_tp = tp > 1 and kwargs["group"].group_name == tp_name
        if phase[0] == "forward" and inp.dtype != torch.int64 and not on_tp:
            dispatched.append(inp.shape[0])
        return real(out, inp, *args, **kwargs)

    dist.all_to_all_single = counting
    try:
        x, y = _batch()
        local, dp_rank = GLOBAL_BATCH // dims.dp, dims.dp_rank(mesh)
        pos = zigzag_positions(SEQ, cp=cp, cp_rank=mesh["cp"].get_local_rank()) if cp > 1 else torch.arange(SEQ)
        rows = slice(dp_rank * local, (dp_rank + 1) * local)
        syncs = HostSyncs()
        with tp_calls if tp > 1 else contextlib.nullcontext(), syncs:
            loss = cross_entropy(model(x[rows][:, pos]), y[rows][:, pos])
            phase[0] = "backward"
            loss.backward()
    finally:
        dist.all_to_all_single = real
    total = loss.detach().float()
    dist.all_reduce(total)
    counted = [float(m.router.tokens_per_expert.sum()) for m in moe_layers([model])]
    update_expert_bias(moe_layers([model]), rate=cfg.moe_bias_rate, group=dist.group.WORLD)  # the trainer's group
    return {
        "loss": float(total) / world,
        "grads": full_grads([model]),
        "biases": biases([model]),
        "calls": dict(calls),
        "tp_calls": dict(tp_calls.calls),
        "syncs": dict(syncs.calls),
        "counted": counted,
        "dispatched": dispatched[::2],
        "expert_units": sum(
            isinstance(m, FSDPModule) for m in model.modules() if getattr(m, "is_grouped_experts", False)
        ),
    }


@pytest.mark.parametrize(
    "world,ep,cp,dp_replicate,tp,sp",
    [
        (2, 2, 1, 1, 1, False),
        (4, 4, 1, 1, 1, False),
        (4, 2, 1, 1, 1, False),
        (2, 2, 2, 1, 1, False),
        (4, 2, 1, 2, 1, False),
        (2, 1, 1, 1, 2, False),
        (4, 2, 1, 1, 2, True),
        (4, 2, 1, 1, 2, False),
    ],
    ids=[
        "ep2",
        "ep4",
        "ep2_edp2",
        "ep2_folded_over_cp2",
        "ep2_hsdp_dp_replicate2",
        "tp2",
        "dp_shard2_tp2_sp_ep2_folded",
        "dp_shard2_tp2_ep2_folded",
    ],
)
def test_expert_parallel_loss_and_every_gradient_equal_the_single_process_run(
    world: int, ep: int, cp: int, dp_replicate: int, tp: int, sp: bool
) -> None:
    cfg = _model_cfg()
    ref_loss, ref_grads, ref_biases = reference(cfg, *_batch())
    out = run_ranks(
        _ep_rank, world, ep=ep, cp=cp, dp_replicate=dp_replicate, tp=tp, sequence_parallel=sp, timeout=240
    ).results
    moe_layers_n = cfg.n_layers - cfg.n_dense_layers
    for rank, r in out.items():
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
        assert r["grads"].keys() == ref_grads.keys() and r["biases"].keys() == ref_biases.keys()
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"rank {rank} grad {name}")
            # Bitwise equal on every rank: a replicated weight (the router's) whose gradient differed between
            # tp ranks would drift apart silently, each rank stepping its own copy.
            torch.testing.assert_close(g, out[0]["grads"][name], rtol=0, atol=0, msg=f"rank {rank} vs 0: {name}")
        for name, b in r["biases"].items():
            torch.testing.assert_close(b, ref_biases[name], rtol=0, atol=0, msg=f"rank {rank} bias {name}")
        # Per MoE layer and microbatch: dispatch + combine forward, their reverses backward, one count exchange;
        # under tp also the rows' all-gather and reduce-scatter over tp (all-to-alls with uneven sizes).
        tokens = 2 * moe_layers_n * (int(ep > 1) + int(tp > 1))
        a2a = {
            "forward_tokens": tokens,
            "backward_tokens": tokens,
            **({"forward_counts": moe_layers_n} if ep > 1 else {}),
        }
        assert r["calls"] == (a2a if tokens else {}), r["calls"]
        # Each rank dispatches its own tokens, once: under tp its 1/tp of them (the block's input sharded over tp).
        k = cfg.experts_per_token
        assert r["dispatched"] == ([GLOBAL_BATCH * SEQ * k // world] * moe_layers_n if ep > 1 else []), r["dispatched"]
        # One host read per MoE layer and microbatch: the dispatch's counts, or without ep the padded fp32 matmul's.
        assert r["syncs"] == {"to_host": moe_layers_n}, r["syncs"]
        # Under tp, per layer: forward, the count all-gather, the rows' all-gather and reduce-scatter (all-to-alls),
        # the shared experts' all-gather and reduce-scatter (as the dense FFN under sequence parallelism), the
        # balance loss's count all-reduce, and without sequence parallelism the output's all-gather; backward, the
        # rows' and the shared experts' reverses (the router's gradient is Partial, reduced by FSDP or the trainer).
        forward = {"all_gather": 3 - int(sp), "all_to_all": 2, "reduce_scatter": 1, "all_reduce": 1}
        backward = {"all_gather": 1, "all_to_all": 2, "reduce_scatter": 1}
        tp_expected = {
            f"{phase}_{kind}": n * moe_layers_n
            for phase, kinds in (("forward", forward), ("backward", backward))
            for kind, n in kinds.items()
        }
        assert r["tp_calls"] == (tp_expected if tp > 1 else {}), r["tp_calls"]  # {}: counted only where tp > 1
        # The routed experts' own FSDP units only where they shard, gather or reduce something: more than one rank
        # holds each expert (edp > 1, or dp_replicate under HSDP); on one, FSDP would copy and rewrap them for nothing.
        assert r["expert_units"] == (moe_layers_n if ep > 1 and world // tp // ep > 1 else 0), r["expert_units"]
    assert any(n.endswith("experts.w1") for n in ref_grads)
    assert any(b.abs().sum() > 0 for b in ref_biases.values())  # the update moved the biases


@pytest.mark.parametrize("ac,mp", [("full", "fp32"), ("none", "bf16")], ids=["ep2_full_ac", "ep2_bf16"])
def test_expert_parallel_with_activation_checkpointing_or_bf16_trains_like_one_process(ac: str, mp: str) -> None:
    """Recomputation replays the dispatch (its collectives and its one host read) without counting the tokens
    twice for the biases; bf16 (FSDP2's policy, the grouped GEMM in bf16) stays within bf16's tolerance."""
    cfg = _model_cfg()
    ref_loss, ref_grads, ref_biases = reference(cfg, *_batch())
    out = run_ranks(_ep_rank, 2, ep=2, activation_checkpointing=ac, mixed_precision=mp, timeout=240).results
    layers = cfg.n_layers - cfg.n_dense_layers
    rtol = 1e-4 if mp == "fp32" else 3e-2
    for rank, r in out.items():
        assert r["loss"] == pytest.approx(ref_loss, rel=rtol)
        assert r["counted"] == [GLOBAL_BATCH // 2 * SEQ * cfg.experts_per_token] * layers  # this rank's tokens, once
        for name, g in r["grads"].items():
            if mp == "fp32":
                torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"rank {rank} grad {name}")
                continue
            # bf16: every gradient points where fp32's does and is as long (measured: cosine >= 0.989, the experts'
            # lowest: bf16 scores flip near-tied routing choices; norms within 8%)
            g, ref = g.float().flatten(), ref_grads[name].flatten()
            assert float(torch.nn.functional.cosine_similarity(g, ref, dim=0)) > 0.95, (rank, name)
            assert float(g.norm() / ref.norm()) == pytest.approx(1.0, abs=0.1), (rank, name)
        assert r["expert_units"] == (layers if mp == "bf16" else 0)  # FSDP2 casts them to bf16: kept for that
        recompute = ac == "full"  # each MoE layer's forward runs again in backward: its dispatch too
        assert r["syncs"] == {"to_host": layers * (1 + recompute)}, r["syncs"]
        assert r["calls"] == {
            "forward_tokens": 2 * layers,
            "forward_counts": layers,
            "backward_tokens": 2 * layers * (1 + recompute),
            **({"backward_counts": layers} if recompute else {}),
        }, r["calls"]
