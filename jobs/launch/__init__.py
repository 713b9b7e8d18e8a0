"""Where ranks run and how they learn where they are.

`env.DistEnv` (the one object a rank reads its place from), `rank.run_rank` (what every rank runs
under any launcher), `local.launch` (forked CPU ranks on this machine), `slurm` (submitit jobs and
the steps of rendered sbatch scripts), `sweep` (a `-m` sweep as one array job), `slurm_state` (what Slurm says of a job: state,
restarts, exit code), `rendezvous` (the world group on a published port),
`prepare.prepare_run` (the data file and run dir, once, before any rank starts), and `rundir` (a run
directory holds one run and one live job: `RUN_DIR/owner.json`, checked before every start).
"""

__all__ = ["env", "local", "prepare", "rank", "rendezvous", "rundir", "slurm", "slurm_state", "sweep"]
