"""The model the trainer trains and the planner plans: one definition of the dense, MoE and MLA blocks.

`model` holds the `Transformer` (blocks, RoPE, the weight initialisation every mesh shares); `ffn` the SwiGLU
feed-forward; `moe` the DeepSeek-V3-style mixture of experts (router, grouped experts, bias balancing); `mla`
multi-head latent attention; `sdpa` the attention kernel (`model.sdpa_backend`). Model code does not change
for parallelism: `parallel/` applies it from outside.
"""

__all__ = ["ffn", "mla", "model", "moe", "sdpa"]
