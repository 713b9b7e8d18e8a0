"""Multi-head latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank compressions, RoPE on decoupled dims.

Shapes are the planner's (`jobs.planner.params._attention_params`), so both count the same parameters:
  queries: wq_a (dim -> q_lora_rank), q_norm, wq_b (q_lora_rank -> n_heads · (qk_nope_head_dim + qk_rope_head_dim));
           without q compression (q_lora_rank = 0) one wq (dim -> n_heads · qk_head_dim);
  keys/values: wkv_a (dim -> kv_lora_rank + qk_rope_head_dim): the compressed latent c_kv and one RoPE key part
           shared by every head; kv_norm on c_kv; wkv_b (kv_lora_rank -> n_heads · (qk_nope_head_dim + v_head_dim));
  output: wo (n_heads · v_head_dim -> dim).
Each head's query/key is [nope part, rope part] (DeepSeek-V3: 128 + 64 = 192 dims), its value v_head_dim (128);
only the rope parts are rotated ("DeepSeek-V3 Technical Report", arXiv 2412.19437, §2.1.1, eqs. 1-11). The
softmax scale is 1/sqrt(qk_head_dim) (YaRN's long-context mscale is not modelled). Training computes the
decompressed keys and values (the inference-time absorption of wkv_b into wq/wo is not needed here).
"""

from __future__ import annotations

import torch
from torch import nn

from jobs.config import ModelConfig
from jobs.models.sdpa import causal_sdpa

__all__ = ["MLA"]


class MLA(nn.Module):
    """x (batch, seq, dim), rope table (seq, qk_rope_head_dim) -> (batch, seq, dim), causal."""

    def __init__(self, cfg: ModelConfig, *, rope, norm) -> None:
        super().__init__()
        self.nope, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_rank = cfg.kv_lora_rank
        qk = self.nope + self.rope_dim
        if cfg.q_lora_rank > 0:
            self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_norm = norm(cfg.q_lora_rank, cfg.norm_eps)
            self.wq_b = nn.Linear(cfg.q_lora_rank, cfg.n_heads * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, cfg.n_heads * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = norm(self.kv_rank, cfg.norm_eps)
        self.wkv_b = nn.Linear(self.kv_rank, cfg.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.v_dim, cfg.dim, bias=False)
        self._apply_rope = rope
        self.context_parallel = None  # never set: validate refuses mesh.cp > 1 with model.attention=mla
        self.sdpa_backend = cfg.sdpa_backend  # the kernel of the attention itself (jobs/models/sdpa.py)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "wq_a"):
            return self.wq_b(self.q_norm(self.wq_a(x)))
        return self.wq(x)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        q = self._queries(x).view(bs, seq, -1, self.nope + self.rope_dim)
        q_nope, q_rope = q.split([self.nope, self.rope_dim], dim=-1)
        c_kv, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(c_kv)).view(bs, seq, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        heads = kv.shape[2]
        q_rope = self._apply_rope(q_rope, rope)
        k_rope = self._apply_rope(k_rope.view(bs, seq, 1, self.rope_dim), rope).expand(bs, seq, heads, self.rope_dim)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        out = causal_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), backend=self.sdpa_backend)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))
