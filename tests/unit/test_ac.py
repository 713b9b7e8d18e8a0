"""Activation checkpointing: which blocks each mode checkpoints, that they really recompute, and that
the planner's rule is the trainer's."""

from __future__ import annotations

import pytest
import torch

from jobs.config import compose
from jobs.models.model import Transformer, init_weights
from jobs.planner import arith as P
from jobs.validate import validate
from parallel.ac import apply_ac, checkpointed_layers


def _forward_calls_per_block(mode: str, every: int = 2) -> dict[int, int]:
    cfg = compose(["model=tiny"]).model
    torch.manual_seed(0)
    model = Transformer(cfg)
    init_weights(model, seed=0)
    apply_ac(model, mode=mode, every=every)
    calls = {int(k): 0 for k in model.layers}
    for k, blk in model.layers.items():
        blk.attention.register_forward_hook(lambda *_, i=int(k): calls.__setitem__(i, calls[i] + 1))
    x = torch.randint(0, cfg.vocab_size, (2, 16))
    model(x).float().logsumexp(-1).mean().backward()
    return calls


@pytest.mark.parametrize(
    "mode, every, twice", [("none", 2, []), ("full", 2, [0, 1, 2, 3]), ("selective", 2, [1, 3]), ("selective", 3, [2])]
)
def test_checkpointed_blocks_run_their_forward_again_in_backward(mode, every, twice):
    calls = _forward_calls_per_block(mode, every)
    assert calls == {i: 2 if i in twice else 1 for i in range(4)}


def test_ac_keeps_every_parameter_name_and_the_gradients():
    cfg = compose(["model=tiny"]).model
    grads = {}
    for mode in ("none", "full"):
        model = Transformer(cfg)
        init_weights(model, seed=0)
        names = [n for n, _ in model.named_parameters()]
        apply_ac(model, mode=mode, every=2)
        assert [n for n, _ in model.named_parameters()] == names  # init, checkpoints and the planner see the same FQNs
        x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
        model(x).float().logsumexp(-1).mean().backward()
        grads[mode] = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert torch.equal(grads["none"], grads["full"])  # recomputation replays the same ops: bitwise


def test_selective_counts_the_blocks_a_rank_holds_so_every_pipeline_rank_checkpoints_its_share():
    assert checkpointed_layers([4, 5, 6, 7], mode="selective", every=2) == [5, 7]
    assert checkpointed_layers(list(range(61)), mode="selective", every=4) == list(range(3, 61, 4))
    # Llama 3 405B's interleaved 1-layer chunks: pp rank 0 holds layers 0, 16, 32, ... (all even), rank 1
    # layers 1, 17, ...; by global parity rank 0 checkpointed none and rank 1 all; per rank, half of each.
    assert checkpointed_layers([0, 16, 32, 48], mode="selective", every=2) == [16, 48]
    assert checkpointed_layers([1, 17, 33, 49], mode="selective", every=2) == [17, 49]


def test_the_planner_checkpoints_the_same_layers_as_the_trainer():
    assert P.checkpointed_layers is checkpointed_layers  # one rule, in parallel.config (torch-free)


def test_an_unknown_mode_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="train.activation_checkpointing='some'"):
        checkpointed_layers([0], mode="some", every=2)
    with pytest.raises(ValueError, match=r"train.ac_every\(0\) must be >= 1"):
        validate(compose(["train.activation_checkpointing=selective", "train.ac_every=0"]))
