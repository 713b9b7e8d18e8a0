"""What the meshjob commands share on the login node: Hydra's own flags, and config errors as exit code 2."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from jobs import exitcodes
from jobs.config import CONF_DIR, JobConfig, compose, register_configs, to_job_config

__all__ = ["HYDRA_FLAGS", "is_config_error", "compose_or_report", "main_for"]

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


def is_config_error(e: BaseException) -> bool:
    """A ValueError from a schema check, or any Hydra/OmegaConf composition error (unknown key, wrong type,
    missing option)."""
    return isinstance(e, ValueError) or type(e).__module__.split(".")[0] in ("hydra", "omegaconf")


def compose_or_report(overrides: Sequence[str]) -> JobConfig | None:
    """The composed config, or None after printing `config error: ...` to stderr."""
    try:
        return compose(list(overrides))
    except Exception as e:  # noqa: BLE001 - anything else is a bug and propagates
        if not is_config_error(e):
            raise
        print(f"config error: {e}", file=sys.stderr)
        return None


def _hydra_main(run: Callable[[JobConfig], int], *, sweep_continues: bool, point_run_dirs: bool) -> None:
    import hydra

    register_configs()  # hydra/launcher=meshjob_slurm is found by Hydra's plugin discovery (hydra_plugins/)

    def _task(dcfg) -> int:
        from hydra.core.hydra_config import HydraConfig

        code = run(to_job_config(dcfg))
        if code and not (sweep_continues and HydraConfig.get().mode.name == "MULTIRUN"):
            raise SystemExit(code)
        return code

    _task.point_run_dirs = point_run_dirs  # read by hydra_plugins/meshjob_local_launcher (Hydra hands it this function)
    hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")(_task)()


def main_for(
    run: Callable[[JobConfig], int],
    argv: Sequence[str] | None = None,
    *,
    sweep_continues: bool = False,
    point_run_dirs: bool = False,
) -> int:
    """A command's main(): plain overrides are composed here (errors exit 2, nothing written); Hydra's
    flags and `-m` sweeps go through @hydra.main. `sweep_continues`: a failing point does not stop a sweep.
    `point_run_dirs`: a local sweep's point <n> runs in `hydra.sweep.dir/<n>` (jobs.launch.sweep.point_run_dirs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a.split("=")[0] in HYDRA_FLAGS for a in argv):
        _hydra_main(run, sweep_continues=sweep_continues, point_run_dirs=point_run_dirs)
        return exitcodes.OK
    cfg = compose_or_report(argv)
    return exitcodes.CONFIG_ERROR if cfg is None else run(cfg)
