"""The SwiGLU feed-forward block: the dense blocks' FFN (jobs/models/model.py) and the MoE's shared experts (jobs/models/moe.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["FeedForward"]


class FeedForward(nn.Module):
    """x -> w2(silu(w1 x) * w3 x), no biases; `hidden` units."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
