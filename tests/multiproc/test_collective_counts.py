"""Exact collective counts (CommDebugMode) of the project's TP plan and FSDP2 wrapping on the tiny model, 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

from jobs.config import ModelConfig, compose
from jobs.models.model import Transformer, init_weights
from jobs.planner import arith as P
from parallel.dims import ParallelDims
from parallel.fsdp import apply_fsdp
from parallel.tp import apply_tp
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.multiproc

SEQ, BATCH = 32, 2
# CommDebugMode's op names: DTensor (TP) uses the functional collectives, FSDP2 the in-place c10d ops.
ALL_REDUCE = "c10d_functional.all_reduce"
ALL_GATHER = "c10d_functional.all_gather_into_tensor"
REDUCE_SCATTER = "c10d_functional.reduce_scatter_tensor"
FSDP_ALL_GATHER = "c10d._allgather_base_"
FSDP_REDUCE_SCATTER = "c10d._reduce_scatter_base_"


def _counts(cdm: CommDebugMode) -> dict[str, int]:
    return {str(op): n for op, n in cdm.get_comm_counts().items() if n}


def _dims(*, tp: int = 1, dp_shard: int = 1) -> ParallelDims:
    return ParallelDims(pp=1, dp_replicate=1, dp_shard=dp_shard, cp=1, tp=tp, ep=1, world_size=tp * dp_shard)


def _tp_model(cfg: ModelConfig, mesh, *, sp: bool) -> Transformer:
    """The real model under apply_tp on `mesh`'s tp axis, initialised (the head's logits gathered: no loss parallel)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_tp(model, mesh["tp"], sequence_parallel=sp, loss_parallel=False)
    model.to_empty(device="cpu")
    init_weights(model, seed=0)
    return model


def _tp_counts(rank: int, world_size: int, cfg: ModelConfig) -> dict[str, dict[str, int]]:
    """One block of the real model under apply_tp, without and with sequence parallel."""
    mesh = _dims(tp=world_size).build_mesh("cpu")
    out: dict[str, dict[str, int]] = {}
    for sp in (False, True):
        model = _tp_model(cfg, mesh, sp=sp)
        block = model.layers["0"]
        # Without SP a block takes the whole sequence; with SP each tp rank holds its Shard(1) slice.
        x = torch.randn(BATCH, SEQ // world_size if sp else SEQ, cfg.dim, generator=torch.Generator().manual_seed(1))
        tag = "sp" if sp else "no_sp"
        with torch.no_grad():
            with CommDebugMode() as cdm:
                block.feed_forward(block.ffn_norm(x))
            out[f"mlp_fwd_{tag}"] = _counts(cdm)
            with CommDebugMode() as cdm:
                y = block(x, model.rope)
            out[f"block_fwd_{tag}"] = _counts(cdm)
            out[f"block_out_shape_{tag}"] = tuple(y.shape)
    return out


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return compose(["model=tiny"]).model


@pytest.fixture(scope="module")
def tp_counts(tiny: ModelConfig) -> dict[str, dict[str, int]]:
    res = run_ranks(_tp_counts, 2, tiny, timeout=240)
    assert res.results[0] == res.results[1]  # both tp ranks issue the same collectives
    return res.results[0]


def test_tp_mlp_forward_without_sequence_parallel_issues_exactly_one_all_reduce(tp_counts):
    assert tp_counts["mlp_fwd_no_sp"] == {ALL_REDUCE: 1}  # w1/w3 column-, w2 row-parallel


def test_tp_block_forward_without_sequence_parallel_issues_two_all_reduces(tp_counts):
    assert tp_counts["block_fwd_no_sp"] == {ALL_REDUCE: 2}  # attention (wo) + MLP (w2)
    assert tp_counts["block_out_shape_no_sp"] == (BATCH, SEQ, 64)


def test_tp_block_forward_with_sequence_parallel_gathers_and_scatters_instead_of_all_reduce(tp_counts):
    # Per sub-layer: all-gather the sequence before it, reduce-scatter after; no all-reduce at all.
    assert tp_counts["block_fwd_sp"] == {ALL_GATHER: 2, REDUCE_SCATTER: 2}
    assert tp_counts["mlp_fwd_sp"] == {ALL_GATHER: 1, REDUCE_SCATTER: 1}
    assert tp_counts["block_out_shape_sp"] == (BATCH, SEQ // 2, 64)  # the output stays sequence-sharded


def _model_step_counts(rank: int, world_size: int, cfg: ModelConfig) -> dict[bool, dict[str, int]]:
    """Tensor parallel's collectives in one forward + backward of the whole real model (embedding, every block,
    head, loss), without and with sequence parallel; the head's logits gathered (loss_parallel off)."""
    mesh = _dims(tp=world_size).build_mesh("cpu")
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    out: dict[bool, dict[str, int]] = {}
    for sp in (False, True):
        model = _tp_model(cfg, mesh, sp=sp)
        with CommDebugMode() as cdm:
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1)).backward()
        out[sp] = _counts(cdm)
    return out


def _planned(cfg: ModelConfig, *, sp: bool) -> dict[str, int]:
    """The planner's tp collectives for the same step: one stage of every block with both ends, one microbatch."""
    items = P.comm_per_step(
        cfg,
        [P.StageShape(tuple(range(cfg.n_layers)), True, True)],
        pp=1,
        dp_replicate=1,
        fsdp=1,
        tp=2,
        cp=1,
        ep=1,
        microbatches=1,
        seq_len=SEQ,
        micro_batch=BATCH,
        sequence_parallel=sp,
        activation_checkpointing="none",
    )
    out: dict[str, int] = {}
    for it in items:
        if it.axis == "tp" and "MoE" not in it.what:
            out[it.collective] = out.get(it.collective, 0) + it.count
    return out


@pytest.mark.parametrize("name", ["tiny", "tiny_moe"])
def test_the_planner_prices_the_tp_collectives_a_whole_step_issues(name: str) -> None:
    # Without SP a sub-layer all-reduces once each way: wq, wk and wv (w1 and w3) each make a Partial gradient
    # of the sub-layer's input, and autograd sums them before the one all-reduce that replicates it (Megatron's
    # f / g pair). tiny (4 dense blocks): 9 forward (2 a block, the embedding) + 9 backward (2 a block, the head's
    # input), where the planner once priced one all-reduce per column-parallel linear backward: 30.
    cfg = compose([f"model={name}"]).model
    res = run_ranks(_model_step_counts, 2, cfg, timeout=240).results
    assert res[0] == res[1]
    no_sp, sp = res[0][False], res[0][True]
    assert no_sp[ALL_REDUCE] == _planned(cfg, sp=False)["all_reduce"] == (18 if name == "tiny" else 12)
    if name == "tiny":  # with SP: the same count as reduce-scatters, all-gathers + 1 for the logits
        assert sp[REDUCE_SCATTER] == _planned(cfg, sp=True)["reduce_scatter"] == 18
        assert sp[ALL_GATHER] == _planned(cfg, sp=True)["all_gather"] + 1 and ALL_REDUCE not in sp


_FSDP_VARIANTS = {  # name -> (per_block, reshard_after_forward)
    "per_block": (True, True),
    "per_block_no_reshard": (True, False),  # what the recipe uses with pipeline parallelism
    "root_only": (False, True),
}


def _fsdp_counts(rank: int, world_size: int, cfg: ModelConfig) -> dict[str, dict[str, dict[str, int]]]:
    """One steady-state step (after a warm-up step) of the real model under apply_fsdp, per variant."""
    mesh = _dims(dp_shard=world_size).build_mesh("cpu")
    gen = torch.Generator().manual_seed(100 + rank)  # each dp rank its own batch
    out: dict[str, dict[str, dict[str, int]]] = {}
    for name, (per_block, raf) in _FSDP_VARIANTS.items():
        with torch.device("meta"):
            model = Transformer(cfg)
        apply_fsdp(model, mesh["dp_shard"], reshard_after_forward=raf, per_block=per_block)
        model.to_empty(device="cpu")
        init_weights(model, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        counts: dict[str, dict[str, int]] = {}
        for step in range(2):
            tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=gen)
            with CommDebugMode() as fwd:
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1))
            with CommDebugMode() as bwd:
                loss.backward()
            with CommDebugMode() as optim:
                opt.step()
                opt.zero_grad(set_to_none=True)
            if step == 1:  # step 0 is the warm-up (lazy init)
                counts = {"forward": _counts(fwd), "backward": _counts(bwd), "optimizer": _counts(optim)}
        out[name] = counts
    return out


@pytest.fixture(scope="module")
def fsdp_counts(tiny: ModelConfig) -> dict[str, dict[str, dict[str, int]]]:
    res = run_ranks(_fsdp_counts, 2, tiny, timeout=240)
    assert res.results[0] == res.results[1]
    return res.results[0]


def test_fsdp_per_block_forward_all_gathers_once_per_block_plus_root(fsdp_counts, tiny):
    n = tiny.n_layers  # 4
    for name in ("per_block", "per_block_no_reshard"):
        assert fsdp_counts[name]["forward"] == {FSDP_ALL_GATHER: n + 1}, name


def test_fsdp_backward_reduce_scatters_once_per_group_and_regathers_only_when_resharded(fsdp_counts, tiny):
    n = tiny.n_layers
    # reshard_after_forward=True frees each block after forward, so backward gathers each block again;
    # the root (embedding, norm, head) stays gathered from its forward into its backward: n, not n + 1.
    assert fsdp_counts["per_block"]["backward"] == {FSDP_ALL_GATHER: n, FSDP_REDUCE_SCATTER: n + 1}
    assert fsdp_counts["per_block_no_reshard"]["backward"] == {FSDP_REDUCE_SCATTER: n + 1}


def test_fsdp_root_only_issues_one_all_gather_per_forward_and_one_reduce_scatter_per_backward(fsdp_counts):
    assert fsdp_counts["root_only"]["forward"] == {FSDP_ALL_GATHER: 1}
    # The root is never resharded between its forward and backward: no second all-gather.
    assert fsdp_counts["root_only"]["backward"] == {FSDP_REDUCE_SCATTER: 1}


def test_fsdp_optimizer_step_issues_no_collectives(fsdp_counts):
    for name in _FSDP_VARIANTS:
        assert fsdp_counts[name]["optimizer"] == {}, name
