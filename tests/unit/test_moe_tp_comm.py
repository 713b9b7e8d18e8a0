"""The planner prices an MoE block's tensor-parallel traffic as parallel/tp.py builds it and the real run counts it."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from jobs.config import CONF_DIR, ModelConfig
from jobs.planner import arith as P

MB, SEQ, MICRO, CB = 3, 16, 2, 4  # microbatches, seq_len, micro_batch, compute bytes (fp32)


def _model(name: str) -> ModelConfig:
    return ModelConfig(**OmegaConf.to_container(OmegaConf.load(CONF_DIR / "model" / f"{name}.yaml")))


def _tp(m: ModelConfig, stages: list, *, sp: bool, ac: str = "none", tp: int = 2) -> list:
    items = P.comm_per_step(
        m,
        stages,
        pp=2,
        dp_replicate=1,
        fsdp=1,
        tp=tp,
        cp=1,
        ep=1,
        microbatches=MB,
        seq_len=SEQ,
        micro_batch=MICRO,
        sequence_parallel=sp,
        activation_checkpointing=ac,
        compute_bytes=CB,
    )
    return [it for it in items if it.axis == "tp"]


def _counts(items: list, *, moe: bool) -> dict[str, int]:
    out: dict[str, int] = {}
    for it in items:
        if ("MoE" in it.what) == moe:
            out[it.collective] = out.get(it.collective, 0) + it.count
    return out


@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_moe_blocks_tp_counts_per_phase_equal_what_the_real_run_counts(sp: bool) -> None:
    # tests/multiproc/test_moe_ep.py asserts per MoE block and microbatch, tp2: forward 2 all-to-alls (the routed
    # rows gathered and reduce-scattered over tp), the counts' all-gather, the shared experts' all-gather and
    # reduce-scatter (+ without SP the output's all-gather); backward the rows' 2 all-to-alls and the shared
    # experts' all-gather and reduce-scatter (+ without SP the input gradient's all-gather, which runs after the
    # block's backward hook there). The forward is what recomputing every block adds. tiny_moe's balance loss is off.
    m = _model("tiny_moe")
    stage = [P.StageShape((1, 2, 3), False, False)]  # the 3 MoE blocks, no embedding or head
    plain, recomputed = _counts(_tp(m, stage, sp=sp), moe=True), _counts(_tp(m, stage, sp=sp, ac="full"), moe=True)
    forward = {k: recomputed[k] - plain[k] for k in plain}
    backward = {k: plain[k] - forward[k] for k in plain if plain[k] - forward[k]}
    per_block = 3 * MB
    assert forward == {"all_to_all": 2 * per_block, "all_gather": (3 - sp) * per_block, "reduce_scatter": per_block}
    assert backward == {"all_to_all": 2 * per_block, "all_gather": (2 - sp) * per_block, "reduce_scatter": per_block}
    # The attention half stays as in a dense block: SP 1 all-gather + 1 reduce-scatter each way, else 1 all-reduce
    # each way (wq, wk, wv's input gradients are summed before it; tests/multiproc/test_collective_counts.py).
    attention = {"all_gather": 2 * 3 * MB, "reduce_scatter": 2 * 3 * MB} if sp else {"all_reduce": 2 * 3 * MB}
    assert _counts(_tp(m, stage, sp=sp), moe=False) == attention


@pytest.mark.parametrize("sp", [False, True], ids=["no_sp", "sp"])
def test_moe_blocks_tp_bytes_equal_the_hand_computed_sizes(sp: bool) -> None:
    m = _model("tiny_moe")
    m.moe_aux_loss_coef = 0.1  # the balance loss's count all-reduce too
    assert (m.dim, m.experts_per_token, m.n_shared_experts, m.n_routed_experts) == (64, 2, 1, 8)
    act = CB * SEQ * MICRO * 64  # one microbatch's hidden states on the tp group: 8192 bytes
    calls = 2 * 3 * MB  # forward + backward, 3 MoE blocks
    got = {
        (it.what, it.collective): (it.count, it.bytes)
        for it in _tp(m, [P.StageShape((1, 2, 3), False, False)], sp=sp)
        if "MoE" in it.what
    }
    # tp2: an all-gather, a reduce-scatter or an all-to-all moves (n-1)/n of the gathered buffer (0.5x), an
    # all-reduce 2 (n-1)/n (1x). The routed rows: top_k x act, twice each way.
    want = {
        ("fp32 MoE routed rows (2 per token)", "all_to_all"): (2 * calls, 2 * calls * 2 * act // 2),
        ("int64 MoE expert counts", "all_gather"): (calls // 2, calls // 2 * 2 * 8 * 8 // 2),
        ("fp32 MoE shared experts' activations", "all_gather"): (calls, calls * act // 2),
        ("fp32 MoE shared experts' activations", "reduce_scatter"): (calls, calls * act // 2),
        ("fp32 MoE balance-loss counts", "all_reduce"): (calls // 2, calls // 2 * 4 * MICRO * 8),
    }
    if not sp:
        want["fp32 MoE block output / input grad", "all_gather"] = (calls, calls * act // 2)
    assert got == want


def test_no_shared_experts_no_shared_collectives() -> None:
    m = _model("tiny_moe")
    m.n_shared_experts = 0
    moe = _counts(_tp(m, [P.StageShape((1, 2, 3), False, False)], sp=True), moe=True)
    assert moe == {"all_to_all": 4 * 3 * MB, "all_gather": 3 * MB}  # the routed rows' and the counts'


@pytest.mark.parametrize(
    "sp,ac,count,nbytes",
    [
        (False, "none", 390, 2453667840),
        (False, "full", 582, 3661627392),
        (True, "none", 390, 1226833920),
        (True, "full", 582, 1830813696),
    ],
)
def test_dense_tp_items_of_a_whole_llama3_8b_stage(sp: bool, ac: str, count: int, nbytes: int) -> None:
    # llama3_8b, one stage of all 32 blocks with the embedding and the head, tp4, 3 microbatches of 2 x 256, bf16:
    # the values comm_per_step gave before MoE blocks were priced apart, but for the all-reduces without SP: as many
    # calls as SP's all-gathers (4 a block, 2 more recomputed, 1 each end), each moving twice the bytes.
    m = _model("llama3_8b")
    items = P.comm_per_step(
        m,
        [P.StageShape(tuple(range(32)), True, True)],
        pp=2,
        dp_replicate=1,
        fsdp=2,
        tp=4,
        cp=1,
        ep=1,
        microbatches=3,
        seq_len=256,
        micro_batch=2,
        sequence_parallel=sp,
        activation_checkpointing=ac,
    )
    tp = [(it.collective, it.count, it.bytes) for it in items if it.axis == "tp"]
    kinds = ["all_gather", "reduce_scatter"] if sp else ["all_reduce"]
    assert tp == [(k, count, nbytes) for k in kinds]


def test_tiny_moe_dense_block_priced_as_before() -> None:
    # Block 0 of tiny_moe is dense (n_dense_layers 1): 4 all-reduces per microbatch, + 1 for the embedding.
    m = _model("tiny_moe")
    tp = _tp(m, [P.StageShape((0,), True, False)], sp=False)
    act = CB * SEQ * MICRO * 64
    assert [(it.collective, it.count, it.bytes) for it in tp] == [("all_reduce", 5 * MB, 5 * MB * act)]
