"""The non-tensor state a checkpoint carries: the train state (step, tokens, loss tail) and every RNG."""

from __future__ import annotations

import copy
import random
import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainState", "capture_rng", "restore_rng"]


@dataclass
class TrainState:
    """Progress of the run; identical on every rank. `data` is the data cursor (jobs/data/cursor.py: the next
    data step, the samples consumed per source, the files' identity); empty in checkpoints older than it,
    whose cursor is the step (data step d reads from global sample d * train.global_batch)."""

    step: int = 0  # optimizer steps done
    tokens_seen: int = 0  # tokens consumed across all ranks
    loss_tail: list[float] = field(default_factory=list)  # the last `tail_len` logged losses
    tail_len: int = 100  # how many losses loss_tail keeps
    health: dict[str, Any] = field(default_factory=dict)  # training health (jobs.failure.spike): detector, rollbacks
    data: dict[str, Any] = field(
        default_factory=dict
    )  # the data cursor at `step` (BatchSource.cursor), set at each save

    def record(self, *, step: int, loss: float, tokens: int) -> None:
        """Marks `step` done, having consumed `tokens` more tokens with loss `loss`."""
        self.step = step
        self.tokens_seen += tokens
        self.loss_tail.append(float(loss))
        del self.loss_tail[: -self.tail_len]

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "loss_tail": list(self.loss_tail),
            "health": copy.deepcopy(self.health),
            "data": copy.deepcopy(self.data),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = int(sd["step"])
        self.tokens_seen = int(sd["tokens_seen"])
        self.loss_tail = [float(x) for x in sd["loss_tail"]][-self.tail_len :]
        self.health = copy.deepcopy(sd.get("health", {}))  # absent in checkpoints older than it
        self.data = copy.deepcopy(sd.get("data", {}))  # absent in checkpoints older than it: the cursor is the step


def capture_rng() -> dict[str, Any]:
    """Every RNG state of this process: Python, NumPy (when imported), torch CPU, the current GPU's
    CUDA generator (when CUDA is in use)."""
    import torch

    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    np = sys.modules.get("numpy")
    if np is not None:
        out["numpy"] = np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # This rank's GPU only: get_rng_state_all() would create a context on every visible GPU
        # (8 per rank when Slurm shows a task the whole node).
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def restore_rng(state: dict[str, Any]) -> list[str]:
    """Restores what `capture_rng` captured; returns the generators restored."""
    import torch

    done = []
    random.setstate(state["python"])
    done.append("python")
    torch.set_rng_state(state["torch"])
    done.append("torch")
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
        done.append("numpy")
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])  # onto the current device (jobs.device.rank_device set it)
        done.append("cuda")
    return done
