"""`python -m jobs.calibrate [overrides]`: measures this machine and writes the figures into a cluster profile.

The measuring is `jobs.planner.calibrate`; this entry point composes the config, runs it on
`launcher.tasks_per_node` local ranks at the model's shapes (`model=`, `train.micro_batch`,
`train.seq_len`, `train.mixed_precision`), writes `calibrate.out` (default
~/.config/meshjob/cluster/<cluster.name>_calibrated.yaml, `jobs.config.user_conf_dir`, updated in place) and prints
what it measured. Then `python -m jobs.plan cluster=<cluster.name>_calibrated ...` predicts with those figures, from
any directory.
Exit codes: 0 written; 2 invalid config; 1 the measurement failed.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from jobs import exitcodes
from jobs.cli import main_for
from jobs.config import CONF_DIR, JobConfig, user_conf_dir
from jobs.planner.calibrate import calibrate, write_profile

__all__ = ["main", "run", "write"]


def run(cfg: JobConfig) -> int:
    """Calibrates, writes the profile, returns the exit code."""
    if cfg.launcher.name != "local" or cfg.launcher.nodes != 1:
        print(
            f"config error: launcher={cfg.launcher.name} launcher.nodes({cfg.launcher.nodes}): calibration runs "
            "on local ranks of this machine only; use launcher=local launcher.nodes=1",
            file=sys.stderr,
        )
        return exitcodes.CONFIG_ERROR
    t = cfg.train
    command = " ".join(
        shlex.quote(a)
        for a in (
            "python",
            "-m",
            "jobs.calibrate",
            f"model={cfg.model.name}",
            f"cluster={cfg.cluster.name}",
            f"launcher.tasks_per_node={cfg.launcher.tasks_per_node}",
            f"train.micro_batch={t.micro_batch}",
            f"train.seq_len={t.seq_len}",
            f"train.mixed_precision={t.mixed_precision}",
            f"calibrate.seconds={cfg.calibrate.seconds}",
        )
    )
    try:
        figures = calibrate(cfg, command=command)
    except RuntimeError as e:
        print(f"calibration failed: {e}", file=sys.stderr)
        return exitcodes.FAILED
    out = write(cfg, figures)
    print(json.dumps(figures, indent=1))
    print(f"wrote {out}")
    return exitcodes.OK


def write(cfg: JobConfig, figures: dict) -> Path:
    """Writes the profile to `calibrate.out`, else into the user's config folder, where `cluster=<its name>` finds
    it from any directory (an installed package's conf/ is site-packages: read-only for users, lost on upgrade).
    It starts from the profile `cluster=<cluster.name>` composed (the package's conf/ first, as Hydra searches)."""
    user = user_conf_dir()
    out = Path(cfg.calibrate.out or user / "cluster" / f"{cfg.cluster.name}_calibrated.yaml")
    src = CONF_DIR if (CONF_DIR / "cluster" / f"{cfg.cluster.name}.yaml").exists() else user
    shadow = CONF_DIR / "cluster" / out.name
    if out.parent.resolve() == (user / "cluster").resolve():
        figures = {**figures, "name": out.stem}  # `cluster=<stem>` composes it: its name says so
        if shadow.exists():
            print(f"note: {shadow} (an older jobs.calibrate's) is found first: delete it to use {out}", file=sys.stderr)
    return write_profile(cfg, figures, out, conf_dir=src)


def main(argv: list[str] | None = None) -> int:
    return main_for(run, argv, command="calibrate")


if __name__ == "__main__":
    exitcodes.exit_command(main())
