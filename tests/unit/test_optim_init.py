"""The optimizer state a load reads into is made without running the optimizer's step (checkpoint/optim_init.py)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state

from checkpoint import CheckpointConfig, CheckpointManager
from checkpoint.optim_init import init_optimizer_state

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1),
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.1, momentum=0.5, centered=True),
}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))


def _layout(opt: torch.optim.Optimizer) -> list[dict]:
    """Each parameter's state: key -> (shape, dtype) of a tensor, or the value itself."""
    return [
        {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in opt.state[p].items()}
        for g in opt.param_groups
        for p in g["params"]
        if p in opt.state
    ]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_state_made_for_a_load_has_the_layout_torchs_zero_step_makes_and_no_step_runs(name):
    ours, theirs = (OPTIMIZERS[name](list(_model().parameters())) for _ in range(2))
    for opt in (ours, theirs):  # a scheduler adds group keys the constructor does not take (initial_lr)
        torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    steps = []
    ours.register_step_pre_hook(lambda *_: steps.append(1))
    init_optimizer_state(ours)
    _init_optim_state(theirs)
    assert steps == []
    assert _layout(ours) == _layout(theirs)
    assert len(_layout(ours)) == (0 if name == "sgd" else 4)


def test_a_restart_loads_the_optimizer_state_without_running_an_optimizer_step(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    cfg = CheckpointConfig(every_steps=1, async_mode="none")
    ck = CheckpointManager(tmp_path, cfg=cfg)
    ck.load_latest(model_parts=[model], optimizers=[opt])
    for _ in range(2):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ck.save(2)
    ck.close()

    fresh = _model()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    steps = []
    fresh_opt.register_step_pre_hook(lambda *_: steps.append(1))
    ck = CheckpointManager(tmp_path, cfg=cfg)
    assert ck.load_latest(model_parts=[fresh], optimizers=[fresh_opt]) == 2
    ck.close()
    assert steps == []  # torch's own init runs the step once, at lr 0, over every parameter
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == fresh_opt.state[q].keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(opt.state[p][k], fresh_opt.state[q][k]) for k in opt.state[p])
