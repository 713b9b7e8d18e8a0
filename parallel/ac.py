"""Activation checkpointing: which transformer blocks recompute their forward in backward, applied from outside.

Modes (`train.activation_checkpointing`):
  none       every block keeps its activations for backward;
  full       every block keeps only its input and recomputes the rest in backward (one more forward);
  selective  every k-th block (`train.ac_every`) of the blocks one rank holds, in order over all its
             pipeline stages, is checkpointed as in `full`, the others keep everything (per rank, so
             interleaved 1-layer chunks are not all or nothing by layer parity).
Selective here is block-level only; op-level selective checkpointing (save the matmul outputs,
recompute the cheap pointwise ops, torch's `create_selective_checkpoint_contexts`) is not done.

The wrapper is torch's composable `checkpoint` (non-reentrant `torch.utils.checkpoint` driven by
module hooks): it keeps every parameter's FQN, so initialization, checkpoints and the planner see
the same names with or without it.
"""

from __future__ import annotations

from torch import nn
from torch.distributed._composable import checkpoint

from parallel.config import AC_MODES, checkpointed_layers

__all__ = ["AC_MODES", "checkpointed_layers", "apply_ac"]


def apply_ac(model: nn.Module, *, mode: str, every: int, rank_layers: list[int] | None = None) -> list[int]:
    """Checkpoints the blocks of `model.layers` (keys are global layer indices) that `mode` selects among
    `rank_layers` (every block this rank holds, all its stages; default: this part's); returns their indices."""
    own = [int(k) for k in model.layers.keys()]
    chosen = [i for i in checkpointed_layers(rank_layers or own, mode=mode, every=every) if i in own]
    for i in chosen:
        checkpoint(model.layers[str(i)])
    return chosen
