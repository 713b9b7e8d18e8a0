"""Silent data corruption: re-run a suspicious step from the same state and name the rank whose values differ.

Megatron's rerun state machine asks the same question: a loss spike or a NaN is either in the data
(it comes back when the step is computed again) or a hardware fault (it does not). Here the trainer
asks `TrainingHealth.suspicious` right after the step's one all-reduce and *before* the optimizer
step, so the parameters and optimizer state are still the pre-step state and the step's batch is in
hand: nothing is snapshotted on the hot path, and a healthy step pays one comparison of two floats.

On a suspicious step (`failure.sdc_rerun`), every rank takes a fingerprint of its own part of the
first run (its forward value: its local loss, plus under pipeline parallelism the sum of squares of the
activations its stages sent on, since off the last stage the loss is 0; and the sum of squares of its local
gradient shards, float64), the gradients
are zeroed, forward and backward run again on the same batch, and the re-run's fingerprint is taken.
One all-gather of the (world, 2, 2) table makes every rank decide alike (`verdict`):
- no rank differs (relative difference <= `failure.sdc_rtol`): data. The step goes on with the
  re-run's gradients (equal to the first's) to the spike check, which rolls back and skips data.
- some ranks differ: `sdc`. Named are the ranks whose forward value differs (the forward is where a
  fault shows first), else those whose gradient differs; under pipeline parallelism, in each pipeline,
  the first stage whose forward value differs (a later stage only received the fault), else the last
  whose gradient does (the backward runs from the last stage). When every rank differs the fault cannot
  be placed and nobody is named. With several stages per rank (interleaved schedules) a rank is placed by
  its first stage, so a fault can be pinned on a rank holding an earlier stage that received it.
  The save in flight is committed (it was staged at an earlier step) and nothing more is saved: the state
  before this step sits in the memory of a GPU just shown faulty. Then `SilentCorruption` carries the
  incident to the failure path, which requeues without the suspects' nodes; the resumed run starts from
  the last committed checkpoint, bitwise as if the fault had not happened.

Replica hashes (`failure.replica_hash_every`, mesh.dp_replicate > 1): every that many steps, before
the optimizer step, each rank hashes the bits of its local parameter and gradient shards (an int64
sum of the raw bits: any single flipped bit changes it); the ranks that hold the same shards in
different replicas must agree. Gradients that disagree are this step's fault: the re-run above names
the rank. Parameters that disagree diverged at an earlier step: the replica outside the majority is
named (with two replicas there is no majority: the incident names nobody, and the run resumes from
its last checkpoint).

The test seam (tests only, never in a real run): `MESHJOB_TEST_FLIP_GRAD="<rank>:<step>[:bit<n>][:once]"`,
read once per process, flips one bit (default the top exponent bit; `bit23`, float32's lowest exponent
bit, doubles or halves the value) of the largest element of rank `<rank>`'s first local gradient after
the backward of step `<step>` (numbered as metrics.jsonl numbers it), once per process (the re-run
computes it clean); `:once` only in the run's first attempt (restart count 0).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from jobs.config import FailureConfig
from jobs.failure.incident import Incident
from jobs.failure.spike import check_config  # the SDC keys' checks live there: jobs.validate runs them without torch

__all__ = [
    "FLIP_VAR",
    "SdcGuard",
    "SilentCorruption",
    "check_config",
    "parse_flip",
    "verdict",
    "replica_odd_ones",
    "replica_groups",
    "pipeline_groups",
    "differs",
    "bits_sum",
]

FLIP_VAR = "MESHJOB_TEST_FLIP_GRAD"


class SilentCorruption(RuntimeError):
    """A step's values differed when it was computed again: hardware. Carries the `sdc` incident."""

    def __init__(self, incident: Incident) -> None:
        super().__init__(incident.summary)
        self.incident = incident


@dataclass(frozen=True, slots=True)
class Flip:
    rank: int
    step: int  # 1-based, as metrics.jsonl numbers steps
    once: bool  # only in the run's first attempt
    bit: int | None = None  # the bit of the element to flip; None: the top exponent bit


def parse_flip(text: str) -> Flip | None:
    """`MESHJOB_TEST_FLIP_GRAD` -> Flip: "1:13", "1:13:once", "1:13:bit23:once"; None when unset."""
    if not text.strip():
        return None
    rank, step, *opts = [*text.strip().split(":"), ""][: max(2, text.count(":") + 1)]
    bits = [o for o in opts if o.startswith("bit") and o[3:].isdigit()]
    bad = not (rank.isdigit() and step.isdigit()) or len(bits) > 1 or opts.count("once") > 1
    if bad or any(o != "once" and o not in bits for o in opts):
        raise ValueError(f"{FLIP_VAR}={text!r}: expected <rank>:<step>[:bit<n>][:once]")
    return Flip(rank=int(rank), step=int(step), once="once" in opts, bit=int(bits[0][3:]) if bits else None)


def differs(a: float, b: float, *, rtol: float) -> bool:
    """Whether two runs' values of one quantity differ: NaN equals NaN, inf equals the same inf."""
    if a == b or (a != a and b != b):
        return False
    if not (abs(a) < float("inf") and abs(b) < float("inf")):
        return True
    return abs(a - b) > rtol * max(abs(a), abs(b))


def verdict(
    first: list[list[float]],
    again: list[list[float]],
    *,
    rtol: float,
    pipelines: list[list[int]] | None = None,
) -> tuple[list[int], list[int], str]:
    """From every rank's [forward value, local grad sum of squares] of the two runs: (the ranks whose values
    differ, the ranks named as suspects, how they were named). No rank differs: data ([], [], "same").

    The forward value is the local loss, and under pipeline parallelism, off the last stage (where the loss is 0),
    what the rank sends to the next stage. `pipelines`: each pipeline's ranks in stage order; a fault travels with
    the activations (forward: to later stages) and the gradients (backward: to earlier ones), so in each pipeline
    the first rank whose forward value differs is named, else the last whose gradient does."""
    fwd = [r for r, (a, b) in enumerate(zip(first, again)) if differs(a[0], b[0], rtol=rtol)]
    grad = [r for r, (a, b) in enumerate(zip(first, again)) if differs(a[1], b[1], rtol=rtol)]
    differ = sorted(set(fwd) | set(grad))
    if not differ:
        return [], [], "same"
    if pipelines:
        named = sorted(next(r for r in p if r in fwd) for p in pipelines if set(p) & set(fwd))
        by = "forward (what its stage sends, or its loss)"
        if not named:
            named, by = (
                sorted(next(r for r in reversed(p) if r in grad) for p in pipelines if set(p) & set(grad)),
                ("gradient"),
            )
    else:
        named, by = (fwd, "loss") if fwd else (grad, "gradient")
    if len(named) == len(first) and len(first) > 1:
        return differ, [], "every rank differs: the fault cannot be placed"
    return differ, named, by


def replica_odd_ones(values: list[Any], groups: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Per group of ranks that must hold equal values: (the groups that disagree, the ranks outside their
    group's strict majority). A tie (two replicas) names nobody in that group."""
    bad, odd = [], []
    for g in groups:
        count = Counter(values[r] for r in g)
        if len(count) == 1:
            continue
        bad.append(list(g))
        top, n = count.most_common(1)[0]
        if 2 * n > len(g):
            odd += [r for r in g if values[r] != top]
    return bad, sorted(odd)


def pipeline_groups(mesh: Any) -> list[list[int]]:
    """Each pipeline's ranks in stage order (the ranks along the pp axis), [] without pipeline parallelism."""
    names = list(mesh.mesh_dim_names)
    if "pp" not in names or mesh["pp"].size() < 2:
        return []
    ranks = mesh.mesh.movedim(names.index("pp"), -1)
    return ranks.reshape(-1, ranks.shape[-1]).tolist()


def replica_groups(mesh: Any) -> list[list[int]]:
    """The groups of ranks that hold the same shards in different dp replicas ([] without replicas)."""
    names = list(mesh.mesh_dim_names)
    if "dp_replicate" not in names or mesh["dp_replicate"].size() < 2:
        return []
    ranks = mesh.mesh.movedim(names.index("dp_replicate"), 0)
    return ranks.reshape(ranks.shape[0], -1).T.tolist()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _grads(parts: list[torch.nn.Module]) -> list[torch.Tensor]:
    return [_local(p.grad) for part in parts for p in part.parameters() if p.grad is not None]


def bits_sum(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A sum of the tensors' raw bits, wrapping in their own width (a flipped bit k changes it by 2**k, never
    by a multiple of the width), as int64. As fast as a float sum: widening to int64 first was 26x slower."""
    views = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
    total = torch.zeros((), dtype=torch.int64)
    for t in tensors:
        bits = t.detach().contiguous().view(views[t.element_size()])
        total += bits.sum(dtype=bits.dtype).to(device="cpu", dtype=torch.int64)
    return total


@torch.no_grad()
def _fingerprint(forward_value: torch.Tensor, parts: list[torch.nn.Module]) -> list[float]:
    sq = sum((g.double().pow(2).sum() for g in _grads(parts)), torch.zeros((), dtype=torch.float64))
    return [float(forward_value.detach().double().cpu()), float(sq.cpu())]


class SdcGuard:
    """The trainer's side: the test seam, and the re-run of a suspicious step. One per rank, all deciding alike."""

    def __init__(
        self,
        cfg: FailureConfig,
        *,
        rank: int,
        world_size: int,
        hostname: str,
        attempt: str,
        first_attempt: bool,
        emit: Callable[..., Any],
        groups: list[list[int]],
        pipelines: list[list[int]] | None = None,
    ) -> None:
        check_config(cfg)
        self.cfg, self.rank, self.world_size, self.hostname, self.attempt = cfg, rank, world_size, hostname, attempt
        self._emit_fn, self.groups, self.pipelines = emit, groups, pipelines or []
        self._bad: list[list[int]] = []  # the last replica check's groups whose gradients disagree
        self._odd: list[int] = []  # and the ranks outside their majority
        flip = parse_flip(os.environ.get(FLIP_VAR, ""))
        self._flip = flip if flip is not None and flip.rank == rank and (first_attempt or not flip.once) else None
        if cfg.replica_hash_every > 0 and not groups and rank == 0:
            emit(
                "sdc_config",
                note=f"failure.replica_hash_every({cfg.replica_hash_every}) needs mesh.dp_replicate > 1: off",
            )

    @torch.no_grad()
    def inject(self, step: int, parts: list[torch.nn.Module]) -> None:
        """The test seam: flips one bit of this rank's gradient at the chosen step (first computation only)."""
        flip = self._flip
        if flip is None or step + 1 != flip.step:
            return
        self._flip = None
        g = next(g for g in _grads(parts) if g.numel() > 0)
        flat = g.view(-1)
        i = int(flat.abs().argmax())
        bits = flat[i : i + 1].view({4: torch.int32, 2: torch.int16}[g.element_size()])
        bit = 8 * g.element_size() - 2 if flip.bit is None else flip.bit  # default: the top exponent bit
        bits ^= 1 << bit  # (float32 bit 30: x * 2**128 for |x| < 2; bit 23, the lowest: x * 2 or x / 2)

    def check(
        self,
        *,
        step: int,
        suspicious: bool,
        forward_value: torch.Tensor,
        parts: list[torch.nn.Module],
        recompute: Callable[[], torch.Tensor],
        wait_for_saves: Callable[[], None],
    ) -> None:
        """Before step `step`'s optimizer step: re-runs it when suspicious (or when the replicas' gradients
        disagree); raises SilentCorruption when the values differ, after `wait_for_saves()` (the save in flight
        committed; the pre-step state of a GPU just shown faulty is not saved)."""
        trigger, odd = ("spike" if suspicious and self.cfg.sdc_rerun else None), []
        every = self.cfg.replica_hash_every
        if (
            self.groups
            and every > 0
            and (step + 1) % every == 0
            and self._replicas_disagree(step, parts, wait_for_saves)
        ):
            trigger, odd = "replica_hash", self._odd
        if trigger is None:
            return
        first = _fingerprint(forward_value, parts)
        again = _fingerprint(recompute(), parts)
        table = self._gather(torch.tensor([first, again], dtype=torch.float64)).tolist()
        differ, named, by = verdict(
            [t[0] for t in table], [t[1] for t in table], rtol=self.cfg.sdc_rtol, pipelines=self.pipelines
        )
        if not differ and trigger == "replica_hash":  # the replicas disagree, reproducibly: the majority decides
            differ, named, by = odd or [r for g in self._bad for r in g], odd, "gradient hash outside the majority"
        self._emit(
            "sdc_check",
            step=step + 1,
            trigger=trigger,
            verdict="sdc" if differ else "data",
            differ=differ,
            suspects=named,
            named_by=by,
            values={r: t for r, t in enumerate(table)},
        )
        if differ:
            wait_for_saves()
            raise SilentCorruption(
                self._incident(
                    step,
                    named,
                    by=by,
                    trigger=trigger,
                    evidence={
                        "first": {r: t[0] for r, t in enumerate(table)},
                        "rerun": {r: t[1] for r, t in enumerate(table)},
                        "differ": differ,
                        "rtol": self.cfg.sdc_rtol,
                    },
                )
            )

    def _replicas_disagree(self, step: int, parts: list[torch.nn.Module], wait_for_saves: Callable[[], None]) -> bool:
        """Compares the replicas' parameter and gradient hashes: True when the gradients disagree (re-run
        the step); raises SilentCorruption when only the parameters do (they diverged at an earlier step)."""
        params = [_local(p) for part in parts for p in part.parameters()]
        table = self._gather(torch.stack([bits_sum(params), bits_sum(_grads(parts))])).tolist()
        bad_p, odd_p = replica_odd_ones([t[0] for t in table], self.groups)
        self._bad, self._odd = replica_odd_ones([t[1] for t in table], self.groups)
        if not (bad_p or self._bad):
            return False
        self._emit(
            "replica_hash",
            step=step + 1,
            params_disagree=bad_p,
            grads_disagree=self._bad,
            hashes={r: t for r, t in enumerate(table)},
        )
        if self._bad:
            return True
        by = "parameter hash outside the replicas' majority" if odd_p else "two replicas disagree: no majority"
        wait_for_saves()
        raise SilentCorruption(
            self._incident(
                step,
                odd_p,
                by=by,
                trigger="replica_hash",
                evidence={"param_hashes": {r: t[0] for r, t in enumerate(table)}, "disagree": bad_p},
            )
        )

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's `t`, stacked by rank (one all-gather on the default group)."""
        if not dist.is_initialized() or self.world_size == 1:
            return t.unsqueeze(0)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t)
        return torch.stack(out)

    def _incident(self, step: int, named: list[int], *, by: str, trigger: str, evidence: dict) -> Incident:
        hosts = [self.hostname] * self.world_size
        if dist.is_initialized() and self.world_size > 1:
            hosts = [None] * self.world_size
            dist.all_gather_object(hosts, self.hostname)
        suspects = [{"rank": r, "node": hosts[r], "host": hosts[r], "state": "sdc", "step": step + 1} for r in named]
        where = ", ".join(f"rank {r} (node {hosts[r]})" for r in named) or "no rank named"
        summary = (
            f"silent data corruption at step {step + 1} ({trigger}): values differ when the step is computed "
            f"again from the same state; {where} ({by})"
        )
        return Incident(
            "sdc",
            self.attempt,
            self.rank,
            summary,
            suspects,
            {"step": step + 1, "trigger": trigger, "named_by": by, **evidence},
        )

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.rank == 0:
            self._emit_fn(kind, **fields)
