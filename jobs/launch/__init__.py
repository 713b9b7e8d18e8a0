"""Where ranks run and how they learn where they are.

`env.DistEnv` (the one object a rank reads its place from), `rank.run_rank` (what every rank runs
under any launcher), `local.launch` (forked CPU ranks on this machine), `slurm` (submitit jobs and
the steps of rendered sbatch scripts), `sweep` (a `-m` sweep as one array job), `slurm_state` (what Slurm says of a job: state,
restarts, exit code), `rendezvous` (the world group on a published port),
`prepare.prepare_run` (the data file and run dir, once, before any rank starts), and `rundir` (a run
directory holds one run and one live job: `RUN_DIR/owner.json`, checked before every start), `task_exits` (each
srun task's record of how its rank ended, which the supervisor decides from) and `stop_notice` (a USR2 that reaches a
torchrun agent while no rank can take it, recorded for the ranks it starts next).
"""

__all__ = [
    "env",
    "local",
    "prepare",
    "rank",
    "rendezvous",
    "rundir",
    "slurm",
    "slurm_state",
    "stop_notice",
    "sweep",
    "task_exits",
]
