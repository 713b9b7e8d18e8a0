"""Pipeline parallelism: which layers each stage owns, the stage split, and the schedule."""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: jobs.validate uses the stage arithmetic on the login node, without torch
    import torch
    from torch import nn
    from torch.distributed.pipelining.schedules import _PipelineSchedule

__all__ = [
    "balanced_layers_per_stage",
    "check_layers_per_stage",
    "layer_ranges",
    "stage_ids",
    "split_stage",
    "build_schedule",
]

# mesh.pp_schedule -> the torch.distributed.pipelining class
_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv_zero_bubble": "ScheduleZBVZeroBubble",
}


# Block-equivalents of the work a stage does besides its transformer blocks (torchtitan's
# pipeline_parallel_first/last_stage_less_layers defaults): the embedding on the first stage,
# the final norm + output head (and the loss) on the last. So those stages get fewer blocks.
EMBEDDING_COST = 1
OUTPUT_COST = 1


def balanced_layers_per_stage(
    n_layers: int, num_stages: int, *, first_cost: int = EMBEDDING_COST, last_cost: int = OUTPUT_COST
) -> list[int]:
    """Blocks per stage that make the costliest stage as cheap as possible, counting the embedding
    as `first_cost` and the output layer as `last_cost` blocks; every stage keeps at least one block
    when there are enough. Ties: a block comes off the first or last stage before a middle one (the
    1F1B first stage holds the most microbatches in flight, the last one also runs the loss),
    later stages before earlier ones."""
    extra = [0] * num_stages
    extra[0] += first_cost
    extra[-1] += last_cost
    floor = 1 if n_layers >= num_stages else 0
    cost = 0  # the smallest per-stage cost with room for every block
    while sum(max(floor, cost - e) for e in extra) < n_layers:
        cost += 1
    blocks = [max(floor, cost - e) for e in extra]
    for _ in range(sum(blocks) - n_layers):
        s = max(
            (i for i in range(num_stages) if blocks[i] > floor), key=lambda i: (blocks[i] + extra[i], extra[i] > 0, i)
        )
        blocks[s] -= 1
    return blocks


def check_layers_per_stage(layers_per_stage: list[int], *, n_layers: int, pp: int, stages_per_rank: int) -> None:
    """Raises ValueError, naming `mesh.pp_layers_per_stage` and the arithmetic, for a split that cannot run."""
    given = list(layers_per_stage)
    num_stages = pp * stages_per_rank
    if pp == 1:
        raise ValueError(
            f"mesh.pp_layers_per_stage={given} is set but mesh.pp=1 (no pipeline); set mesh.pp_layers_per_stage=null"
        )
    if len(given) != num_stages:
        raise ValueError(
            f"mesh.pp_layers_per_stage={given} has {len(given)} entries != mesh.pp({pp}) * stages per rank"
            f"({stages_per_rank}) = {num_stages} stages; give one block count per stage"
        )
    if any(n < 0 for n in given):
        raise ValueError(f"mesh.pp_layers_per_stage={given}: block counts must be >= 0")
    if sum(given) != n_layers:
        raise ValueError(
            f"mesh.pp_layers_per_stage={given}: {' + '.join(map(str, given))} = {sum(given)} != "
            f"model.n_layers({n_layers}); the counts must add up to the model's blocks"
        )
    empty = [s for s in range(1, num_stages - 1) if given[s] == 0]
    if empty:
        raise ValueError(
            f"mesh.pp_layers_per_stage={given}: stage(s) {empty} would hold nothing (no blocks, no embedding, "
            "no output layer); give every middle stage at least one block"
        )


def layer_ranges(
    n_layers: int, num_stages: int, *, layers_per_stage: list[int] | tuple[int, ...] | None = None
) -> list[range]:
    """Contiguous block ranges per stage: `layers_per_stage` when given (checked by the caller),
    else the cost-balanced split (`balanced_layers_per_stage`)."""
    counts = list(layers_per_stage) if layers_per_stage else balanced_layers_per_stage(n_layers, num_stages)
    assert len(counts) == num_stages and sum(counts) == n_layers, (counts, n_layers, num_stages)
    out, start = [], 0
    for n in counts:
        out.append(range(start, start + n))
        start += n
    return out


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Stages held by `pp_rank`: loop order (r, r+pp, ...) or, for V schedules, (r, 2pp-1-r)."""
    if schedule == "zbv_zero_bubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def split_stage(model: nn.Module, stage: int, ranges: list[range]) -> nn.Module:
    """A copy of `model` that keeps only stage `stage`'s layers, `ranges[stage]` (FQNs unchanged); the
    embedding stays on the first stage, the final norm and output head on the last. Cheap on meta.

    Only what the stage keeps is copied: deepcopy's memo maps every dropped module to itself, and the copy lets go
    of those below. (Copying the whole model per stage was three quarters of a 16384-rank plan's time: 40 stage
    parts of Llama 3 405B's 126 blocks.)"""
    num_stages = len(ranges)
    keep = {str(i) for i in ranges[stage]}
    dropped = [m for name, m in model.layers.items() if name not in keep]
    if stage != 0:
        dropped.append(model.tok_embeddings)
    if stage != num_stages - 1:
        dropped += [model.norm, model.output]
    part = copy.deepcopy(model, {id(m): m for m in dropped if m is not None})
    for name in list(part.layers.keys()):
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.tok_embeddings = None
    if stage != num_stages - 1:
        part.norm = None
        part.output = None
    return part


def build_schedule(
    parts: list[nn.Module],
    stages: list[int],
    *,
    num_stages: int,
    schedule: str,
    n_microbatches: int,
    pp_group,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> _PipelineSchedule:
    """Wraps this rank's parts as PipelineStages and builds the schedule (shapes inferred at runtime, `_stage_class`)."""
    from torch.distributed import pipelining  # lazy: ~1 s of imports that jobs.validate's arithmetic does not need

    pstages = [_stage_class()(p, s, num_stages, device, group=pp_group) for p, s in zip(parts, stages)]
    cls = getattr(pipelining, _SCHEDULES[schedule])
    if len(pstages) == 1 and schedule in ("gpipe", "1f1b"):
        return cls(pstages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(pstages, n_microbatches=n_microbatches, loss_fn=loss_fn)


@functools.cache
def _stage_class() -> type:
    """torch's PipelineStage, except that its shape inference leaves the stage's buffers as they were.

    torch 2.13 infers the activation shapes between stages at the first step (and again after each switch
    between `schedule.eval` and training) by one real forward and backward: of the first microbatch on the
    first stage, of uninitialised tensors on the others. A buffer a forward counts into (the MoE routers'
    `tokens_per_expert`, which steer the bias balancing) would count that extra pass too, so every buffer is
    saved before the inference and put back after it."""
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def _prepare_forward_infra(self, *args, **kwargs):
            with _buffers_kept(self.submod):
                return super()._prepare_forward_infra(*args, **kwargs)

        def _prepare_backward_infra(self, *args, **kwargs):
            with _buffers_kept(self.submod):
                return super()._prepare_backward_infra(*args, **kwargs)

    return _Stage


@contextlib.contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    import torch  # lazy: the login node's stage arithmetic does not need it

    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():  # only the changed ones: an unchanged buffer (RoPE's table) may be saved for backward
            for b, value in saved:
                if not torch.equal(b, value):
                    b.copy_(value)
