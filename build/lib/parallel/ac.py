"""Activation checkpointing: which transformer blocks recompute their forward in backward, applied from outside.

Modes (`train.activation_checkpointing`):
  none       every block keeps its activations for backward;
  full       every block keeps only its input and recomputes the rest in backward (one more forward);
  selective  every k-th block (`train.ac_every`, counted on the global layer index: blocks with
             (layer + 1) % k == 0) is checkpointed as in `full`, the others keep everything.
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

def apply_ac(model: nn.Module, *, mode: str, every: int) -> list[int]:
    """Checkpoints the blocks of `model.layers` (keys are global layer indices) that `mode` selects;
    returns their indices."""
    chosen = checkpointed_layers([int(k) for k in model.layers.keys()], mode=mode, every=every)
    for i in chosen:
        checkpoint(model.layers[str(i)])
    return chosen
