"""`python -m jobs.train [overrides]`: compose the config, check it, prepare the run dir, launch the ranks.

Plain overrides are composed with `jobs.config.compose` (config errors exit 2 before anything is
written); `-m` sweeps and Hydra's own flags (`--cfg`, `--help`, ...) go through `@hydra.main`.
"""

from __future__ import annotations

import signal
import sys

from jobs import exitcodes
from jobs.cli import main_for
from jobs.config import JobConfig
from jobs.failure.signals import StopSignals
from jobs.launch.prepare import prepare_inputs, prepare_run
from jobs.launch.rundir import claim_run_dir
from jobs.log import setup_logging

__all__ = ["main", "run"]


def run(cfg: JobConfig) -> int:
    """Validates, then submits (launcher=slurm) or runs locally; returns the exit code."""
    from jobs.validate import check_device, validate

    log = setup_logging()
    try:
        derived = validate(cfg)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if cfg.launcher.name == "slurm":
        from jobs.launch.slurm import submit

        return submit(cfg)
    if cfg.launcher.name != "local":
        print(f"config error: launcher={cfg.launcher.name!r} is not one of local, slurm", file=sys.stderr)
        return exitcodes.CONFIG_ERROR

    try:
        check_device(cfg)  # the ranks run on this machine: the GPUs they need must be visible here
        prepare_inputs(cfg)  # the data file matches the model: refused before the run dir is touched
        claim_run_dir(cfg, launcher="local")  # another run or a live job there: refused before anything is written
        run_dir = prepare_run(cfg)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    log.info(
        "run dir %s | model %s | mesh %s on %d ranks | %d microbatches/step | %d tokens/step",
        run_dir,
        cfg.model.name,
        derived.dims.describe(),
        cfg.world_size,
        derived.microbatches,
        derived.tokens_per_step,
    )
    from jobs.launch.local import launch

    code = launch(cfg, early=_early)
    log.info("finished with exit code %d", code) if code == 0 else log.error("failed with exit code %d", code)
    return code


# A stop signal (Ctrl-C, SIGTERM, SIGUSR2) while the config is composed and the ranks start is
# recorded here and handed to the ranks, which then end the attempt before training (exit 75).
_early = StopSignals()


def main(argv: list[str] | None = None) -> int:
    _early.install([signal.SIGUSR2, signal.SIGTERM])
    return main_for(run, argv, command="train", point_run_dirs=True)  # a local -m sweep: each point in its own run dir


if __name__ == "__main__":
    exitcodes.exit_command(main())
