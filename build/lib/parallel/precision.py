"""Mixed precision: bf16 compute with fp32 parameters, gradient reduction and optimizer state.

Two mechanisms, one meaning (`train.mixed_precision=bf16`):
  - with FSDP2 (dp > 1), its `MixedPrecisionPolicy`: the all-gather casts the fp32 shards to bf16
    for forward and backward, gradients are reduce-scattered in fp32 into fp32 shards;
  - without FSDP (TP-only, PP-only, one rank) parameters stay fp32 and `torch.autocast` runs each
    part's forward in bf16 (matmuls and attention; norms and the residual stream stay fp32).
The loss is computed outside the forward, in fp32 (`jobs.trainer.cross_entropy`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["PRECISIONS", "fsdp_policy", "apply_autocast"]

PRECISIONS = ("bf16", "fp32")


def fsdp_policy(mixed_precision: str) -> MixedPrecisionPolicy:
    """FSDP2's policy for `mixed_precision` (bf16 | fp32): bf16 parameters in compute, fp32 reduction."""
    assert mixed_precision in PRECISIONS, mixed_precision
    if mixed_precision == "fp32":
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def apply_autocast(part: nn.Module, *, device_type: str) -> None:
    """Runs `part`'s forward under bf16 autocast (for parts FSDP does not wrap). The backward runs
    outside it, as torch recommends, in the dtypes autocast chose in forward."""
    part.forward = torch.autocast(device_type=device_type, dtype=torch.bfloat16)(part.forward)
