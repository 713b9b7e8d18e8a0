"""Causal scaled-dot-product attention on the kernel `model.sdpa_backend` names: torch's choice, or its math backend.

`auto` lets `F.scaled_dot_product_attention` pick a fused kernel (flash, memory-efficient or cuDNN on CUDA; flash on
CPU), which never writes the (seq x seq) scores to memory. `math` runs torch's math backend: QK^T, softmax and PV as
separate ops with the scores materialised, as Megatron-LM's unfused attention does (Korthikanti et al. 2022, §5).
The math backend upcasts bf16/fp16 inputs to fp32 unless `torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp`
is on (a process-wide flag, read on CPU too); it is turned on for the call and restored after, so the scores stay
in the compute dtype and nothing leaks to other code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from jobs.config import SDPA_BACKENDS

__all__ = ["causal_sdpa"]


@contextlib.contextmanager
def _math_backend() -> Iterator[None]:
    """Restricts SDPA to the math backend, in the inputs' dtype, for the duration; restores the global flag after."""
    from torch.nn.attention import SDPBackend, sdpa_kernel  # here only: the auto path never needs it

    prior = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(prior)


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, backend: str) -> torch.Tensor:
    """Causal attention of (batch, heads, seq, head_dim) q, k, v on `backend` (a `model.sdpa_backend` value)."""
    if backend == "auto":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if backend != "math":
        raise ValueError(f"model.sdpa_backend={backend!r} is not one of {', '.join(SDPA_BACKENDS)}")
    with _math_backend():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
