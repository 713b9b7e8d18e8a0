"""Hydra launcher plugin `hydra/launcher=meshjob_slurm`: a `-m` sweep becomes one Slurm array job, pruned first, never blocking.

Hydra only instantiates launchers that live in the `hydra_plugins` namespace, so this thin class sits
here and the logic in `jobs.launch.sweep`. Selected by conf/launcher/slurm.yaml.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.launcher import Launcher

# Its config node `hydra/launcher=meshjob_slurm` is stored by jobs.config.register_configs (jobs.config.LAUNCHERS).


class MeshjobSlurmLauncher(Launcher):
    def __init__(self, **_: Any) -> None:
        self.config: Any = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.hydra_context, self.config = hydra_context, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from jobs.launch.sweep import hydra_point, launch_sweep, point_run_dirs

        loader = self.hydra_context.config_loader
        # hydra.sweep.dir: conf/train.yaml makes it ${run.dir}, resolved once here, or the user's own
        sweep_dir = Path(str(self.config.hydra.sweep.dir)).resolve()
        dirs = point_run_dirs(job_overrides, sweep_dir=sweep_dir, first_idx=initial_job_idx)
        points = [
            hydra_point(self.config, o, loader=loader, idx=initial_job_idx + i, run_dir=d)
            for i, (o, d) in enumerate(zip(job_overrides, dirs))
        ]
        if all(p.cfg is None for p in points):
            raise ValueError("no sweep point composes:\n" + "\n".join(f"  {p.idx}: {p.reason}" for p in points))
        launch_sweep(points, sweep_dir=sweep_dir)
        return [
            JobReturn(
                overrides=p.overrides,
                status=JobStatus.COMPLETED,
                _return_value=p.job_id or f"pruned: {p.reason}",
                task_name="train",
            )
            for p in points
        ]
