"""torch.compile per transformer block (`train.compile`), one step of the `parallelize()` recipe.

Composes with FSDP2 and PP (same losses as eager: tests/multiproc/test_compile.py). Not with TP:
compiled blocks on tensor-parallel DTensors fail in backward with torch 2.13 on CPU/gloo, so
`jobs.validate` refuses `train.compile=true` with `mesh.tp > 1` (not tried on CUDA).
"""

from __future__ import annotations

from torch import nn

__all__ = ["apply_compile"]


def apply_compile(model: nn.Module, *, backend: str = "inductor") -> None:
    """Compiles each block of `model.layers` in place (`nn.Module.compile`), not the whole model.

    In place keeps every parameter's FQN (no `_orig_mod.` prefix), so the init, checkpoints and
    resharding see the same names with and without compile. All blocks share one code object, so
    the first block's graph is reused by the others (measured: one unique graph for 4 blocks).
    Compiling blocks rather than the whole model keeps each graph small and leaves the pipeline
    stage's embedding and head, and the boundaries between stages, eager. `backend` is torch.compile's
    (the trainer uses inductor; a unit test takes aot_eager, which skips inductor's code generation).
    """
    for block in model.layers.values():
        block.compile(backend=backend)
