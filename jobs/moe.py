"""The mixture-of-experts FFN block (DeepSeek-V3 style): top-k router, routed + shared SwiGLU experts, load balancing.

Parallelism stays outside: `parallel.ep.apply_ep` shards `GroupedExperts` over the ep axis and puts
the token all-to-alls around its forward with hooks; this module computes the same thing on one
process or on many. Parameter shapes are the planner's (`jobs.planner.params.block_params`):
routed experts 3·dim·moe_ffn_dim each, shared experts the same, router n_routed_experts·dim (no bias).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from jobs.config import ModelConfig
from jobs.ffn import FeedForward

__all__ = ["MoE", "Router", "GroupedExperts", "grouped_swiglu", "moe_layers", "update_expert_bias", "SCORE_FUNCS"]

SCORE_FUNCS = ("softmax", "sigmoid")


class Router(nn.Module):
    """Scores every expert, picks the top k (node-limited), returns (weights, expert ids), each (tokens, k).

    `expert_bias` (a buffer, so it is checkpointed) shifts which experts are chosen but not the
    weights they get (DeepSeek-V3 §2.1.2, auxiliary-loss-free balancing); `tokens_per_expert` counts
    this step's choices for `update_expert_bias`. Node limit: the experts are `groups` contiguous
    groups (one per node); a token's experts lie in its `max_groups` best groups, a group scored by the
    sum of its two best biased scores (DeepSeek-V3's group-limited routing).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_routed_experts, cfg.experts_per_token
        self.score_func, self.route_scale = cfg.moe_score_func, cfg.moe_route_scale
        self.route_norm = cfg.moe_route_norm or cfg.moe_score_func == "sigmoid"
        self.groups = max(cfg.moe_groups, 1)
        self.max_groups = cfg.moe_max_nodes if 0 < cfg.moe_max_nodes < self.groups else self.groups
        self.aux_loss_coef = cfg.moe_aux_loss_coef
        self.gate = nn.Linear(cfg.dim, cfg.n_routed_experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(cfg.n_routed_experts), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_routed_experts), persistent=False)

    def reset_buffers(self) -> None:
        with torch.no_grad():
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> (weights (tokens, k), expert ids (tokens, k), scores (tokens, n_experts))."""
        counting = self.training and torch.is_grad_enabled()  # held-out evaluation does not move the biases
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        with torch.no_grad():
            biased = scores + self.expert_bias
            if self.max_groups < self.groups:
                biased = self._limit_groups(biased)
            ids = biased.topk(self.top_k, dim=-1).indices
            if counting:
                load = torch.bincount(ids.flatten(), minlength=self.n_experts)
                self.tokens_per_expert += load.to(self.tokens_per_expert)
        weights = scores.gather(-1, ids)
        if self.route_norm:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids, scores

    def _limit_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """Masks (to -inf) every expert outside each token's `max_groups` best groups."""
        t = biased.shape[0]
        per_group = biased.view(t, self.groups, -1)
        best = per_group.topk(min(2, per_group.shape[-1]), dim=-1).values.sum(-1)
        keep = torch.zeros(t, self.groups, dtype=torch.bool, device=biased.device)
        keep.scatter_(1, best.topk(self.max_groups, dim=-1).indices, True)
        return per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, -1)


def grouped_swiglu(
    x: torch.Tensor, counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """SwiGLU of tokens grouped by expert: x (sum(counts), dim) holds counts[e] rows for expert e in order.

    One batched matmul per weight for all local experts: the groups are padded to the largest one
    (experts, max count, dim), multiplied by (experts, dim, hidden) weights with `torch.bmm`, and the
    padding dropped again. Padding rows are zeros and never reach the output or the gradients.
    """
    n_exp, cap = len(counts), max(counts, default=0)
    if cap == 0:  # no rows: x and the weights stay in the graph, so every ep rank runs the same backward all-to-alls
        return x.new_zeros(0, w2.shape[-1]) + 0.0 * (x.sum() + w1.sum() + w2.sum() + w3.sum())
    counts_t = torch.tensor(counts, device=x.device)
    expert = torch.repeat_interleave(torch.arange(n_exp, device=x.device), counts_t)
    starts = torch.cumsum(counts_t, 0) - counts_t
    slot = expert * cap + torch.arange(x.shape[0], device=x.device) - starts[expert]
    padded = x.new_zeros(n_exp * cap, x.shape[-1]).index_copy(0, slot, x).view(n_exp, cap, -1)
    h = F.silu(torch.bmm(padded, w1)) * torch.bmm(padded, w3)
    return torch.bmm(h, w2).view(n_exp * cap, -1).index_select(0, slot)


class GroupedExperts(nn.Module):
    """The routed experts' weights stacked on dim 0: w1, w3 (experts, dim, hidden), w2 (experts, hidden, dim).

    Under expert parallelism each weight is a DTensor sharded on dim 0 over ep: this rank computes its
    local experts only (`to_local`), on the tokens the dispatch all-to-all brought it.
    """

    is_grouped_experts = True  # what parallel.ep looks for

    def __init__(self, n_experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        return grouped_swiglu(x, counts, w1, w2, w3)


class _AddAuxLoss(torch.autograd.Function):
    """Returns x unchanged; its backward also sends gradient 1 into `aux` (so the balance loss trains the
    router without changing the loss the trainer computes and logs; DeepSeek-V2's AddAuxiliaryLoss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype = aux.shape, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.aux_shape, dtype=ctx.aux_dtype, device=grad.device)


class MoE(nn.Module):
    """x (batch, seq, dim) -> shared experts(x) + sum over the top-k routed experts of weight · expert(x)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.dim, cfg.moe_ffn_dim)
        hidden = cfg.n_shared_experts * cfg.moe_ffn_dim
        self.shared = FeedForward(cfg.dim, hidden) if hidden > 0 else None  # the always-active experts as one SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, ids, scores = self.router(flat)
        order = ids.flatten().argsort(stable=True)  # (tokens * k,) slots grouped by expert, in token order
        counts = torch.bincount(ids.flatten(), minlength=self.router.n_experts).tolist()
        routed = self.experts(flat.index_select(0, order // self.top_k), counts)
        out = torch.zeros_like(flat, dtype=routed.dtype).index_add_(
            0, order // self.top_k, routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        )
        out = out.to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(flat)
        if self.training and self.router.aux_loss_coef > 0:
            out = _AddAuxLoss.apply(out, self._aux_loss(scores, ids, bs, seq))
        return out.view(bs, seq, dim)

    def _aux_loss(self, scores: torch.Tensor, ids: torch.Tensor, bs: int, seq: int) -> torch.Tensor:
        """Sequence-wise balance loss (DeepSeek-V3 eq. 17-20): alpha · sum_i f_i · P_i per sequence, averaged."""
        n, k = self.router.n_experts, self.top_k
        probs = scores / scores.sum(-1, keepdim=True)
        chosen = torch.zeros(bs * seq, n, device=scores.device).scatter_(1, ids, 1.0)
        f = chosen.view(bs, seq, n).mean(1) * n / k  # (batch, experts)
        p = probs.view(bs, seq, n).mean(1)
        return self.router.aux_loss_coef * (f * p).sum(-1).mean()


def moe_layers(parts: list[nn.Module]) -> list[MoE]:
    """This rank's MoE blocks, in FQN order (the same order on every rank of a pipeline stage)."""
    return [m for part in parts for _, m in sorted(part.named_modules()) if isinstance(m, MoE)]


@torch.no_grad()
def update_expert_bias(layers: list[MoE], *, rate: float, group=None) -> None:
    """After an optimizer step: bias_e += rate · sign(mean load − load_e) from the step's counts summed over
    `group` (the ranks that hold the same layers; None = this process alone), then the counts restart.

    One all-reduce for all layers. The sign is unchanged by ranks that count the same tokens twice
    (tp), so `group` may include them; every rank applies the same update and the biases stay equal.
    """
    if not layers:
        return
    counts = torch.stack([m.router.tokens_per_expert for m in layers])
    if group is not None:
        dist.all_reduce(counts, group=group)
    if rate > 0:
        delta = rate * torch.sign(counts.mean(-1, keepdim=True) - counts)
        for m, d in zip(layers, delta):
            m.router.expert_bias += d.to(m.router.expert_bias)
    for m in layers:
        m.router.tokens_per_expert.zero_()
