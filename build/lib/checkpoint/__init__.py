"""Checkpoints that never lose work: sharded DCP save/load, atomic commit, interval from MTBF, env fingerprint."""

from checkpoint.config import CheckpointConfig
from checkpoint.fingerprint import diff_fingerprint, env_fingerprint
from checkpoint.interval import (
    daly_interval,
    failures_in_ledger,
    interval_steps,
    job_mtbf_s,
    plan_interval,
    young_interval,
)
from checkpoint.state import TrainState

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "CheckpointSaveError",
    "TrainState",
    "daly_interval",
    "young_interval",
    "plan_interval",
    "job_mtbf_s",
    "failures_in_ledger",
    "interval_steps",
    "env_fingerprint",
    "diff_fingerprint",
]


def __getattr__(name: str):
    # The manager imports torch.distributed.checkpoint; config-only users (Hydra schema, planner) skip that.
    if name in ("CheckpointManager", "CheckpointSaveError"):
        from checkpoint import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'checkpoint' has no attribute {name!r}")
