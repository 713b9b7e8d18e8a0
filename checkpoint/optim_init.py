"""An empty optimizer's state made ready for a load without running a step: the tensors a checkpoint is read into.

torch's state-dict helpers (`get_optimizer_state_dict`) make that state by running the optimizer's step on zero
gradients at lr 0: for AdamW the whole update's arithmetic over every parameter, on a restart's critical path (2-5 s
of a 10 s restart of 250 MB of state on two loaded cores, the same on both tiers). Here the state's structure is
taken from one real step on a small stand-in parameter of the same optimizer class and options, and copied to every
parameter: zeros shaped like the parameter (a DTensor like the parameter for a DTensor), scalars as the stand-in has
them. The values are never used: the load replaces every one.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import _init_optim_state

__all__ = ["init_optimizer_state"]

_PROBE_SHAPE = (2, 3)  # the stand-in parameter's shape: a state tensor of this shape is per element of the parameter


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Fills an optimizer that has no state yet (and no gradients) with state of the structure its first step would
    make; torch's own init (a step at lr 0) runs where a state value is neither shaped like its parameter nor a
    scalar. An optimizer with state or gradients is left as it is (torch's rule)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    if opt.state or any(p.grad is not None for p in params):
        return
    templates = [_template(opt, g) for g in opt.param_groups]
    if any(t is None for t in templates):
        _init_optim_state(opt)
        return
    for group, template in zip(opt.param_groups, templates):
        for p in group["params"] if template else ():  # a stateless optimizer (SGD without momentum) keeps none
            if p.requires_grad:
                opt.state[p] = {k: torch.zeros_like(p) if shaped else _copy(v) for k, (shaped, v) in template.items()}


def _template(opt: torch.optim.Optimizer, group: dict[str, Any]) -> dict[str, tuple[bool, Any]] | None:
    """{key: (per element of the parameter, value)} of the state one step makes for a parameter of `group`, taken
    from that step on a stand-in of the same class and options; None when it cannot be built or copied."""
    params = [p for p in group["params"] if p.requires_grad]
    if not params:
        return {}
    p = params[0]
    local = p.to_local() if hasattr(p, "to_local") else p
    probe = torch.nn.Parameter(torch.zeros(_PROBE_SHAPE, dtype=local.dtype, device=local.device))
    accepted = inspect.signature(type(opt).__init__).parameters
    options = {k: v for k, v in group.items() if k != "params" and k in accepted}
    try:
        stand_in = type(opt)([probe], **options)
        _init_optim_state(stand_in)
    except Exception:  # noqa: BLE001 - an optimizer this cannot imitate: torch's own init runs instead
        return None
    state = stand_in.state.get(probe, {})
    out: dict[str, tuple[bool, Any]] = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and tuple(v.shape) == _PROBE_SHAPE:
            out[k] = (True, None)
        elif not isinstance(v, torch.Tensor) or v.dim() == 0:
            out[k] = (False, v)
        else:
            return None
    return out


def _copy(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v
