"""Held-out evaluation: every train.eval_every steps, the mean loss and perplexity over the same
train.eval_batches global batches of the held-out split, computed on the training mesh (forward only).

With pipeline parallelism the batches go through the schedule's forward-only path (`schedule.eval`,
the same microbatching and stage-to-stage sends as `step`, no backward; it works for gpipe, 1f1b and
interleaved_1f1b, while torch 2.13's ScheduleZBVZeroBubble.eval() raises, so validate refuses that pair); without it, each
microbatch goes through the model under `torch.no_grad()`. The loss is reduced like the training loss
(one world all-reduce; only last-stage ranks hold it), so every mesh reports the same number. The result
is one `{"record": "eval", ...}` line in metrics.jsonl and one progress line.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from jobs.config import JobConfig
from jobs.data import BatchSource, sources_of

__all__ = ["HeldoutEval", "eval_due", "RECORD"]

RECORD = "eval"  # the `record` field of an evaluation line in metrics.jsonl (step lines have none)


def eval_due(step: int, *, every: int, steps: int) -> bool:
    """Whether step `step` (1-based, just trained) ends with an evaluation: every `every` steps and at the last."""
    return every > 0 and (step % every == 0 or step == steps)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


class HeldoutEval:
    """This dp rank's held-out batches and the evaluation hook the trainer calls after each step."""

    def __init__(
        self,
        cfg: JobConfig,
        *,
        dp_rank: int,
        dp: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        seq_positions: torch.Tensor | None = None,
    ) -> None:
        t = cfg.train
        self.loss_fn = loss_fn
        self.every, self.n_batches, self.steps = t.eval_every, t.eval_batches, t.steps
        self.data = BatchSource(
            sources_of(cfg.data),
            seed=t.seed,
            global_batch=t.global_batch,
            seq_len=t.seq_len,
            dp_rank=dp_rank,
            dp=dp,
            split="heldout",
            seq_positions=seq_positions,
            sample_overlap=cfg.data.sample_overlap,
        )

    def due(self, step: int) -> bool:
        return eval_due(step, every=self.every, steps=self.steps)

    @torch.no_grad()
    def loss(self, trainer) -> float:
        """Mean held-out loss over the eval batches on `trainer`'s mesh (the same on every rank)."""
        total = torch.zeros((), dtype=torch.float64, device=trainer.device)
        for k in range(self.n_batches):
            x, y = (b.to(trainer.device) for b in self.data.batch(k))
            total += self._batch_loss(trainer, x, y)
        dist.all_reduce(total)
        return float(total) / (trainer.env.world_size // trainer.derived.dims.pp) / self.n_batches

    def _batch_loss(self, trainer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """This rank's share of one batch's mean loss (0 off the last pipeline stage)."""
        if trainer.schedule is not None:
            losses: list[torch.Tensor] | None = [] if trainer.has_last else None
            with trainer._loss_ctx():
                trainer.schedule.eval(
                    *((x,) if trainer.has_first else ()), target=y if trainer.has_last else None, losses=losses
                )
            return (
                torch.stack([_whole(l) for l in losses]).mean().double()
                if losses
                else torch.zeros((), dtype=torch.float64, device=trainer.device)
            )
        (model,) = trainer.parts
        n_micro = trainer.derived.microbatches
        total = torch.zeros((), dtype=torch.float64, device=trainer.device)
        for xm, ym in zip(x.chunk(n_micro), y.chunk(n_micro)):
            with trainer._loss_ctx():
                total += _whole(self.loss_fn(model(xm), ym)).double()
        return total / n_micro

    def run(self, trainer, step: int) -> float:
        """Evaluates, then rank 0 appends the eval record to metrics.jsonl and logs it; returns the loss."""
        t0 = time.perf_counter()
        loss = self.loss(trainer)
        if trainer.env.rank == 0:
            ppl = math.exp(min(loss, 700.0))  # exp overflows a float past ~709
            record = {
                "record": RECORD,
                "step": step,
                "eval_loss": loss,
                "eval_ppl": ppl,
                "eval_batches": self.n_batches,
                "eval_time_s": time.perf_counter() - t0,
                "restart": trainer.env.restart_count,
                "attempt": trainer.env.attempt,
                "time": time.time(),
            }
            with trainer.metrics_path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            trainer.log.info(
                "step %d/%d | eval_loss %.4f | eval_ppl %.2f | %d held-out batches | %.2f s",
                step,
                self.steps,
                loss,
                ppl,
                self.n_batches,
                record["eval_time_s"],
            )
        return loss

    def close(self) -> None:
        self.data.close()
