"""Hydra launcher plugin `hydra/launcher=meshjob_local`: a local `-m` sweep, each point in its own run directory.

Hydra's basic launcher lets every point keep the run.dir it composes to, and the default
`runs/${now:...}` resolves anew per point: points composed within one second would share a directory.
For `jobs.train` (its task says `point_run_dirs`: `jobs.cli.main_for`) this one gives point <idx>
`hydra.sweep.dir/<idx>` (`jobs.launch.sweep.point_run_dirs`; conf/train.yaml makes hydra.sweep.dir
`${run.dir}`) unless the overrides sweep run.dir, refuses a sweep whose points would share a run dir,
and lists the points in `hydra.sweep.dir/sweep.jsonl`. Other commands' points (`jobs.plan -m`) keep the
run.dir they compose to (a run's ledger to plan from). Selected by conf/launcher/local.yaml.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, configure_log, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from omegaconf import open_dict

# Its config node `hydra/launcher=meshjob_local` is stored by jobs.config.register_configs (jobs.config.LAUNCHERS).


class MeshjobLocalLauncher(Launcher):
    def __init__(self, **_: Any) -> None:
        self.config: Any = None
        self.hydra_context: Any = None
        self.task_function: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        trains = getattr(self.task_function, "point_run_dirs", False)
        cfgs = (
            self._points(job_overrides, initial_job_idx)
            if trains
            else [self._point(o, idx=initial_job_idx + i, run_dir=None) for i, o in enumerate(job_overrides)]
        )
        runs = []
        for cfg in cfgs:
            if trains:  # (jobs.plan -m plan.json=true prints one JSON object per point, nothing else)
                print(
                    f"sweep point {cfg.hydra.job.num}: {' '.join(cfg.hydra.overrides.task) or '(no overrides)'}"
                    f" | run dir {cfg.run.dir}",
                    flush=True,
                )
            # Hydra's output dir: the point's run dir, or "." (hydra.run.dir) for commands that write none;
            # hydra.output_subdir is null, so Hydra writes nothing there
            runs.append(
                run_job(
                    hydra_context=self.hydra_context,
                    task_function=self.task_function,
                    config=cfg,
                    job_dir_key="run.dir" if trains else "hydra.run.dir",
                    job_subdir_key=None,
                )
            )
            configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return runs

    def _points(self, job_overrides: Sequence[Sequence[str]], first_idx: int) -> list[Any]:
        """Every point composed with its own run dir, checked for shared ones, and listed in sweep.jsonl."""
        from jobs.launch.sweep import point_run_dirs

        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        dirs = point_run_dirs(job_overrides, sweep_dir=sweep_dir, first_idx=first_idx)
        cfgs = [self._point(o, idx=first_idx + i, run_dir=d) for i, (o, d) in enumerate(zip(job_overrides, dirs))]
        first: dict[str, int] = {}
        for cfg in cfgs:
            j = first.setdefault(cfg.run.dir, cfg.hydra.job.num)
            if j != cfg.hydra.job.num:
                raise ValueError(
                    f"sweep points {j} and {cfg.hydra.job.num} would both train in run.dir={cfg.run.dir}: "
                    "two points never share a run directory; sweep run.dir over distinct values, "
                    "or do not sweep it"
                )
        sweep_dir.mkdir(parents=True, exist_ok=True)
        with open(sweep_dir / "sweep.jsonl", "a") as f:
            for o, cfg in zip(job_overrides, cfgs):
                f.write(
                    json.dumps(
                        {
                            "idx": cfg.hydra.job.num,
                            "overrides": list(o),
                            "job_id": None,
                            "run_dir": cfg.run.dir,
                            "pruned": None,
                        }
                    )
                    + "\n"
                )
        return cfgs

    def _point(self, overrides: Sequence[str], *, idx: int, run_dir: Path | None) -> Any:
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg):
            cfg.hydra.job.id = cfg.hydra.job.num = idx
            if run_dir is not None:
                cfg.run.dir = str(run_dir)
            elif getattr(self.task_function, "point_run_dirs", False):
                cfg.run.dir = str(Path(str(cfg.run.dir)).resolve())  # a swept `.../${now:...}` resolves once
        return cfg
