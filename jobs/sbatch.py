"""`python -m jobs.sbatch [sbatch.style=srun|torchrun] [sbatch.out=FILE] [overrides]`: a standalone sbatch script for
the composed config.

`render()` is the one function that writes a script: its keyword parameters are the whitelist of what
a script may contain, and every value is shell-quoted. `render_for(cfg)` maps a composed config onto
those parameters. The layout matches what `launcher=slurm` submits through submitit (one Slurm task
per rank under srun, USR2 before the time limit, requeue, logs appended); `sbatch.style=torchrun` runs one
torchrun agent per node instead. Templates and their README for sysadmins: sbatch/.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from importlib.resources import files
from pathlib import Path

from jobs import exitcodes
from jobs.commands import help_text, own_keys
from jobs.config import JobConfig

__all__ = ["render", "render_for", "main", "STYLES"]

STYLES = ("srun", "torchrun")
TEMPLATE_DIR = Path(str(files("jobs._sbatch")))  # sbatch/ installs as the package jobs._sbatch (pyproject)


def _q(value: object) -> str:
    return shlex.quote(str(value))


def _hhmm(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def render(
    *,
    style: str = "srun",
    job_name: str,
    nodes: int,
    tasks_per_node: int,
    cpus_per_task: int,
    time_min: int,
    signal_delay_s: int,
    run_dir: str,
    workdir: str,
    python: str,
    overrides: Sequence[str] = (),
    gpus_per_node: int = 0,
    partition: str | None = None,
    account: str | None = None,
    qos: str | None = None,
    constraint: str | None = None,
    exclude: str | None = None,
    mem_per_node_gb: int | None = None,
    setup: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    container_image: str | None = None,
    container_mounts: str | None = None,
    description: str = "",
    restarts_in_allocation: int = 3,
    spare_nodes: int = 0,
) -> str:
    """The sbatch script text; `setup` lines are shell by definition and go in verbatim, every other value quoted."""
    _check_style(style, spare_nodes=spare_nodes)
    template = (TEMPLATE_DIR / f"{style}.sbatch.in").read_text()
    header = _resource_lines(
        style=style,
        job_name=job_name,
        nodes=nodes,
        tasks_per_node=tasks_per_node,
        cpus_per_task=cpus_per_task,
        gpus_per_node=gpus_per_node,
        mem_per_node_gb=mem_per_node_gb,
        time_min=time_min,
        spare_nodes=spare_nodes,
    )
    header += _placement_lines(partition=partition, account=account, qos=qos, constraint=constraint, exclude=exclude)
    header += _requeue_lines(run_dir=run_dir, signal_delay_s=signal_delay_s)
    env_lines = [f"export {k}={_q(v)}" for k, v in (env or {}).items()] or ["# (none: cluster.env is empty)"]
    args = " ".join(_q(o) for o in overrides)
    return template.format(
        description=description or "meshjob training job",
        sbatch_header="\n".join(header),
        setup="\n".join(setup) if setup else "# (none: cluster.setup is empty)",
        env="\n".join(env_lines),
        run_dir=_q(run_dir),
        workdir=_q(workdir),
        python=_q(python),
        tasks_per_node=tasks_per_node,
        restarts_in_allocation=restarts_in_allocation,
        container=_container_options(container_image, container_mounts),
        overrides=(" " + args) if args else "",
    )


def _check_style(style: str, *, spare_nodes: int) -> None:
    if style not in STYLES:
        raise ValueError(f"sbatch.style={style}: not one of {', '.join(STYLES)}")
    if spare_nodes and style != "srun":
        raise ValueError(
            f"launcher.spare_nodes({spare_nodes}) with sbatch.style={style}: only the srun style's supervisor "
            "swaps a spare in for a failed node; use sbatch.style=srun, or set launcher.spare_nodes=0"
        )


def _container_options(image: str | None, mounts: str | None) -> str:
    """srun's pyxis options for the container (each followed by a space), or "" without an image or mounts."""
    options = []
    if image:
        options.append(f"--container-image={_q(image)}")
    if mounts:
        options.append(f"--container-mounts={_q(mounts)}")
    return (" ".join(options) + " ") if options else ""


def _line(directive: str, comment: str = "") -> str:
    """One header line, its comment (if any) aligned in a column after it."""
    return f"{directive:<34} # {comment}" if comment else directive


def _resource_lines(
    *,
    style: str,
    job_name: str,
    nodes: int,
    tasks_per_node: int,
    cpus_per_task: int,
    gpus_per_node: int,
    mem_per_node_gb: int | None,
    time_min: int,
    spare_nodes: int = 0,
) -> list[str]:
    """#SBATCH lines for what the job asks for: srun runs one task per rank, torchrun one agent per
    node holding all of the node's cores; with spare nodes, those too, and --no-kill."""
    srun_style = style == "srun"
    per_task_cpus = cpus_per_task if srun_style else cpus_per_task * tasks_per_node
    header = [
        _line(f"#SBATCH --job-name={_q(job_name)}"),
        _line(f"#SBATCH --nodes={nodes}", f"EDIT: nodes; world size = nodes * {tasks_per_node} ranks per node")
        if not spare_nodes
        else _line(
            f"#SBATCH --nodes={nodes + spare_nodes}",
            f"EDIT: launcher.nodes({nodes}) run the ranks + launcher.spare_nodes({spare_nodes}) idle",
        ),
        *(
            [_line("#SBATCH --no-kill", "a failed node leaves the job; a spare takes its place (srun --nodelist)")]
            if spare_nodes
            else []
        ),
        _line(
            f"#SBATCH --ntasks-per-node={tasks_per_node if srun_style else 1}",
            "one Slurm task per GPU/rank (launcher.tasks_per_node)"
            if srun_style
            else "one torchrun agent per node; it starts the ranks",
        ),
    ]
    if gpus_per_node:
        header.append(_line(f"#SBATCH --gpus-per-node={gpus_per_node}", "cluster.gpus_per_node"))
    header.append(
        _line(
            f"#SBATCH --cpus-per-task={per_task_cpus}",
            "EDIT: cores per rank" if srun_style else "EDIT: cores for the node's ranks",
        )
    )
    if mem_per_node_gb:
        header.append(_line(f"#SBATCH --mem={mem_per_node_gb}G", "cluster.mem_per_node_gb"))
    header.append(_line(f"#SBATCH --time={_hhmm(time_min)}", "EDIT: wall-time limit (cluster.time_min)"))
    return header


def _placement_lines(
    *, partition: str | None, account: str | None, qos: str | None, constraint: str | None, exclude: str | None
) -> list[str]:
    """#SBATCH lines for where the job may run; partition and account, when unset, become commented
    CHANGE_ME lines for the sysadmin to fill in."""
    header = []
    for flag, value in (
        ("partition", partition),
        ("account", account),
        ("qos", qos),
        ("constraint", constraint),
        ("exclude", exclude),
    ):
        if value:
            header.append(_line(f"#SBATCH --{flag}={_q(value)}", f"EDIT: cluster.{flag}"))
        elif flag in ("partition", "account"):
            header.append(_line(f"##SBATCH --{flag}=CHANGE_ME", f"EDIT: your {flag} (cluster.{flag})"))
    return header


def _requeue_lines(*, run_dir: str, signal_delay_s: int) -> list[str]:
    """#SBATCH lines that let a job survive its time limit and preemption: requeue, USR2 ahead of the
    limit, logs appended across attempts."""
    batch_log = f"{run_dir}/slurm/%j_batch.out"
    return [
        _line("#SBATCH --requeue", "a preempted or requeued job runs again: same job id, same run dir"),
        _line(
            f"#SBATCH --signal=USR2@{signal_delay_s}",
            f"USR2 to every rank {signal_delay_s} s before the time limit (not USR1: NCCL may catch it)",
        ),
        _line("#SBATCH --open-mode=append", "requeued attempts append to the logs instead of truncating them"),
        _line(
            f"#SBATCH --output={_q(batch_log)}", "Slurm does not create this folder: jobs.sbatch with sbatch.out does"
        ),
        _line(f"#SBATCH --error={_q(batch_log)}"),
    ]


def render_for(
    cfg: JobConfig,
    *,
    overrides: Sequence[str],
    style: str = "srun",
    python: str | None = None,
    workdir: str | None = None,
) -> str:
    """`render()` with the parameters taken from the composed config; `overrides` are passed on to every rank."""
    ln, cl = cfg.launcher, cfg.cluster
    run_dir = str(Path(cfg.run.dir).resolve())
    passed = [o for o in overrides if not o.startswith("run.dir=")]
    mesh = cfg.mesh
    return render(
        style=style,
        job_name=f"meshjob-{cfg.model.name}",
        nodes=ln.nodes,
        tasks_per_node=ln.tasks_per_node,
        cpus_per_task=cl.cpus_per_task,
        time_min=cl.time_min,
        signal_delay_s=ln.signal_delay_s,
        run_dir=run_dir,
        workdir=workdir or str(Path.cwd()),
        python=python or sys.executable,
        overrides=passed,
        gpus_per_node=cl.gpus_per_node,
        partition=cl.partition,
        account=cl.account,
        qos=cl.qos,
        constraint=cl.constraint,
        exclude=cl.exclude,
        mem_per_node_gb=cl.mem_per_node_gb,
        setup=cl.setup,
        env=cl.env,
        container_image=cl.container_image,
        container_mounts=cl.container_mounts,
        restarts_in_allocation=cfg.failure.restarts_in_allocation,
        spare_nodes=ln.spare_nodes,
        description=(
            f"model={cfg.model.name}, mesh pp{mesh.pp}*dp_replicate{mesh.dp_replicate}*"
            f"dp_shard{mesh.dp_shard}*tp{mesh.tp}, {cfg.world_size} ranks, cluster={cl.name}"
        ),
    )


def main(argv: list[str] | None = None) -> int:
    if "--help" in (argv := list(sys.argv[1:] if argv is None else argv)) or "-h" in argv:
        print(help_text("sbatch"))
        return exitcodes.OK
    try:
        keys, overrides = own_keys("sbatch", argv)
        if keys.get("sbatch.style", "srun") not in STYLES:
            raise ValueError(f"sbatch.style={keys['sbatch.style']}: not one of {', '.join(STYLES)}")
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    from jobs.cli import compose_or_report
    from jobs.launch.slurm import check_slurm_config
    from jobs.validate import validate

    cfg = compose_or_report(overrides)
    if cfg is None:
        return exitcodes.CONFIG_ERROR
    try:
        validate(cfg)
        check_slurm_config(cfg)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    # Pin run.dir: `${now:...}` would otherwise resolve differently on every rank.
    run_dir = str(Path(cfg.run.dir).resolve())
    try:
        text = render_for(cfg, overrides=overrides, style=str(keys.get("sbatch.style", "srun")))
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if out := keys.get("sbatch.out"):
        (Path(run_dir) / "slurm").mkdir(parents=True, exist_ok=True)  # Slurm does not create --output dirs
        Path(str(out)).write_text(text)
        print(f"wrote {out} (run dir {run_dir}); submit with: sbatch {out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return exitcodes.OK


if __name__ == "__main__":
    sys.exit(main())
