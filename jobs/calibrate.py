"""`python -m jobs.calibrate [overrides]`: measures this machine and writes the figures into a cluster profile.

The measuring is `jobs.planner.calibrate`; this entry point composes the config, runs it on
`launcher.tasks_per_node` local ranks at the model's shapes (`model=`, `train.micro_batch`,
`train.seq_len`, `train.mixed_precision`), writes `calibrate.out` (default
conf/cluster/<cluster.name>_calibrated.yaml, updated in place) and prints what it measured. Then
`python -m jobs.plan cluster=<cluster.name>_calibrated ...` predicts with those figures.
Exit codes: 0 written; 2 invalid config; 1 the measurement failed.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

from jobs import exitcodes
from jobs.cli import main_for
from jobs.config import CONF_DIR, JobConfig
from jobs.planner.calibrate import calibrate, write_profile

__all__ = ["main", "run"]


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
    out = Path(cfg.calibrate.out) if cfg.calibrate.out else CONF_DIR / "cluster" / f"{cfg.cluster.name}_calibrated.yaml"
    write_profile(cfg, figures, out, conf_dir=CONF_DIR)
    print(json.dumps(figures, indent=1))
    print(f"wrote {out}")
    return exitcodes.OK


def main(argv: list[str] | None = None) -> int:
    return main_for(run, argv, command="calibrate")


if __name__ == "__main__":
    sys.exit(main())
