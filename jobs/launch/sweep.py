"""Sweeps under launcher=slurm: a whole `-m` sweep becomes one array job, infeasible points pruned first.

The Hydra launcher plugin (`hydra_plugins/meshjob_slurm_launcher`) gives each point its run directory
(`point_run_dirs`), composes the points with `hydra_point` and hands them to `launch_sweep`, which never
waits on the jobs. The local launcher's sweeps (`hydra_plugins/meshjob_local_launcher`) use the same
`point_run_dirs`.
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
from jobs.launch.prepare import prepare_inputs, prepare_run
from jobs.launch.rundir import check_run_dir, claim_run_dir, record_job
from jobs.launch.slurm import SlurmJob, login_checks, make_executor, require_slurm
from jobs.planner.gate import check

__all__ = [
    "SweepPoint",
    "launch_sweep",
    "format_sweep_table",
    "hydra_point",
    "run_dir_swept",
    "point_run_dirs",
    "why_infeasible",
]


@dataclass
class SweepPoint:
    """One point of a `-m` sweep: its overrides and either a config or the reason it was pruned."""

    idx: int
    overrides: list[str]
    cfg: JobConfig | None = None
    reason: str | None = None  # set when pruned
    job_id: str | None = None  # set once submitted
    run_dir: str | None = None


def why_infeasible(cfg: JobConfig) -> str | None:
    """Why a point cannot work (the login-node checks, then the planner's analytic checks: memory per
    rank, tp within the NVLink domain, checkpoint cost, goodput), or None."""
    if cfg.launcher.name != "slurm":
        return f"launcher={cfg.launcher.name}: a Slurm sweep holds only launcher=slurm points"
    try:
        login_checks(cfg)
        check_run_dir(cfg)  # another run, or a live job, in the point's run dir
    except ValueError as e:
        return str(e)
    failed = [c for c in check(cfg) if not c.ok]
    return "; ".join(f"{c.name}: {c.why}" for c in failed) or None


def _resources(cfg: JobConfig) -> tuple:
    """Points that share these can share one array job (an array has one sbatch header)."""
    ln = cfg.launcher
    return (
        ln.nodes,
        ln.spare_nodes,
        ln.tasks_per_node,
        ln.signal_delay_s,
        ln.array_parallelism,
        cfg.failure.max_requeues,
        json.dumps(dataclasses.asdict(cfg.cluster), sort_keys=True),
    )


def run_dir_swept(job_overrides: Sequence[Sequence[str]]) -> bool:
    """Whether the sweep's own overrides vary `run.dir` (then each point trains where it composes to).
    Decided from the override strings, never from resolved values: the default `runs/${now:...}` resolves
    anew for every point composed, and differs between points composed across a second boundary."""
    return len({_override_value(o, "run.dir") for o in job_overrides}) > 1


def _override_value(overrides: Sequence[str], key: str) -> str | None:
    for o in overrides:
        k, sep, v = o.partition("=")
        if sep and k.lstrip("+~") == key:
            return v
    return None


def point_run_dirs(job_overrides: Sequence[Sequence[str]], *, sweep_dir: Path, first_idx: int) -> list[Path | None]:
    """Each point's run directory: `sweep_dir/<idx>`, or None for all points when the overrides sweep
    `run.dir` itself. `sweep_dir` is `hydra.sweep.dir` (conf/train.yaml: `${run.dir}` unless given)."""
    if run_dir_swept(job_overrides):
        return [None] * len(job_overrides)
    return [sweep_dir / str(first_idx + i) for i in range(len(job_overrides))]


def launch_sweep(points: list[SweepPoint], *, sweep_dir: Path) -> list[SweepPoint]:
    """Prunes infeasible points, submits the rest as one array job (per distinct resource shape),
    writes `sweep_dir/sweep.jsonl`, prints the table, and returns at once (never waits on the jobs).

    Each point trains in the run dir `hydra_point` gave it; two points never share one, and a point whose
    run dir holds another run or a live job is pruned (`jobs.launch.rundir`)."""
    for p in points:
        if p.cfg is not None and p.reason is None:
            p.reason = why_infeasible(p.cfg)
    _prune_shared_run_dirs(points)
    if any(p.reason is None for p in points):
        require_slurm()
    for p in points:
        if p.reason is None:
            try:
                prepare_inputs(p.cfg)
                p.run_dir = str(claim_run_dir(p.cfg, launcher="slurm"))
            except ValueError as e:
                p.reason = str(e)
    live = [p for p in points if p.reason is None]
    groups: dict[tuple, list[SweepPoint]] = {}
    for p in live:
        groups.setdefault(_resources(p.cfg), []).append(p)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    arrays = [_submit_array(group, sweep_dir=sweep_dir) for group in groups.values()]
    with open(sweep_dir / "sweep.jsonl", "a") as f:
        for p in points:
            f.write(
                json.dumps(
                    {
                        "idx": p.idx,
                        "overrides": p.overrides,
                        "job_id": p.job_id,
                        "run_dir": p.run_dir,
                        "pruned": p.reason,
                    }
                )
                + "\n"
            )
    print(format_sweep_table(points, arrays=arrays, sweep_dir=sweep_dir), flush=True)
    if not live:
        raise ValueError(f"every one of the {len(points)} sweep points was pruned; nothing was submitted")
    return points


def _prune_shared_run_dirs(points: list[SweepPoint]) -> None:
    first: dict[str, int] = {}
    for p in points:
        if p.reason is None and p.cfg is not None:
            d = str(Path(p.cfg.run.dir).resolve())
            if d in first:
                p.reason = (
                    f"run.dir={d} is point {first[d]}'s run dir too: two points never share a run "
                    "directory; sweep run.dir over distinct values, or do not sweep it"
                )
            first.setdefault(d, p.idx)


def _submit_array(group: list[SweepPoint], *, sweep_dir: Path) -> str:
    """Prepares each point's run dir, submits the group as one array job, links each point's logs and
    records its array element in its run dir; returns the array's job id."""
    for p in group:
        prepare_run(p.cfg)
    folder = sweep_dir / "slurm"
    ex = make_executor(group[0].cfg, folder / "%j", job_name=f"meshjob-sweep-{sweep_dir.name}")
    try:
        with ex.batch():
            jobs = [ex.submit(SlurmJob(p.cfg)) for p in group]
    except submitit.core.utils.FailedJobError as e:
        raise RuntimeError(f"sbatch refused the array job: {str(e).strip()}") from None
    for p, job in zip(group, jobs):
        p.job_id = job.job_id
        record_job(p.run_dir, job.job_id)
        link = Path(p.run_dir) / "slurm"
        if not link.exists() and not link.is_symlink():
            link.symlink_to(folder / job.job_id, target_is_directory=True)
    return jobs[0].job_id.split("_")[0]


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
    head = (
        f"sweep: {len(points)} points, {len(points) - len(pruned)} submitted as array job"
        f"{'s' if len(arrays) > 1 else ''} {', '.join(arrays) or '-'}, {len(pruned)} pruned; "
        f"table in {sweep_dir / 'sweep.jsonl'}{lines_common}"
    )
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


def hydra_point(
    config: Any, overrides: Sequence[str], *, loader: Any, idx: int, run_dir: Path | None = None
) -> SweepPoint:
    """Composes one sweep point through Hydra's loader (a composition error prunes the point); `run_dir`
    (from `point_run_dirs`) replaces the run.dir it composes to."""
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
    if run_dir is not None:
        point.cfg.run.dir = str(run_dir)
    return point
