"""Pipeline parallelism: which layers each stage owns, the stage split, and the schedule."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import _PipelineSchedule

__all__ = ["layer_ranges", "stage_ids", "split_stage", "build_schedule"]

_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
}


def layer_ranges(n_layers: int, num_stages: int) -> list[range]:
    """Contiguous layer ranges per stage, as even as possible (earlier stages take the remainder:
    the last stage also carries the output head and loss)."""
    base, extra = divmod(n_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def stage_ids(pp_rank: int, pp: int, stages_per_rank: int, schedule: str) -> list[int]:
    """Stages held by `pp_rank`: loop order (r, r+pp, ...) or, for V schedules, (r, 2pp-1-r)."""
    if schedule == "zbv_zero_bubble":
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


def split_stage(model: nn.Module, stage: int, num_stages: int) -> nn.Module:
    """A copy of `model` that keeps only stage `stage`'s layers (FQNs unchanged); the embedding stays
    on the first stage, the final norm and output head on the last. Cheap on the meta device."""
    part = copy.deepcopy(model)
    keep = {str(i) for i in layer_ranges(len(model.layers), num_stages)[stage]}
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
    """Wraps this rank's parts as PipelineStages and builds the schedule (shapes inferred at runtime)."""
    pstages = [PipelineStage(p, s, num_stages, device, group=pp_group) for p, s in zip(parts, stages)]
    cls = _SCHEDULES[schedule]
    if len(pstages) == 1 and schedule in ("gpipe", "1f1b"):
        return cls(pstages[0], n_microbatches=n_microbatches, loss_fn=loss_fn)
    return cls(pstages, n_microbatches=n_microbatches, loss_fn=loss_fn)
