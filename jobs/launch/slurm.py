"""The Slurm launcher: submit one job (one Slurm task per rank, through submitit) and run its ranks.

Sweeps (`-m`) are in `jobs.launch.sweep`. Login node: `submit(cfg)` validates, prepares the run dir on the shared filesystem, submits and
returns (fire-and-forget; `launcher.wait=true` follows the job). Compute node: every Slurm task runs
`SlurmRank`, which builds `DistEnv` from the Slurm environment and calls `jobs.launch.rank.run_rank`.
`SlurmRank` is a submitit `Checkpointable`: on USR2 (preemption / time limit) rank 0 requeues the job
with the same pickled config, hence the same `run.dir`.

`python -m jobs.launch.slurm --rank OVERRIDES...` is the per-rank entry of the scripts rendered by
`python -m jobs.sbatch` (it composes the config itself instead of unpickling it).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import submitit

from jobs import exitcodes
from jobs.config import JobConfig
from jobs.launch.env import DistEnv
from jobs.launch.prepare import prepare_run

__all__ = ["submit", "SlurmRank", "make_executor", "check_slurm_config", "login_checks", "require_slurm",
           "rank_main", "wait_for_job", "job_state"]

# Variables a submitting shell may carry (a torchrun or local-launcher environment) that must not
# leak into the job: under Slurm the rendezvous comes from the job itself.
_INHERITED_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                         "LOCAL_WORLD_SIZE", "GROUP_RANK")


# --- compute node -------------------------------------------------------------------------------

def rank_environ(cfg: JobConfig, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a Slurm rank should see: inherited rendezvous variables dropped, the profile's
    `cluster.env` added, and `launcher.master_port` pinned when set."""
    env = dict(os.environ if environ is None else environ)
    if "TORCHELASTIC_RUN_ID" not in env:  # under torchrun its variables are the truth; else Slurm's
        for k in _INHERITED_RENDEZVOUS:
            env.pop(k, None)
    env.update({str(k): str(v) for k, v in cfg.cluster.env.items()})
    if cfg.launcher.master_port and "TORCHELASTIC_RUN_ID" not in env:
        env["MASTER_PORT"] = str(cfg.launcher.master_port)
    return env


def rank_main(cfg: JobConfig) -> int:
    """One rank under Slurm: export the profile's env, build DistEnv, train; requeue when asked."""
    environ = rank_environ(cfg)
    os.environ.clear()
    os.environ.update(environ)  # before init_process_group: NCCL/torch read these at init
    env = DistEnv.from_environ(environ)
    print(f"meshjob: job {env.job_id} restart {env.restart_count} rank {env.rank}/{env.world_size} "
          f"node {env.hostname} ({env.node_rank}/{env.nodes}) master {env.master_addr}:{env.master_port} "
          f"run.dir {cfg.run.dir}", flush=True)
    from jobs.launch.rank import run_rank

    code = run_rank(cfg, env)
    if code == exitcodes.REQUEUE and env.rank == 0 and env.job_id:
        # The worker stopped on purpose (it caught the preemption signal itself): rank 0 asks Slurm to
        # run the job again; the same run.dir is reused because the job script is unchanged.
        subprocess.run(["scontrol", "requeue", env.job_id], check=False)
    return code


class SlurmRank(submitit.helpers.Checkpointable):
    """The submitit callable of one rank; pickled once per job, re-pickled as is on requeue."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg

    def __call__(self) -> int:
        code = rank_main(self.cfg)
        if code != exitcodes.OK:
            raise SystemExit(code)  # Slurm records the rank's exit code (sacct ExitCode)
        return code


# --- login node ---------------------------------------------------------------------------------

def check_slurm_config(cfg: JobConfig) -> None:
    """The Slurm-specific login-node checks (after `jobs.validate.validate`); ValueError names the knob."""
    ln, cl = cfg.launcher, cfg.cluster
    run_dir, root = Path(cfg.run.dir).resolve(), Path(cl.run_root).resolve()
    if not run_dir.is_relative_to(root):
        raise ValueError(
            f"run.dir={cfg.run.dir} is not under cluster.run_root={cl.run_root} (cluster={cl.name}): "
            "run dirs must be on the profile's shared filesystem that every node mounts; "
            f"set run.dir={root}/<name> or pick the right cluster= profile"
        )
    if cl.gpus_per_node and ln.tasks_per_node != cl.gpus_per_node:
        raise ValueError(
            f"launcher.tasks_per_node({ln.tasks_per_node}) != cluster.gpus_per_node({cl.gpus_per_node}) "
            f"(cluster={cl.name}): one Slurm task per GPU; set launcher.tasks_per_node={cl.gpus_per_node}"
        )
    if cl.time_min * 60 <= ln.signal_delay_s:
        raise ValueError(
            f"launcher.signal_delay_s({ln.signal_delay_s}) >= cluster.time_min({cl.time_min}) * 60: the "
            "time-limit warning would come before the job starts; lower launcher.signal_delay_s"
        )
    if ln.array_parallelism < 0:
        raise ValueError(f"launcher.array_parallelism({ln.array_parallelism}) must be >= 0 (0 = all at once)")


def login_checks(cfg: JobConfig) -> None:
    from jobs.validate import validate

    validate(cfg)
    check_slurm_config(cfg)


def require_slurm() -> None:
    if shutil.which("sbatch") is None:
        raise RuntimeError(
            "sbatch not found on PATH: submit from a Slurm login node, or start the local test cluster "
            "with scripts/slurm/start (launcher=slurm needs a Slurm cluster)"
        )


def make_executor(cfg: JobConfig, folder: str | Path, *, job_name: str = "meshjob") -> submitit.SlurmExecutor:
    """A submitit SlurmExecutor whose sbatch script matches `cfg` (one task per rank, srun, USR2)."""
    ln, cl = cfg.launcher, cfg.cluster
    ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=cfg.failure.max_requeues)
    srun_args = ["--kill-on-bad-exit=1"]
    if cl.container_image:
        srun_args.append(f"--container-image={cl.container_image}")
    if cl.container_mounts:
        srun_args.append(f"--container-mounts={cl.container_mounts}")
    params: dict[str, Any] = dict(
        job_name=job_name,
        nodes=ln.nodes,
        ntasks_per_node=ln.tasks_per_node,
        cpus_per_task=cl.cpus_per_task,
        time=cl.time_min,
        signal_delay_s=ln.signal_delay_s,
        use_srun=True,
        srun_args=srun_args,
        setup=[*cl.setup, *(f"export {k}={shlex.quote(str(v))}" for k, v in cl.env.items())],
        additional_parameters={"requeue": True},
        array_parallelism=ln.array_parallelism or 256,
    )
    optional = dict(partition=cl.partition, account=cl.account, qos=cl.qos, constraint=cl.constraint,
                    exclude=cl.exclude)
    params.update({k: v for k, v in optional.items() if v})
    if cl.gpus_per_node:
        params["gpus_per_node"] = cl.gpus_per_node
    if cl.mem_per_node_gb:
        params["mem"] = f"{cl.mem_per_node_gb}G"
    ex.update_parameters(**params)
    return ex


def submit(cfg: JobConfig) -> int:
    """Validates on the login node, submits one job, prints job id / run dir / logs; returns an exit code."""
    try:
        login_checks(cfg)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    try:
        require_slurm()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return exitcodes.ENV_ERROR
    try:
        run_dir = prepare_run(cfg)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    folder = run_dir / "slurm"
    try:
        job = make_executor(cfg, folder / "%j", job_name=f"meshjob-{cfg.model.name}").submit(SlurmRank(cfg))
    except submitit.core.utils.FailedJobError as e:
        print(f"error: sbatch refused the job (run dir {run_dir} kept): {str(e).strip()}", file=sys.stderr)
        return exitcodes.ENV_ERROR
    out = folder / job.job_id
    print(f"submitted job {job.job_id}: {cfg.world_size} ranks ({cfg.world_size_expr}), "
          f"cluster={cfg.cluster.name}")
    print(f"run dir  {run_dir}")
    print(f"logs     {out}/{job.job_id}_<rank>_log.out|err (appended across requeues)")
    print(f"metrics  {run_dir / 'metrics.jsonl'}")
    print(f"status   sacct -j {job.job_id} --duplicates -o JobID,State,ExitCode,NodeList,Restarts")
    sys.stdout.flush()
    if not cfg.launcher.wait:
        return exitcodes.OK
    return wait_for_job(job.job_id, run_dir)


_FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL",
          "DEADLINE"}


def job_state(job_id: str) -> tuple[str, int, int]:
    """(state, exit code, restarts) of a job's allocation as Slurm reports it (sacct, then scontrol)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True)
    fields = dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)
    if out.returncode == 0 and "JobState" in fields:
        code = int(fields.get("ExitCode", "0:0").split(":")[0])
        return fields["JobState"], code, int(fields.get("Restarts", 0))
    out = subprocess.run(["sacct", "-X", "-n", "-P", "-j", job_id, "-o", "State,ExitCode"],
                         capture_output=True, text=True)
    lines = [l for l in out.stdout.splitlines() if l.strip()]
    if not lines:
        return "UNKNOWN", 0, 0
    state, code = lines[-1].split("|")
    return state.split()[0], int(code.split(":")[0]), len(lines) - 1


def wait_for_job(job_id: str, run_dir: Path, *, poll_s: float = 2.0) -> int:
    """Follows a job until it ends, relaying state changes and metrics lines; returns an exit code."""
    metrics, seen, last = run_dir / "metrics.jsonl", 0, None
    while True:
        state, code, restarts = job_state(job_id)
        if (state, restarts) != last:
            print(f"job {job_id}: {state}" + (f" (restart {restarts})" if restarts else ""), flush=True)
            last = (state, restarts)
        if metrics.exists():
            lines = metrics.read_text().splitlines()
            for line in lines[seen:]:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    break  # a line being written; read it next time
                seen += 1
                print("  " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                      for k, v in rec.items()), flush=True)
        if state in _FINAL:
            if state == "COMPLETED":
                return exitcodes.OK
            print(f"job {job_id} ended {state} with exit code {code}; see {run_dir / 'slurm' / job_id}",
                  file=sys.stderr)
            return code or exitcodes.FAILED
        time.sleep(poll_s)


def _script_cli(mode: str, argv: list[str]) -> int:
    """The two steps of a rendered sbatch script: `--prepare` (batch shell, once), `--rank` (every rank)."""
    from jobs.config import compose

    try:
        cfg = compose(argv)
        if mode == "--prepare":
            login_checks(cfg)
    except Exception as e:  # noqa: BLE001 - ValueError from the checks or any Hydra composition error
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if mode == "--prepare":
        prepare_run(cfg)
        return exitcodes.OK
    return rank_main(cfg)


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in ("--rank", "--prepare"):
        print("usage: python -m jobs.launch.slurm --prepare|--rank [OVERRIDES...]  (the steps of a script "
              "rendered by `python -m jobs.sbatch`; submit jobs with `python -m jobs.train launcher=slurm`)",
              file=sys.stderr)
        sys.exit(exitcodes.CONFIG_ERROR)
    sys.exit(_script_cli(sys.argv[1], sys.argv[2:]))
