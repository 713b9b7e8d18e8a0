"""FSDP2 (`fully_shard`) per transformer block and at the root, over dp_shard (HSDP with dp_replicate)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

__all__ = ["apply_fsdp"]


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    per_block: bool = True,
    mp_policy: MixedPrecisionPolicy | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> None:
    """Wraps each block (one all-gather per block per forward) and the root (embeddings, norm, head).

    The wrap granularity sets the collective count: per block, each block's parameters are gathered
    just before it runs and freed after, so peak memory holds one block unsharded; root-only gathers
    everything in one collective. `dp_mesh` is 1-D (dp_shard) for FSDP, 2-D
    (dp_replicate, dp_shard) for HSDP. With pipeline parallelism pass reshard_after_forward=False:
    every microbatch would otherwise re-gather the stage's parameters for its backward.
    `mp_policy` (parallel.precision.fsdp_policy): bf16 compute, fp32 shards and reduction; None = fp32.
    `ignored_params` stay outside every unit (routed experts that parallel.ep leaves unwrapped on one edp rank).
    """
    mp = mp_policy or MixedPrecisionPolicy()
    if per_block:
        for block in model.layers.values():
            fully_shard(
                block,
                mesh=dp_mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=mp,
                ignored_params=ignored_params,
            )
    # The root (embeddings, final norm, head) runs last in forward and first in backward: keeping it
    # gathered across that boundary saves one all-gather per step.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=mp, ignored_params=ignored_params)
