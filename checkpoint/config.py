"""The `checkpoint` config group (plain dataclass, no Hydra)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    enabled: bool = True  # write checkpoints under run.dir/checkpoints
    interval: str = "steps"  # "steps" = every `every_steps`; "auto" = Young/Daly from MTBF and measured save cost
    every_steps: int = 0  # fixed interval in steps when interval=steps; 0 = only at the last step
    async_mode: str = "thread"  # none | thread | process: how a save overlaps training
    keep: int = 2  # committed checkpoints kept (>= 2); the newest valid one is never deleted
    writer_threads: int = 1  # file-writer threads per rank
    lustre_stripe_count: int = 0  # 0 = leave striping alone; > 0 runs `lfs setstripe -c N` when `lfs` exists
    on_env_drift: str = "warn"  # warn | refuse | allow, when the environment fingerprint differs on resume
