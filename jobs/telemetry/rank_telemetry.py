"""Builds a rank's StepTelemetry (phase timer + straggler checks) from the config and the rank's environment."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from jobs.config import JobConfig
from jobs.events import EventLog, read_events
from jobs.failure.quarantine import add_to_quarantine
from jobs.launch.env import DistEnv
from jobs.telemetry.kernels import KernelSampler
from jobs.telemetry.phases import PhaseTimer, slow_phase_from_env
from jobs.telemetry.stragglers import Detection, StepTelemetry, StragglerDetector, baseline_key, read_baseline

__all__ = ["build_step_telemetry", "baseline_path", "healthy_run"]


def baseline_path(cfg: JobConfig, *, mesh: str, device: str, mixed_precision: str, clock: str) -> Path:
    """`failure.straggler_baseline_root/<model>_<mesh>_<cluster>_<hash>.json`; `clock` (PhaseTimer.clock) is part of
    the hash: a baseline in CUDA event time is not one in kernel time."""
    t = cfg.train
    shape = {
        "model": dataclasses.asdict(cfg.model),
        "global_batch": t.global_batch,
        "micro_batch": t.micro_batch,
        "seq_len": t.seq_len,
        "device": device,
        "mixed_precision": mixed_precision,
        "activation_checkpointing": t.activation_checkpointing,
        "compile": t.compile,
        "pp_schedule": cfg.mesh.pp_schedule,
        "clock": clock,
    }
    key = baseline_key(model=cfg.model.name, mesh=mesh, cluster=cfg.cluster.name, shape=shape)
    return Path(cfg.failure.straggler_baseline_root) / key


def healthy_run(events_path: Path) -> bool:
    """No failure, straggler or slowdown anywhere in the run's ledger (every attempt)."""
    return not any(e.get("kind") in ("failure", "straggler", "slowdown") for e in read_events(events_path))


def build_step_telemetry(
    cfg: JobConfig,
    env: DistEnv,
    *,
    events: EventLog,
    pp: bool,
    mesh: str,
    device: torch.device,
    mixed_precision: str,
    pp_rank: int = 0,
) -> StepTelemetry:
    """Every rank builds one; with metrics.phase_timing=false it times nothing and never communicates.
    `pp_rank`: this rank's pipeline stage coordinate (the relative check compares within a stage)."""
    f, on, every = cfg.failure, cfg.metrics.phase_timing, cfg.metrics.kernel_every
    kernels = KernelSampler(every) if device.type == "cuda" and every > 0 else None
    timer = PhaseTimer(
        cfg.run.dir,
        rank=env.rank,
        attempt=env.attempt,
        pp=pp,
        device_type=device.type,
        enabled=on,
        slow=slow_phase_from_env(env.rank),
        kernels=kernels,
    )
    path = baseline_path(cfg, mesh=mesh, device=device.type, mixed_precision=mixed_precision, clock=timer.clock)
    where = [(env.hostname, pp_rank)] * env.world_size
    if on and env.world_size > 1:  # once per attempt: each rank's node (for the events) and pipeline stage
        dist.all_gather_object(where, (env.hostname, pp_rank))
    nodes = [n for n, _ in where]
    detector = StragglerDetector(
        timer.names,
        ratio=f.straggler_ratio,
        intervals=f.straggler_intervals,
        min_diff_s=f.straggler_min_diff_s,
        baseline=read_baseline(path) if on else None,
        groups=[s for _, s in where],
    )
    quarantine = None
    if f.exclude_stragglers:
        quarantine = functools.partial(_quarantine_nodes, run_dir=cfg.run.dir, attempt=env.attempt)
    return StepTelemetry(
        timer,
        detector,
        rank=env.rank,
        nodes=nodes,
        gather=functools.partial(_all_rows, rank=env.rank, world_size=env.world_size, device=device),
        emit=events.emit,
        baseline_path=path,
        on_straggler=quarantine,
        flush_every_s=cfg.metrics.flush_every_s,
    )


def _all_rows(vec: np.ndarray, *, rank: int, world_size: int, device: torch.device) -> np.ndarray:
    """One all-reduce of a [world x phases] float64 tensor holding this rank's row: every rank's row."""
    m = torch.zeros(world_size, len(vec), dtype=torch.float64, device=device)
    m[rank] = torch.as_tensor(vec, dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(m)
    return m.cpu().numpy()


def _quarantine_nodes(bad: list[str], d: Detection, *, run_dir: str, attempt: str) -> None:
    """Puts the straggling nodes on the run's quarantine list, the detection as their evidence."""
    add_to_quarantine(
        run_dir,
        bad,
        reason=f"straggler: {d.phase} {d.ratio:.2f}x its peers' median",
        incident=f"straggler event, attempt {attempt}",
        evidence={n: {"cls": "straggler", **dataclasses.asdict(d)} for n in bad},
    )
