"""The `checkpoint` config group (plain dataclass, no Hydra), validated on construction."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from checkpoint.errors import CheckpointConfigError


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
    verify: str = "checksum"  # checksum | size: how load validates shards against the manifest
    restart_s: float = 120.0  # assumed failure-to-training-again time R, for the interval's goodput estimate
    memory_every_steps: int = (
        0  # RAM tier: every N steps each rank's shard to node-local memory; 0 = off (memory_interval=steps)
    )
    memory_interval: str = "steps"  # RAM tier: "steps" = every `memory_every_steps`; "auto" = on, Young/Daly from its save cost and the process failures (checkpoint/tiers.py)
    memory_dir: str = "/dev/shm"  # RAM tier: node-local (tmpfs) folder; the run's copies go to meshjob-<run id>/ in it
    memory_replicas: int | None = (
        None  # RAM tier: partner copies of each rank's shard on another node (0 | 1); null = 1 when > 1 node
    )
    memory_load: bool = True  # RAM tier: false = a restart reads the filesystem tier only (a manual rollback)
    scavenge_timeout_s: float = 120.0  # RAM tier under Slurm: bound of the flush + removal at an allocation's edges

    def __post_init__(self) -> None:
        if self.interval not in ("steps", "auto"):
            raise ValueError(f"checkpoint.interval={self.interval!r}: use steps or auto")
        if self.every_steps < 0:
            raise ValueError(f"checkpoint.every_steps({self.every_steps}) must be >= 0 (0 = only the last step)")
        if self.async_mode not in ("none", "thread", "process"):
            raise ValueError(f"checkpoint.async_mode={self.async_mode!r}: use none, thread or process")
        if self.keep < 2:
            raise ValueError(f"checkpoint.keep({self.keep}) must be >= 2 so a damaged newest one has a fallback")
        if self.writer_threads < 1:
            raise ValueError(f"checkpoint.writer_threads({self.writer_threads}) must be >= 1")
        if self.lustre_stripe_count < 0:
            raise ValueError(f"checkpoint.lustre_stripe_count({self.lustre_stripe_count}) must be >= 0")
        if self.on_env_drift not in ("warn", "refuse", "allow"):
            raise ValueError(f"checkpoint.on_env_drift={self.on_env_drift!r}: use warn, refuse or allow")
        if self.memory_every_steps < 0:
            raise ValueError(f"checkpoint.memory_every_steps({self.memory_every_steps}) must be >= 0 (0 = no RAM tier)")
        if self.memory_interval not in ("steps", "auto"):
            raise ValueError(f"checkpoint.memory_interval={self.memory_interval!r}: use steps or auto")
        if self.memory_on and not self.memory_dir:
            raise ValueError("checkpoint.memory_dir is empty: name a node-local memory folder, e.g. /dev/shm")
        if self.memory_replicas is not None and self.memory_replicas not in (0, 1):
            raise ValueError(
                f"checkpoint.memory_replicas({self.memory_replicas}) must be 0, 1 or null (1 when the job "
                "has more than one node): one partner copy, on the next node, is what is built"
            )
        if self.scavenge_timeout_s <= 0:
            raise ValueError(
                f"checkpoint.scavenge_timeout_s({self.scavenge_timeout_s}) must be > 0: the bound of the RAM tier's "
                "flush and removal at the end of an allocation (e.g. checkpoint.scavenge_timeout_s=120)"
            )
        if self.verify not in ("checksum", "size"):
            raise ValueError(f"checkpoint.verify={self.verify!r}: use checksum or size")

    @property
    def memory_on(self) -> bool:
        """Whether the RAM tier saves at all: memory_interval=auto, or a fixed memory_every_steps > 0."""
        return self.memory_interval == "auto" or self.memory_every_steps > 0


def memory_root(memory_dir: str, run_id: str) -> Path:
    """One run's folder of the RAM tier: `checkpoint.memory_dir/meshjob-<run id>`, holding one folder per node
    (named by CheckpointManager's `node`); the run's identity in the path, so no run ever lists another's copies."""
    return Path(memory_dir) / f"meshjob-{run_id}"


_FOLDER = re.compile(r"^(?:rank|partner_of_rank)_(\d+)$")


def folder_rank(name: str) -> int | None:
    """The rank whose state a node's folder of the RAM tier holds: `rank_<q>` (q's own saves) or
    `partner_of_rank_<q>` (the copies of q's saves held there); None for any other name."""
    m = _FOLDER.match(name)
    return int(m.group(1)) if m else None


def replicas_for(memory_replicas: int | None, *, nodes: int, memory_on: bool) -> int:
    """The partner copies this job keeps of each rank's RAM shard: checkpoint.memory_replicas, or (null) 1 when
    the RAM tier is on and the job has more than one node. Raises CheckpointConfigError (a ValueError) naming the
    override when a partner copy is asked for on one node (there is no other node to hold it)."""
    if not memory_on:
        return 0
    if memory_replicas is None:
        return 1 if nodes > 1 else 0
    if memory_replicas > 0 and nodes < 2:
        raise CheckpointConfigError(
            f"checkpoint.memory_replicas={memory_replicas} copies each rank's RAM shard to a rank on another node, "
            f"but the job has {nodes} node: set checkpoint.memory_replicas=0 (or null) or launcher.nodes >= 2"
        )
    return memory_replicas
