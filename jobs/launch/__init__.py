"""Where ranks run and how they learn where they are.

`env.DistEnv` (the one object a rank reads its place from), `rank.run_rank` (what every rank runs
under any launcher), `local.launch` (forked CPU ranks on this machine), `slurm` (submitit jobs and
the steps of rendered sbatch scripts), `sweep` (a `-m` sweep as one array job), and
`prepare.prepare_run` (the data file and run dir, once, before any rank starts).
"""

__all__ = ["env", "local", "prepare", "rank", "slurm", "sweep"]
