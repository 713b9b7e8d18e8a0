"""Expert parallelism beside pipeline parallelism trains like one process: the DeepSeek-V3-shaped small model
(tiny_mla_moe: MLA, 1 dense block then MoE blocks) on pp2 * dp_shard2 with ep2 folded over dp_shard gives the
single-process loss, every gradient and, after the bias update over the trainer's group of each stage's ranks,
the same router biases, with the sequence-wise balance loss on (each microbatch's weighed like its main loss by the
schedule's gradient scaling). The split mesh.pp_layers_per_stage=[1,3] leaves stage 0 with only the dense block (no
router to update; the MoE blocks' ranks sum their counts over their own stage's ranks).

It used to hang: torch's pipeline infers the stage shapes at the first step by one real forward/backward on
uninitialised tensors, which can route every token of stage 1 to the experts of one ep rank; the other rank's
experts got no rows, their output did not depend on the dispatched tokens, and that rank skipped the dispatch
all-to-all's backward that its ep peer ran (jobs.models.moe.grouped_swiglu keeps the rows in the graph; the second test
forces such a routing, the garbage of the inference does not always). The same inference also counted an extra
pass into the routers' token counts, which moved the biases differently from one process (parallel/pipeline.py
puts the buffers back)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from jobs.config import compose
from jobs.models.moe import moe_layers, update_expert_bias
from jobs.trainer import Trainer, cross_entropy
from parallel.config import MeshConfig
from parallel.dims import ParallelDims
from parallel.pipeline import build_schedule
from tests.multiproc._moe import batch, biases, full_grads, parallel_model, reference
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.multiproc

GLOBAL_BATCH, SEQ, MICROBATCHES = 8, 16, 2
SPLIT = [1, 3]  # blocks per stage: the dense block 0 alone, then the three MoE blocks


def _model_cfg():
    return compose(["model=tiny_mla_moe", "model.moe_aux_loss_coef=0.1"]).model  # the balance loss on, alpha large


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return batch(seed=11, global_batch=GLOBAL_BATCH, seq=SEQ)


def _pp_ep_rank(rank: int, world: int) -> dict:
    """One 1F1B step of this rank's stage on its dp slice, then the bias update over the stage's ranks."""
    cfg = _model_cfg()
    dims = ParallelDims.from_config(MeshConfig(pp=2, dp_shard=2, ep=2), world_size=world)
    mesh = dims.build_mesh("cpu")
    parts, stages = parallel_model(
        cfg, dims=dims, mesh=mesh, ep_mesh=dims.build_ep_mesh("cpu"), seq=SEQ, pp_layers_per_stage=SPLIT
    )
    schedule = build_schedule(
        parts,
        stages,
        num_stages=2,
        schedule="1f1b",
        n_microbatches=MICROBATCHES,
        pp_group=mesh.get_group("pp"),
        device=torch.device("cpu"),
        loss_fn=cross_entropy,
    )
    x, y = _batch()
    local = GLOBAL_BATCH // dims.dp
    rows = slice(dims.dp_rank(mesh) * local, (dims.dp_rank(mesh) + 1) * local)
    first, last = 0 in stages, 1 in stages
    losses: list[torch.Tensor] = []
    schedule.step(*((x[rows],) if first else ()), target=y[rows] if last else None, losses=losses if last else None)
    # The stage's ranks (dp_shard) count the whole global batch between them: the trainer's own group.
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(model=cfg),
        env=SimpleNamespace(world_size=world),
        derived=SimpleNamespace(dims=dims),
        mesh=mesh,
        moe_layers=moe_layers(parts),
    )
    update_expert_bias(trainer.moe_layers, rate=cfg.moe_bias_rate, group=Trainer._moe_group(trainer))
    loss = float(torch.stack(losses).mean()) if last else None
    return {"loss": loss, "grads": full_grads(parts), "biases": biases(parts)}


def test_pp2_with_ep2_trains_the_deepseek_v3_shaped_model_like_one_process() -> None:
    ref_loss, ref_grads, ref_biases = reference(_model_cfg(), *_batch())
    out = run_ranks(_pp_ep_rank, 4, timeout=120).results
    # Ranks 2, 3 hold the last stage, one dp slice each: the global loss is their mean.
    assert (out[2]["loss"] + out[3]["loss"]) / 2 == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
    for stage_ranks in ((0, 1), (2, 3)):
        names = out[stage_ranks[0]]["grads"].keys()
        assert all(out[r]["grads"].keys() == names for r in stage_ranks)
    assert out[0]["grads"].keys() | out[2]["grads"].keys() == ref_grads.keys()
    assert not out[0]["grads"].keys() & out[2]["grads"].keys()  # each parameter on one stage
    for rank, r in out.items():
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"rank {rank} grad {name}")
        for name, b in r["biases"].items():
            torch.testing.assert_close(b, ref_biases[name], rtol=0, atol=0, msg=f"rank {rank} bias {name}")
    assert out[0]["biases"].keys() | out[2]["biases"].keys() == ref_biases.keys()
    assert not out[0]["biases"] and any(n.endswith("experts.w1") for n in out[2]["grads"])
    assert any(b.abs().sum() > 0 for b in ref_biases.values())  # the update moved the biases


def _skew(model: torch.nn.Module) -> None:
    """Every token picks experts 0 and 1 (both in ep rank 0's half): ep rank 1's experts get no rows."""
    with torch.no_grad():
        for m in moe_layers([model]):
            m.router.expert_bias[:2] = 1.0


def _skewed_ep_rank(rank: int, world: int) -> dict:
    """One forward/backward on ep2 (dp_shard2) with the skewed router; the token rows each dispatch brought here."""
    dims = ParallelDims.from_config(MeshConfig(dp_shard=2, ep=2), world_size=world)
    mesh = dims.build_mesh("cpu")
    (model,), _ = parallel_model(_model_cfg(), dims=dims, mesh=mesh, ep_mesh=dims.build_ep_mesh("cpu"), seq=SEQ)
    _skew(model)
    received: list[int] = []
    real = dist.all_to_all_single

    def recording(out, inp, *args, **kwargs):
        if inp.dtype != torch.int64 and not received_all[0]:
            received.append(out.shape[0])
        return real(out, inp, *args, **kwargs)

    received_all = [False]
    dist.all_to_all_single = recording
    try:
        x, y = _batch()
        local = GLOBAL_BATCH // dims.dp
        rows = slice(dims.dp_rank(mesh) * local, (dims.dp_rank(mesh) + 1) * local)
        loss = cross_entropy(model(x[rows]), y[rows])
        received_all[0] = True
        loss.backward()
    finally:
        dist.all_to_all_single = real
    total = loss.detach().clone()
    dist.all_reduce(total)
    return {"loss": float(total) / world, "grads": full_grads([model]), "dispatched_here": received[::2]}


def test_an_ep_rank_whose_experts_get_no_tokens_runs_the_backward_with_its_peer() -> None:
    ref_loss, ref_grads, _ = reference(_model_cfg(), *_batch(), prepare=_skew)
    out = run_ranks(_skewed_ep_rank, 2, timeout=120).results
    moe_blocks = _model_cfg().n_layers - _model_cfg().n_dense_layers
    assert out[1]["dispatched_here"] == [0] * moe_blocks  # rank 1's experts got no rows in any MoE block
    assert all(n > 0 for n in out[0]["dispatched_here"])
    for rank, r in out.items():
        assert r["loss"] == pytest.approx(ref_loss, rel=1e-6, abs=1e-6)
        for name, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=f"rank {rank} grad {name}")
