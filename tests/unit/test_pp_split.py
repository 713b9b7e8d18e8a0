"""The pipeline split: blocks per stage balanced by cost, a user's split honoured, a bad one refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from jobs.config import compose
from jobs.models.model import Transformer, TransformerBlock, init_weights
from jobs.validate import validate
from parallel.pipeline import balanced_layers_per_stage, layer_ranges, split_stage


@pytest.mark.parametrize(
    "n_layers, num_stages, expected",
    [
        # The case (torchtitan's 6-layer debug model, pp2 interleaved = 4 stages): the old even
        # split [2, 2, 1, 1] made the first stage cost 3 block-equivalents; balanced, every stage costs 2.
        (6, 4, [1, 2, 2, 1]),
        (4, 2, [2, 2]),  # the tiny model on pp2: embedding + 2 | 2 + head
        (5, 2, [3, 2]),  # odd: the block comes off the last stage (it also runs the loss)
        (8, 4, [1, 3, 3, 1]),  # 10 block-equivalents over 4 stages: max 3, edge stages lighter
        (8, 8, [1] * 8),  # as many stages as blocks: one each, never an empty stage
        (16, 4, [3, 5, 5, 3]),
        # Llama 3 405B, pp16 (Llama Team 2024, "The Llama 3 Herd of Models", §3.3.2: one layer fewer on
        # the first and the last stage).
        (126, 16, [7] + [8] * 14 + [7]),
    ],
)
def test_balanced_split_counts_embedding_and_head_as_one_block_each(n_layers, num_stages, expected) -> None:
    got = balanced_layers_per_stage(n_layers, num_stages)
    assert got == expected
    costs = [n + (i == 0) + (i == num_stages - 1) for i, n in enumerate(got)]
    assert max(costs) == -(-(n_layers + 2) // num_stages)  # the costliest stage is as cheap as it can be


def test_the_weights_of_embedding_and_head_are_parameters() -> None:
    assert balanced_layers_per_stage(8, 4, first_cost=0, last_cost=0) == [2, 2, 2, 2]
    assert balanced_layers_per_stage(8, 2, first_cost=0, last_cost=2) == [5, 3]


def test_layer_ranges_are_contiguous_and_follow_the_given_counts() -> None:
    assert [list(r) for r in layer_ranges(6, 4)] == [[0], [1, 2], [3, 4], [5]]
    assert [list(r) for r in layer_ranges(6, 4, layers_per_stage=[2, 2, 1, 1])] == [[0, 1], [2, 3], [4], [5]]
    assert [list(r) for r in layer_ranges(4, 2, layers_per_stage=[0, 4])] == [[], [0, 1, 2, 3]]


def test_validate_resolves_the_default_and_the_user_split() -> None:
    base = ["mesh.pp=2", "mesh.dp_shard=1", "mesh.tp=1", "launcher.tasks_per_node=2"]
    assert validate(compose(base)).pp_layers_per_stage == (2, 2)
    d = validate(compose([*base, "mesh.pp_layers_per_stage=[3,1]"]))
    assert d.pp_layers_per_stage == (3, 1)
    d = validate(compose([*base, "model.n_layers=6", "mesh.pp_schedule=interleaved_1f1b"]))
    assert d.pp_layers_per_stage == (1, 2, 2, 1)
    assert validate(compose(["mesh=single", "launcher.tasks_per_node=1"])).pp_layers_per_stage == ()
    # A user split may leave fewer blocks than stages, as long as every middle stage holds one.
    d = validate(
        compose([*base, "model.n_layers=2", "mesh.pp_schedule=interleaved_1f1b", "mesh.pp_layers_per_stage=[0,1,1,0]"])
    )
    assert d.pp_layers_per_stage == (0, 1, 1, 0)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["mesh.pp_layers_per_stage=[3,2]"], "mesh.pp_layers_per_stage=[3, 2]: 3 + 2 = 5 != model.n_layers(4)"),
        (["mesh.pp_layers_per_stage=[4]"], "has 1 entries != mesh.pp(2) * stages per rank(1) = 2 stages"),
        (
            ["mesh.pp_schedule=interleaved_1f1b", "mesh.pp_layers_per_stage=[2,2]"],
            "has 2 entries != mesh.pp(2) * stages per rank(2) = 4 stages",
        ),
        (["mesh.pp_layers_per_stage=[5,-1]"], "block counts must be >= 0"),
        (
            ["mesh.pp_schedule=interleaved_1f1b", "mesh.pp_layers_per_stage=[2,0,1,1]"],
            "stage(s) [1] would hold nothing",
        ),
    ],
)
def test_a_bad_user_split_is_refused_with_the_arithmetic(extra, needle) -> None:
    base = ["mesh.pp=2", "mesh.dp_shard=1", "mesh.tp=1", "launcher.tasks_per_node=2"]
    with pytest.raises(ValueError) as e:
        validate(compose([*base, *extra]))
    assert needle in str(e.value)


def test_a_split_without_a_pipeline_is_refused() -> None:
    with pytest.raises(ValueError, match=r"mesh.pp=1 \(no pipeline\); set mesh.pp_layers_per_stage=null"):
        validate(compose(["mesh=single", "launcher.tasks_per_node=1", "mesh.pp_layers_per_stage=[4]"]))


def test_the_planner_plans_and_measures_the_user_split() -> None:
    from jobs.planner.gate import build_plan

    plan = build_plan(compose(["mesh.pp_layers_per_stage=[3,1]"]), measure=True)
    assert [r["role"] for r in plan.roles] == ["pp0 [3 layers, embedding]", "pp1 [1 layers, head]"]
    for r in plan.measured:  # the real parallelize() on the fake backend holds the same blocks
        assert r["params_elems"] == r["analytic_elems"], r
    dim, ffn, heads, kv = 64, 192, 8, 4  # conf/model/tiny.yaml
    block = 2 * dim + dim * dim * 2 + 2 * dim * (dim // heads * kv) + 3 * dim * ffn
    # pp0: 3 blocks + embedding over tp2 * dp_shard2; the 2 norm weights per block are replicated over tp.
    assert plan.measured[0]["params_elems"] * 4 == 3 * block + 256 * dim + 3 * 2 * dim


def test_a_stage_copies_only_the_blocks_it_keeps_and_they_equal_the_models(monkeypatch) -> None:
    model = Transformer(compose(["model=tiny"]).model)  # 4 blocks; pp2 interleaved: 4 stages of one block
    init_weights(model, seed=0)
    copied: list[int] = []

    def recorded(block: TransformerBlock) -> dict:  # what deepcopy asks each block it copies for
        copied.append(next(i for i, b in enumerate(model.layers.values()) if b is block))
        return nn.Module.__getstate__(block)

    monkeypatch.setattr(TransformerBlock, "__getstate__", recorded)
    ranges = layer_ranges(4, 4)
    parts = [split_stage(model, s, ranges) for s in range(4)]
    # Before: every stage deep-copied all 4 blocks (16 copies), then dropped 3; a 16384-rank plan of Llama 3 405B
    # spent three quarters of its time there (40 parts of 126 blocks).
    assert copied == [0, 1, 2, 3]
    whole = model.state_dict()
    for s, part in enumerate(parts):
        got = part.state_dict()
        ends = ({"tok_embeddings"} if s == 0 else set()) | ({"norm", "output"} if s == 3 else set())
        assert {k.split(".")[0] for k in got} == {"layers", *ends}
        assert {k.split(".")[1] for k in got if k.startswith("layers.")} == {str(s)}  # FQNs unchanged
        for k, v in got.items():
            assert torch.equal(v, whole[k]) and v.data_ptr() != whole[k].data_ptr(), k  # a copy, bit for bit
