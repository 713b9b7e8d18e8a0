"""What the meshjob commands share on the login node: Hydra's own flags, and config errors as exit code 2."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence

from jobs import exitcodes
from jobs.commands import help_text
from jobs.config import CONF_DIR, JobConfig, compose, register_configs, to_job_config

__all__ = [
    "HYDRA_FLAGS",
    "is_config_error",
    "describe_config_error",
    "compose_or_report",
    "split_hydra_argv",
    "sweep_points",
    "main_for",
]

# Arguments that only @hydra.main understands (sweeps, --cfg, --help, ...); plain overrides do not need it.
HYDRA_FLAGS = (
    "-m",
    "--multirun",
    "--cfg",
    "-c",
    "--help",
    "-h",
    "--hydra-help",
    "--info",
    "-i",
    "--resolve",
    "--package",
    "-p",
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--shell-completion",
    "-sc",
    "--run",
    "-r",
)


# Flags whose value is the next argument (`--cfg job`), and flags after which the overrides are not composed here
# first: help and info print without composing, and another config dir or name composes what compose() does not.
_VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")
_OWN_COMPOSE = ("--help", "-h", "--hydra-help", "--info", "-i", "--shell-completion", "-sc", "--config-path", "-cp")
_OWN_COMPOSE += ("--config-name", "-cn", "--config-dir", "-cd")


def is_config_error(e: BaseException) -> bool:
    """A ValueError from a schema check, or any Hydra/OmegaConf composition error (unknown key, wrong type,
    missing option)."""
    return isinstance(e, ValueError) or type(e).__module__.split(".")[0] in ("hydra", "omegaconf")


def describe_config_error(e: BaseException) -> str:
    """The error with its cause: Hydra's `Error merging override mesh.tp=two` gains OmegaConf's `Value 'two' of
    type 'str' could not be converted to Integer (key mesh.tp)`."""
    text = str(e).strip()
    cause = e.__cause__
    if cause is not None and type(cause).__module__.split(".")[0] == "omegaconf":
        key = getattr(cause, "full_key", None)
        text += f": {str(getattr(cause, 'msg', cause)).splitlines()[0]}" + (f" (key {key})" if key else "")
    return text


def compose_or_report(overrides: Sequence[str]) -> JobConfig | None:
    """The composed config, or None after printing `config error: ...` to stderr."""
    try:
        return compose(list(overrides))
    except Exception as e:  # noqa: BLE001 - anything else is a bug and propagates
        if not is_config_error(e):
            raise
        print(f"config error: {describe_config_error(e)}", file=sys.stderr)
        return None


def split_hydra_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, the overrides)."""
    flags: list[str] = []
    overrides: list[str] = []
    it = iter(argv)
    for a in it:
        name = a.split("=")[0]
        if name not in HYDRA_FLAGS:
            overrides.append(a)
            continue
        flags.append(a)
        if name in _VALUE_FLAGS and "=" not in a:
            flags.append(next(it, ""))
    return flags, overrides


def sweep_points(overrides: Sequence[str]) -> list[list[str]]:
    """The overrides of a `-m` sweep, each swept value once: every sweep at its first value, then one point per
    further value of each sweep (composition errors belong to one value, not to a combination)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(overrides))
    values = [list(o.sweep_string_iterator()) if o.is_sweep_override() else [None] for o in parsed]

    def point(pick: dict[int, str]) -> list[str]:
        return [
            o.input_line if v[0] is None else f"{o.get_key_element()}={pick.get(i, v[0])}"
            for i, (o, v) in enumerate(zip(parsed, values))
        ]

    return [point({})] + [point({i: x}) for i, v in enumerate(values) for x in v[1:]]


def _recorded(cfg: JobConfig, overrides: Sequence[str]) -> JobConfig:
    """`run.command` and `run.overrides` filled in: config.yaml in the run dir records how it was composed."""
    cfg.run.command = shlex.join(sys.orig_argv)
    cfg.run.overrides = list(overrides)
    return cfg


def register_launchers() -> None:
    """The schema and launcher config nodes (`jobs.config.register_configs`), and the launcher classes with Hydra's
    plugin registry, which instantiates `hydra/launcher=meshjob_local|meshjob_slurm` only from registered classes:
    an editable install hides the `hydra_plugins` namespace from Hydra's plugin scan, so they are registered here
    rather than found. The entry points are the only place that imports them (they import `jobs.launch`)."""
    from hydra.core.plugins import Plugins

    from hydra_plugins.meshjob_local_launcher import MeshjobLocalLauncher
    from hydra_plugins.meshjob_slurm_launcher import MeshjobSlurmLauncher

    register_configs()
    for launcher in (MeshjobLocalLauncher, MeshjobSlurmLauncher):
        Plugins.instance().register(launcher)


def _hydra_main(run: Callable[[JobConfig], int], *, sweep_continues: bool, point_run_dirs: bool) -> None:
    import hydra

    register_launchers()

    def _task(dcfg) -> int:
        from hydra.core.hydra_config import HydraConfig

        try:
            cfg = to_job_config(dcfg)
        except ValueError as e:  # an unknown key: exit 2, not Hydra's 1 for an exception in the task
            print(f"config error: {e}", file=sys.stderr)
            raise SystemExit(exitcodes.CONFIG_ERROR) from e
        code = run(_recorded(cfg, HydraConfig.get().overrides.task))
        if code and not (sweep_continues and HydraConfig.get().mode.name == "MULTIRUN"):
            raise SystemExit(code)
        return code

    _task.point_run_dirs = point_run_dirs  # read by hydra_plugins/meshjob_local_launcher (Hydra hands it this function)
    hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")(_task)()


def main_for(
    run: Callable[[JobConfig], int],
    argv: Sequence[str] | None = None,
    *,
    command: str,
    sweep_continues: bool = False,
    point_run_dirs: bool = False,
) -> int:
    """A command's main(): plain overrides are composed here (errors exit 2, nothing written); Hydra's
    flags and `-m` sweeps go through @hydra.main. `sweep_continues`: a failing point does not stop a sweep.
    `command`: its name in jobs.commands (`--help` prints its help_text). `point_run_dirs`: a local sweep's point <n> runs in `hydra.sweep.dir/<n>` (jobs.launch.sweep.point_run_dirs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:  # ours, not Hydra's 240-line dump (that is --hydra-help and --cfg job)
        print(help_text(command))
        return exitcodes.OK
    flags, overrides = split_hydra_argv(argv)
    if not flags:
        cfg = compose_or_report(overrides)
        return exitcodes.CONFIG_ERROR if cfg is None else run(_recorded(cfg, overrides))
    if not any(f.split("=")[0] in _OWN_COMPOSE for f in flags):
        # composed here first, so that a config error exits 2 with its cause, as without Hydra's flags
        try:
            points = sweep_points(overrides)
        except Exception as e:  # noqa: BLE001 - Hydra's override parser raises its own types
            if not is_config_error(e):
                raise
            print(f"config error: {describe_config_error(e)}", file=sys.stderr)
            return exitcodes.CONFIG_ERROR
        if any(compose_or_report(p) is None for p in points):
            return exitcodes.CONFIG_ERROR
    _hydra_main(run, sweep_continues=sweep_continues, point_run_dirs=point_run_dirs)
    return exitcodes.OK
