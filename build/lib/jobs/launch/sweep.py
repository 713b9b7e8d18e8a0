"""Sweeps under launcher=slurm: a whole `-m` sweep becomes one array job, infeasible points pruned first.

The Hydra launcher plugin (`hydra_plugins/meshjob_slurm_launcher`) composes the points with
`hydra_point` and hands them to `launch_sweep`, which never waits on the jobs.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from jobs.config import JobConfig
from jobs.launch.prepare import prepare_run
from jobs.launch.slurm import SlurmJob, login_checks, make_executor, require_slurm
from jobs.planner.gate import check

__all__ = ["SweepPoint", "launch_sweep", "format_sweep_table", "hydra_point"]


@dataclass
class SweepPoint:
    """One point of a `-m` sweep: its overrides and either a config or the reason it was pruned."""

    idx: int
    overrides: list[str]
    cfg: JobConfig | None = None
    reason: str | None = None  # set when pruned
    job_id: str | None = None  # set once submitted
    run_dir: str | None = None


def _feasibility(cfg: JobConfig) -> str | None:
    """Why a point cannot work (the login-node checks, then the planner's analytic checks: memory per
    rank, tp within the NVLink domain, checkpoint cost, goodput), or None."""
    if cfg.launcher.name != "slurm":
        return f"launcher={cfg.launcher.name}: a Slurm sweep holds only launcher=slurm points"
    try:
        login_checks(cfg)
    except ValueError as e:
        return str(e)
    failed = [c for c in check(cfg) if not c.ok]
    return "; ".join(f"{c.name}: {c.why}" for c in failed) or None


def _resources(cfg: JobConfig) -> tuple:
    """Points that share these can share one array job (an array has one sbatch header)."""
    ln = cfg.launcher
    return (ln.nodes, ln.tasks_per_node, ln.signal_delay_s, ln.array_parallelism, cfg.failure.max_requeues,
            json.dumps(dataclasses.asdict(cfg.cluster), sort_keys=True))


def launch_sweep(points: list[SweepPoint], *, sweep_dir: Path) -> list[SweepPoint]:
    """Prunes infeasible points, submits the rest as one array job (per distinct resource shape),
    writes `sweep_dir/sweep.jsonl`, prints the table, and returns at once (never waits on the jobs).

    Each point runs in `sweep_dir/<idx>` unless the sweep itself varies `run.dir`."""
    composed = [p for p in points if p.cfg is not None and p.reason is None]
    swept_run_dir = len({p.cfg.run.dir for p in composed}) > 1
    for p in composed:
        if not swept_run_dir:
            p.cfg.run.dir = str(sweep_dir / str(p.idx))
        p.reason = _feasibility(p.cfg)
    live = [p for p in points if p.reason is None]
    if live:
        require_slurm()
    groups: dict[tuple, list[SweepPoint]] = {}
    for p in live:
        groups.setdefault(_resources(p.cfg), []).append(p)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    arrays: list[str] = []
    for group in groups.values():
        for p in group:
            p.run_dir = str(prepare_run(p.cfg))
        first = group[0].cfg
        folder = sweep_dir / "slurm"
        ex = make_executor(first, folder / "%j", job_name=f"meshjob-sweep-{sweep_dir.name}")
        try:
            with ex.batch():
                jobs = [ex.submit(SlurmJob(p.cfg)) for p in group]
        except submitit.core.utils.FailedJobError as e:
            raise RuntimeError(f"sbatch refused the array job: {str(e).strip()}") from None
        for p, job in zip(group, jobs):
            p.job_id = job.job_id
            link = Path(p.run_dir) / "slurm"
            if not link.exists() and not link.is_symlink():
                link.symlink_to(folder / job.job_id, target_is_directory=True)
        arrays.append(jobs[0].job_id.split("_")[0])
    with open(sweep_dir / "sweep.jsonl", "a") as f:
        for p in points:
            f.write(json.dumps({"idx": p.idx, "overrides": p.overrides, "job_id": p.job_id,
                                "run_dir": p.run_dir, "pruned": p.reason}) + "\n")
    print(format_sweep_table(points, arrays=arrays, sweep_dir=sweep_dir), flush=True)
    if not live:
        raise ValueError(f"every one of the {len(points)} sweep points was pruned; nothing was submitted")
    return points


def format_sweep_table(points: list[SweepPoint], *, arrays: list[str], sweep_dir: Path) -> str:
    """The sweep summary: submitted points with job ids and run dirs, pruned points with why."""
    pruned = [p for p in points if p.reason is not None]
    common = set.intersection(*(set(p.overrides) for p in points)) if len(points) > 1 else set()

    def swept(p: SweepPoint) -> str:  # only what differs between points
        return " ".join(o for o in p.overrides if o not in common) or "(no overrides)"

    if common:
        lines_common = f"\ncommon overrides: {' '.join(o for o in points[0].overrides if o in common)}"
    else:
        lines_common = ""
    head = (f"sweep: {len(points)} points, {len(points) - len(pruned)} submitted as array job"
            f"{'s' if len(arrays) > 1 else ''} {', '.join(arrays) or '-'}, {len(pruned)} pruned; "
            f"table in {sweep_dir / 'sweep.jsonl'}{lines_common}")
    lines = [head]
    submitted = [p for p in points if p.reason is None]
    if submitted:
        lines.append(f"  {'#':>3}  {'job':<10} {'point':<28} run dir")
        lines += [f"  {p.idx:>3}  {p.job_id:<10} {swept(p):<28} {p.run_dir}" for p in submitted]
    if pruned:
        lines.append("pruned (not submitted):")
        lines.append(f"  {'#':>3}  {'point':<28} why")
        lines += [f"  {p.idx:>3}  {swept(p):<28} {p.reason}" for p in pruned]
    return "\n".join(lines)


def hydra_point(config: Any, overrides: Sequence[str], *, loader: Any, idx: int) -> SweepPoint:
    """Composes one sweep point through Hydra's loader; a composition error prunes the point."""
    from omegaconf import open_dict

    from jobs.config import to_job_config

    point = SweepPoint(idx=idx, overrides=list(overrides))
    try:
        dcfg = loader.load_sweep_config(config, list(overrides))
        dcfg = copy.deepcopy(dcfg)
        with open_dict(dcfg):
            del dcfg["hydra"]
        point.cfg = to_job_config(dcfg)
    except Exception as e:  # noqa: BLE001 - Hydra/OmegaConf raise many types; the point is reported
        point.reason = f"does not compose: {type(e).__name__}: {e}".splitlines()[0]
    return point
