"""Where ranks run and how they learn where they are.

`env.DistEnv` (the one object a rank reads its place from), `rank.run_rank` (what every rank runs
under any launcher), `local.launch` (forked CPU ranks on this machine), `slurm` (submitit jobs and
the steps of rendered sbatch scripts), `sweep` (a `-m` sweep as one array job), `slurm_state` (what Slurm says of a job: state,
restarts, exit code), `rendezvous` (the world group on a published port), and
`prepare.prepare_run` (the data file and run dir, once, before any rank starts).
"""

__all__ = ["env", "local", "prepare", "rank", "rendezvous", "slurm", "slurm_state", "sweep"]
