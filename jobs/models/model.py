"""The Llama-style transformer (RMSNorm, RoPE, grouped-query or latent attention, SwiGLU/MoE) and its mesh-independent init.

The model knows nothing of parallelism: `parallel.parallelize()` shards it from outside, and a
pipeline stage is this same module with the layers it does not own removed (FQNs kept).
"""

from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from jobs.config import NORM_KERNELS, ModelConfig
from jobs.models.ffn import FeedForward
from jobs.models.mla import MLA
from jobs.models.moe import MoE
from jobs.models.sdpa import causal_sdpa

__all__ = ["Transformer", "init_weights", "full_init_tensor"]


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim, on `kernel` (a `model.norm_kernel` value): `eager`
    runs the elementwise ops below; `fused` calls F.rms_norm (torch's fused kernels on CUDA). The fused
    kernel needs the input's dtype for the weight (else torch falls back to the elementwise ops), so it gets the
    weight in that dtype: under autocast, MLA's latent norms (bf16 inputs, fp32 weights) then return bf16."""

    def __init__(self, dim: int, eps: float, *, kernel: str) -> None:
        super().__init__()
        if kernel not in NORM_KERNELS:
            raise ValueError(f"model.norm_kernel={kernel!r} is not one of {', '.join(NORM_KERNELS)}")
        self.eps, self.kernel, self.normalized_shape = eps, kernel, (dim,)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel == "fused":
            return F.rms_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.eps)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_table(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """(max_seq_len, head_dim) table: cos of each pair's angle in the first half, sin in the second."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv)
    return torch.cat([angles.cos(), angles.sin()], dim=-1).float()


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotates (batch, seq, heads, head_dim) by position; pairs are (i, i + head_dim/2)."""
    seq, half = x.shape[1], x.shape[-1] // 2
    cos = table[:seq, :half].view(1, seq, 1, half)
    sin = table[:seq, half:].view(1, seq, 1, half)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.context_parallel = None  # set by parallel.cp.apply_cp: attention across the cp axis
        self.sdpa_backend = cfg.sdpa_backend  # the kernel of the attention itself (jobs/models/sdpa.py)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.context_parallel is not None:  # this rank holds 2 of the sequence's 2*cp chunks
            return self.wo(self.context_parallel(q, k, v).reshape(bs, seq, -1))
        rep = q.shape[2] // k.shape[2]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = causal_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend=self.sdpa_backend)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


def rope_head_dim(cfg: ModelConfig) -> int:
    """The dims RoPE rotates per head: the whole GQA head, or MLA's decoupled rope part (qk_rope_head_dim)."""
    return cfg.qk_rope_head_dim if cfg.attention == "mla" else cfg.dim // cfg.n_heads


def attention_block(cfg: ModelConfig) -> nn.Module:
    """GQA (model.attention=gqa) or multi-head latent attention (mla, jobs/models/mla.py)."""
    if cfg.attention == "mla":
        return MLA(cfg, rope=apply_rope, norm=functools.partial(RMSNorm, kernel=cfg.norm_kernel))
    return Attention(cfg)


def ffn_block(cfg: ModelConfig, layer: int) -> nn.Module:
    """The FFN of block `layer`: dense SwiGLU before model.n_dense_layers or without experts, else MoE (jobs/models/moe.py)."""
    if cfg.n_routed_experts > 0 and layer >= cfg.n_dense_layers:
        return MoE(cfg)
    return FeedForward(cfg.dim, cfg.ffn_dim)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps, kernel=cfg.norm_kernel)
        self.attention = attention_block(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, kernel=cfg.norm_kernel)
        self.feed_forward = ffn_block(cfg, layer)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """tokens (batch, seq) -> logits (batch, seq, vocab). Any of tok_embeddings / norm / output may be
    None on a pipeline stage that does not own it; the stage then takes or returns hidden states."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.attention not in ("gqa", "mla"):
            raise ValueError(f"model.attention={cfg.attention!r} is not one of gqa, mla")
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps, kernel=cfg.norm_kernel)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.rope_positions: torch.Tensor | None = None  # RoPE rows of a cp rank's chunks (parallel.cp.apply_cp)
        self.register_buffer("rope", rope_table(rope_head_dim(cfg), cfg.max_seq_len, cfg.rope_theta), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def init_buffers(self) -> None:
        """Recomputes the non-persistent RoPE table (on a cp rank, the rows of its chunks' global positions)
        and zeroes the MoE routers' buffers (after `to_empty` from the meta device; a checkpoint load then
        restores the expert biases)."""
        table = rope_table(rope_head_dim(self.cfg), self.cfg.max_seq_len, self.cfg.rope_theta)
        if self.rope_positions is None:
            with torch.no_grad():
                self.rope.copy_(table)
        else:
            self.rope = table[self.rope_positions].to(self.rope.device)
        for m in self.modules():
            if isinstance(m, MoE):
                m.reset_buffers()


def _init_std(fqn: str, cfg: ModelConfig) -> float | None:
    """Standard deviation of a parameter's normal init by name; None means ones (norm weights)."""
    if fqn.endswith("norm.weight"):
        return None
    if fqn.startswith("tok_embeddings"):
        return 1.0
    if fqn.startswith("output"):
        return cfg.dim**-0.5
    if fqn.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")):
        layer = int(fqn.split(".")[1])
        return 0.02 / math.sqrt(2 * (layer + 1))
    return 0.02


def full_init_tensor(fqn: str, shape: torch.Size, cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The full (unsharded) initial value of one parameter: a function of (seed, name, shape) only."""
    std = _init_std(fqn, cfg)
    if std is None:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(fqn.encode()))
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(model: Transformer, *, seed: int) -> None:
    """Initialises every parameter so the full model is identical on any mesh.

    Each rank computes a parameter's full value from (seed, FQN) and keeps its own shard
    (`distribute_tensor(..., src_data_rank=None)` slices locally, no communication). Costs one
    full-size temporary per parameter: right for models that fit host memory per tensor.
    """
    for fqn, param in model.named_parameters():
        full = full_init_tensor(fqn, param.shape, model.cfg, seed)
        if isinstance(param, DTensor):
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)
    model.init_buffers()
