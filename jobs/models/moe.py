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
from jobs.models.ffn import FeedForward
from parallel import ep as _ep  # the host-read seam, `_ep.to_host`

__all__ = [
    "MoE",
    "Router",
    "GroupedExperts",
    "expert_counts",
    "grouped_swiglu",
    "padded_swiglu",
    "moe_layers",
    "moe_layer_ids",
    "BALANCE_FIELDS",
    "set_aux_loss_scale",
    "update_expert_bias",
    "SCORE_FUNCS",
]

SCORE_FUNCS = ("softmax", "sigmoid")


def first_training_pass(module: nn.Module) -> bool:
    """A training forward, not held-out evaluation (no grad) nor activation checkpointing's recomputation (which
    runs inside backward, where autograd has a current graph task): what the step's counters count."""
    return module.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


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
        counting = first_training_pass(self)  # held-out evaluation and recomputation do not move the biases
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        with torch.no_grad():
            biased = scores + self.expert_bias
            if self.max_groups < self.groups:
                biased = self._limit_groups(biased)
            ids = biased.topk(self.top_k, dim=-1).indices
            if counting:
                self.tokens_per_expert += expert_counts(ids, self.n_experts).to(self.tokens_per_expert)
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


def expert_counts(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert of the choices `ids` (any shape), int64 on their device: a scatter-add, where `bincount`
    reads its input's min and max on the host (a device-to-host sync on CUDA)."""
    flat = ids.flatten()
    return torch.zeros(n_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


def grouped_swiglu(
    x: torch.Tensor,
    counts: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    *,
    host_counts: list[int] | None = None,
) -> torch.Tensor:
    """SwiGLU of tokens grouped by expert: x (sum(counts), dim) holds counts[e] rows for expert e in order.

    `counts` is an int64 tensor on x's device; `host_counts` the same numbers on the host where the caller already
    has them (the ep dispatch reads its counts once). Where `torch._grouped_mm` runs (`grouped_mm_available`), one
    grouped GEMM per weight over the rows as they are: no padding, no host read. Elsewhere (`padded_swiglu`) the
    groups are padded to the largest one, which needs the counts on the host (`host_counts`, or one read through
    `parallel.ep.to_host`).
    """
    if (
        x.shape[0] == 0
    ):  # no rows: x and the weights stay in the graph, so every ep rank runs the same backward all-to-alls
        return x.new_zeros(0, w2.shape[-1]) + 0.0 * (x.sum() + w1.sum() + w2.sum() + w3.sum())
    if grouped_mm_available(x, w1, w2, w3):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        h = F.silu(torch._grouped_mm(x, w1, offs=offs)) * torch._grouped_mm(x, w3, offs=offs)
        return _ContiguousGrad.apply(torch._grouped_mm(h, w2, offs=offs))
    return padded_swiglu(x, counts, _ep.to_host(counts) if host_counts is None else host_counts, w1, w2, w3)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward hands on a dense gradient: the grouped GEMM's backward refuses stride-0 (expanded) ones."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm_available(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these operands: a torch build that has it (2.8+), bf16 (the one dtype of its
    CUDA kernels and of its torch.compile meta function; torch 2.13 also runs it on CPU), rows 16-byte aligned. The
    same rule on every device, so the planner prices what runs (jobs.planner.memory.expert_padding)."""
    if not hasattr(torch, "_grouped_mm") or any(t.dtype != torch.bfloat16 for t in (x, *weights)):
        return False
    return all(t.shape[-1] * t.element_size() % 16 == 0 for t in (x, *weights))


def padded_swiglu(
    x: torch.Tensor, counts: torch.Tensor, host_counts: list[int], w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor
) -> torch.Tensor:
    """`grouped_swiglu` by one batched matmul per weight for all local experts: the groups padded to the largest
    one (experts, max count, dim), multiplied by (experts, dim, hidden) weights with `torch.bmm`, and the padding
    dropped again. Padding rows are zeros and never reach the output or the gradients. The FLOPs and memory grow
    with the imbalance (experts x max count rows); the planner prices them (jobs/planner)."""
    n_exp, cap, rows = len(host_counts), max([0, *host_counts]), x.shape[0]  # max(default=) breaks a compiled graph
    expert = torch.repeat_interleave(torch.arange(n_exp, device=x.device), counts, output_size=rows)
    starts = torch.cumsum(counts, 0) - counts
    slot = expert * cap + torch.arange(rows, device=x.device) - starts[expert]
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

    def forward(self, x: torch.Tensor, counts: torch.Tensor, host_counts: list[int] | None = None) -> torch.Tensor:
        """x (rows, dim) grouped by expert, counts (experts,) on x's device; `host_counts` the same on the host when
        the caller has read them already (parallel.ep's dispatch)."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        return grouped_swiglu(x, counts, w1, w2, w3, host_counts=host_counts)


class _AddAuxLoss(torch.autograd.Function):
    """Returns x unchanged; its backward also sends gradient `scale` into `aux` (so the balance loss trains the
    router without changing the loss the trainer computes and logs; DeepSeek-V2's AddAuxiliaryLoss). `scale` is
    what the trainer's backward gives the main loss (1 / microbatches; Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_shape, ctx.aux_dtype, ctx.scale = aux.shape, aux.dtype, scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


class MoE(nn.Module):
    """x (batch, seq, dim) -> shared experts(x) + sum over the top-k routed experts of weight · expert(x).

    `seq_groups` (set by parallel.cp.apply_cp and parallel.tp) hold the ranks with the other tokens of this rank's
    sequences: the balance loss counts whole sequences over them. `token_shards` (tp) ranks split the tokens and
    sum the router's gradient (parallel.tp): the balance loss's gradient is divided by it. `aux_loss_scale` is the gradient the trainer's backward gives the
    main loss (1 / microbatches without pipeline parallel; the pipeline schedule scales every gradient itself).
    `aux_loss_sum` adds up this layer's balance loss over the step's training forwards (metrics).
    """

    seq_groups: tuple = ()
    token_shards = 1
    aux_loss_scale = 1.0

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.router = Router(cfg)
        self.experts = GroupedExperts(cfg.n_routed_experts, cfg.dim, cfg.moe_ffn_dim)
        hidden = cfg.n_shared_experts * cfg.moe_ffn_dim
        self.shared = FeedForward(cfg.dim, hidden) if hidden > 0 else None  # the always-active experts as one SwiGLU
        self.register_buffer("aux_loss_sum", torch.zeros(()), persistent=False)

    def reset_buffers(self) -> None:
        self.router.reset_buffers()
        with torch.no_grad():
            self.aux_loss_sum.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, seq, dim = x.shape
        flat = x.reshape(-1, dim)
        weights, ids, scores = self.router(flat)
        order = ids.flatten().argsort(stable=True)  # (tokens * k,) slots grouped by expert, in token order
        counts = expert_counts(ids, self.router.n_experts)  # on the device: the ep dispatch reads them once
        routed = self.experts(flat.index_select(0, order // self.top_k), counts)
        weighted = routed * weights.flatten()[order].unsqueeze(-1).to(routed.dtype)
        # Back to token order and summed over the k copies: an index_select keeps only its indices for backward,
        # where index_add_ would keep the weighted rows too (k x dim per token), and it sums in a fixed order.
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        out = weighted.index_select(0, inverse).view(-1, self.top_k, dim).sum(1).to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(flat)
        if self.training and self.router.aux_loss_coef > 0:
            aux = self._aux_loss(scores, bs, seq)
            out = _AddAuxLoss.apply(out, aux, self.aux_loss_scale / self.token_shards)
            # After the apply: compiled, `first_training_pass` breaks the graph, and a break between `aux` and the
            # apply lost aux's gradient (torch 2.13; tests/multiproc/test_moe_compile.py).
            if first_training_pass(self):
                self.aux_loss_sum += aux.detach()
        return out.view(bs, seq, dim)

    def _aux_loss(self, scores: torch.Tensor, bs: int, seq: int) -> torch.Tensor:
        """Sequence-wise balance loss (DeepSeek-V3 eq. 17-20): alpha · sum_i f_i · P_i per sequence, averaged.

        f_i counts the plain top-k of the affinities (not the biased, node-limited choices) over the whole
        sequence: the counts are summed over `seq_groups` (Megatron's tp-cp reduction); P_i is this rank's mean of
        the normalised affinities, so the gradient of this rank's share, averaged over the ranks like the main
        loss's, is the whole sequence's."""
        n, k = self.router.n_experts, self.top_k
        with torch.no_grad():
            chosen = torch.zeros_like(scores).scatter_(1, scores.topk(k, dim=-1).indices, 1.0)
            per_seq = chosen.view(bs, seq, n).sum(1)  # (batch, experts)
            ranks = 1
            for group in self.seq_groups:
                dist.all_reduce(per_seq, group=group)
                ranks *= dist.get_world_size(group)
            f = per_seq * n / (k * seq * ranks)
        p = (scores / scores.sum(-1, keepdim=True)).view(bs, seq, n).mean(1)
        return self.router.aux_loss_coef * (f * p).sum(-1).mean()


def moe_layers(parts: list[nn.Module]) -> list[MoE]:
    """This rank's MoE blocks, in FQN order (the same order on every rank of a pipeline stage)."""
    return [m for part in parts for _, m in sorted(part.named_modules()) if isinstance(m, MoE)]


def set_aux_loss_scale(layers: list[MoE], scale: float) -> None:
    """The gradient the balance loss of `layers` gets in backward: the main loss's scale (1 / microbatches when the
    trainer divides each microbatch's loss; 1 under pipeline parallel, whose schedule divides every gradient), so
    alpha means the same on every mesh and microbatch count."""
    for m in layers:
        m.aux_loss_scale = scale


# The balance of one MoE layer over one step, as metrics.jsonl fields `<name>/<layer>` (jobs.trainer, jobs.report).
BALANCE_FIELDS = ("moe_load_imbalance", "moe_bias_spread", "moe_aux_loss")


def moe_layer_ids(parts: list[nn.Module]) -> list[int]:
    """The block index (the model's, not the stage's) of each of `moe_layers(parts)`, in that order."""
    return [
        int(name.split("layers.", 1)[1].split(".", 1)[0])
        for part in parts
        for name, m in sorted(part.named_modules())
        if isinstance(m, MoE)
    ]


@torch.no_grad()
def update_expert_bias(layers: list[MoE], *, rate: float, group=None) -> torch.Tensor | None:
    """After an optimizer step: bias_e += rate · sign(mean load − load_e) from the step's counts summed over
    `group` (the ranks that hold the same layers; None = this process alone), then the counts restart.

    One all-reduce for all layers. The sign is unchanged by ranks that count the same tokens twice
    (tp), so `group` may include them; every rank applies the same update and the biases stay equal.
    Returns the step's balance per layer, (layers, 3) in BALANCE_FIELDS order: tokens per expert max / mean (over
    `group`), the biases' spread (max - min) after the update, and the balance loss summed over this rank's
    training forwards (its microbatches); None without layers.
    """
    if not layers:
        return None
    counts = torch.stack([m.router.tokens_per_expert for m in layers])
    if group is not None:
        dist.all_reduce(counts, group=group)
    if rate > 0:
        delta = rate * torch.sign(counts.mean(-1, keepdim=True) - counts)
        for m, d in zip(layers, delta):
            m.router.expert_bias += d.to(m.router.expert_bias)
    bias = torch.stack([m.router.expert_bias.float() for m in layers])
    aux = torch.stack([m.aux_loss_sum.float() for m in layers])
    for m in layers:
        m.router.tokens_per_expert.zero_()
        m.aux_loss_sum.zero_()
    imbalance = counts.max(-1).values / counts.mean(-1).clamp_min(1e-12)
    return torch.stack([imbalance.float(), bias.max(-1).values - bias.min(-1).values, aux], dim=1)
