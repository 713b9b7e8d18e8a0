"""The Slurm launcher: submit one job (one Slurm task per rank, through submitit) and run its ranks.

Sweeps (`-m`) are in `jobs.launch.sweep`. Login node: `submit(cfg)` validates, prepares the run dir on the
shared filesystem, submits and returns (fire-and-forget; `launcher.wait=true` follows the job). The
batch step runs `SlurmJob` (submitit, use_srun=False), the supervisor of `jobs.launch.supervise`: it
starts the ranks as an srun step of `python -m jobs.launch.slurm --rank-config PATH`, each of which
builds `DistEnv` from the Slurm environment and calls `jobs.launch.rank.run_rank`, and starts them again
inside the allocation after a "restart" decision. Requeues (signals, incidents) are decided by the ranks.

`python -m jobs.launch.slurm --supervise OVERRIDES...` is the same supervisor for the scripts rendered
by `python -m jobs.sbatch` (it composes the config itself and prepares the run dir first);
`--agent TORCHRUN_ARGS...` is torchrun's agent for the torchrun-style script (`agent_main`).
"""

from __future__ import annotations

if __name__ == "__main__":  # a rank's stop signals before anything slow (the imports below take about 1 s):
    # a USR2 or SIGTERM from now on is recorded, not fatal (USR2's default action would kill the rank).
    import signal as _signal
    import sys as _sys

    from jobs.failure.signals import StopSignals as _StopSignals
    from jobs.failure.signals import parse_signals as _parse_signals

    if _sys.argv[1:2] == ["--agent"]:  # torchrun's agent: SIGTERM ignored, as the script's trap left it; USR2
        # blocked, its ranks inherit that until their own handlers are in place (then a USR2 that came meanwhile is
        # delivered to them), and a thread of the agent takes the USR2 that comes while no rank is there to
        # (`jobs.launch.stop_notice`): torchrun restarting its ranks is no window in which it is lost
        _signal.signal(_signal.SIGTERM, _signal.SIG_IGN)
        _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGUSR2})  # first: USR2's default action kills
        _signal.signal(_signal.SIGUSR2, _signal.SIG_DFL)  # blocked, it waits (ignored, POSIX may discard it)
        _stop = _StopSignals()
    else:
        if _sys.argv[1:2] == ["--rank-config"] and "--task-exits" in _sys.argv:  # the srun task: a watcher that
            from jobs.launch.task_exits import watched as _watched  # records how the rank ends; the rank is its child

            _watched(_sys.argv[_sys.argv.index("--task-exits") + 1])
        _stop = _StopSignals().install(_parse_signals(["SIGUSR2", "SIGTERM"]))

import os
import shlex
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import submitit

from jobs import exitcodes
from jobs.config import JobConfig
from jobs.events import EventLog
from jobs.failure.policy import read_decision
from jobs.failure.quarantine import known_nodes, quarantined
from jobs.failure.respond import open_attempt
from jobs.failure.signals import StopSignals, parse_signals
from jobs.launch.collector import imports_frozen
from jobs.launch.env import RESTART_IN_ALLOCATION_VAR, DistEnv, attempt_name, expand_nodelist, slurm_job_id
from jobs.launch.prepare import prepare_inputs, prepare_run
from jobs.launch.rundir import claim_run_dir, record_job
from jobs.launch.slurm_state import job_state, seconds_left, wait_for_job
from jobs.launch.stop_notice import NOTICE_SIGNAL, notice_path, read_notice, record_notices

__all__ = [
    "submit",
    "SlurmJob",
    "make_executor",
    "check_slurm_config",
    "login_checks",
    "require_slurm",
    "rank_main",
    "wait_for_job",
    "job_state",
]

# Variables a submitting shell may carry (a torchrun or local-launcher environment) that must not
# leak into the job: under Slurm the rendezvous comes from the job itself.
_INHERITED_RENDEZVOUS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
)


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


def rank_main(cfg: JobConfig, stop: StopSignals | None = None) -> int:
    """One rank under Slurm: stop signals first, export the profile's env, build DistEnv, train.
    Rank 0 opens the attempt in the ledger unless a supervisor did; requeues are decided inside `run_rank`."""
    stop = (stop or StopSignals()).install(parse_signals(cfg.failure.requeue_signals))
    environ = rank_environ(cfg)
    os.environ.clear()
    os.environ.update(environ)  # before init_process_group: NCCL/torch read these at init
    with imports_frozen():  # torch (and the rank's modules below): imported once, kept to the end
        from jobs.launch.rendezvous import agreed_torchrun_restart

    env = agreed_torchrun_restart(DistEnv.from_environ(environ), timeout_s=cfg.failure.init_timeout_s)
    print(
        f"meshjob: job {env.job_id} restart {env.restart_count} rank {env.rank}/{env.world_size} "
        f"node {env.hostname} ({env.node_rank}/{env.nodes}) pid {os.getpid()} run.dir {cfg.run.dir}",
        flush=True,
    )
    with imports_frozen():
        from jobs.launch.rank import attempt_context, run_rank

    if RESTART_IN_ALLOCATION_VAR not in environ:  # torchrun scripts: no supervisor of ours
        ended = _ended_for_good(cfg, env)
        if ended is not None:
            return ended
        _missed_warning(cfg, env, stop)
        _recorded_notice(cfg, env, stop)
        if env.rank == 0:
            events = EventLog(
                Path(cfg.run.dir) / "events.jsonl", rank=0, restart=env.restart_count, attempt=env.attempt
            )
            open_attempt(
                attempt_context(cfg, env, events, rank=0),
                nodes=expand_nodelist(os.environ.get("SLURM_JOB_NODELIST", env.hostname)),
                launcher="slurm",
                restart_in_allocation=env.restart_in_allocation,
            )
    return run_rank(cfg, env, stop=stop)


def _missed_warning(cfg: JobConfig, env: DistEnv, stop: StopSignals) -> None:
    """Under torchrun, ranks restarted inside the time limit's warning lead (launcher.signal_delay_s before EndTime)
    may have missed the warning: while torchrun restarted them, no process took USR2 (the agent ignores it, the
    new ranks inherit that until their handlers are in place). Rank 0 then records it as arrived; the ranks agree
    on it at their first step (or the watchdog's stop path during start-up) and requeue, as the supervisor of the
    srun style refuses such a restart."""
    if env.rank != 0 or env.restart_in_allocation == 0 or not env.job_id:
        return
    left = seconds_left(env.job_id)
    if left is not None and left <= cfg.launcher.signal_delay_s:
        print(
            f"meshjob: restarted {left:.0f} s before the time limit <= launcher.signal_delay_s"
            f"({cfg.launcher.signal_delay_s}): taken as its warning (SIGUSR2)",
            flush=True,
        )
        stop.note(signal.SIGUSR2)


def _recorded_notice(cfg: JobConfig, env: DistEnv, stop: StopSignals) -> None:
    """Under torchrun, rank 0 takes a stop notice that an agent of this allocation recorded (a USR2 that came while
    no rank was there to take it, `jobs.launch.stop_notice`) as arrived: the ranks agree on it at their first step
    (or the watchdog's stop path during start-up) and requeue."""
    if env.rank != 0 or stop.arrived():
        return
    notice = read_notice(notice_path(cfg.run.dir, env.job_id, env.restart_count))
    if notice is not None:
        print(
            f"meshjob: {notice.get('signal')} reached this allocation's agent on {notice.get('host')} while no rank "
            "was there to take it: taken as arrived",
            flush=True,
        )
        stop.note(NOTICE_SIGNAL)


def _ended_for_good(cfg: JobConfig, env: DistEnv) -> int | None:
    """Under torchrun, whose agents restart the ranks after any failure, up to --max-restarts times: the
    exit code of the newest decision of this allocation when it was anything but "restart" (a stop, or
    a requeue in progress), so that the ranks do not train again; None to go on. The attempts that
    ended here published no decision of their own: the search goes back past them."""
    for n in range(env.restart_in_allocation - 1, -1, -1):
        d = read_decision(cfg.run.dir, attempt_name(env.job_id, env.restart_count, n), wait_s=0)
        if d is None:
            continue
        if d["action"] == "restart":
            return None
        print(
            f"meshjob: attempt {attempt_name(env.job_id, env.restart_count, n)} decided {d['action']} "
            f"({d['reason']}): not training again",
            flush=True,
        )
        return int(d["exit_code"])
    return None


# torchrun's agent handles these itself (its default is SIGTERM,SIGINT,SIGHUP,SIGQUIT); SIGTERM is left out.
AGENT_SIGNALS = "SIGINT,SIGHUP,SIGQUIT"


def agent_main(argv: list[str]) -> int:
    """torchrun (`torch.distributed.run`) as the node's agent, keeping the ranks' protocol in three ways.
    `--run-dir=RUN_DIR` first: a USR2 that reaches the agent is recorded for the ranks it starts next
    (`jobs.launch.stop_notice`), so one sent while torchrun restarts them is not lost.
    SIGTERM stays with the ranks: torch's agent would catch it (TORCHELASTIC_SIGNALS_TO_HANDLE), signal
    its ranks again and SIGKILL them after its shutdown timeout (30 s), in the middle of their save,
    while the script's `trap "" TERM` leaves the agent ignoring it. And the ranks' exit code is the
    agent's: torch re-raises their failure as ChildFailedError (exit 1), and 76 ("do not requeue") must
    reach Slurm as 76."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    if argv and argv[0].startswith("--run-dir="):  # ours, not torchrun's: where a USR2 without ranks is recorded
        run_dir, argv = argv[0].removeprefix("--run-dir="), argv[1:]
        record_notices(notice_path(run_dir, slurm_job_id(os.environ), int(os.environ.get("SLURM_RESTART_COUNT", 0))))
    try:
        torchrun([f"--signals-to-handle={AGENT_SIGNALS}", *argv])
    except ChildFailedError as e:
        return agent_exit_code([f.exitcode for f in e.failures.values()])
    return exitcodes.OK


def agent_exit_code(codes: list[int]) -> int:
    """One exit code for a node's failed ranks (their last start): `exitcodes.most_final`."""
    return exitcodes.most_final(codes)


class SlurmJob:
    """The submitit callable, run once per allocation in the batch step: the supervisor of the ranks.
    Requeues re-run it as is (Slurm requeues the same batch script)."""

    def __init__(self, cfg: JobConfig) -> None:
        self.cfg = cfg

    def __call__(self) -> int:
        from jobs.launch.supervise import guarded

        folder, job = submitit.JobEnvironment().paths.folder, slurm_job_id(os.environ)
        code = guarded(self.cfg, logs=(f"{folder}/{job}_%t_log.out", f"{folder}/{job}_%t_log.err"))
        if code != exitcodes.OK:
            raise SystemExit(code)  # Slurm records the job's exit code (sacct ExitCode)
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
    if cfg.train.device == "cuda" and not cl.gpus_per_node:
        raise ValueError(
            f"train.device=cuda but cluster={cl.name} has cluster.gpus_per_node=0 (no GPUs requested): "
            "pick a GPU profile (e.g. cluster=h100_ib) or set train.device=auto"
        )
    if cl.time_min * 60 <= ln.signal_delay_s:
        raise ValueError(
            f"launcher.signal_delay_s({ln.signal_delay_s}) >= cluster.time_min({cl.time_min}) * 60: the "
            "time-limit warning would come before the job starts; lower launcher.signal_delay_s"
        )
    if ln.array_parallelism < 0:
        raise ValueError(f"launcher.array_parallelism({ln.array_parallelism}) must be >= 0 (0 = all at once)")


def check_signal_lead(cfg: JobConfig) -> None:
    """No requeue on a signal without checkpoints; failure.checkpoint_timeout_s covers the predicted
    checkpoint writes; and the time-limit warning leaves time for the stop path (one step, a save and
    the whole of its write, after a save in flight) and a margin (the planner's analytic estimates;
    skipped when the profile has no GPU figures)."""
    from jobs.planner.gate import build_plan
    from jobs.validate import check_checkpoint_timeout, stop_path_s

    if cfg.failure.requeue_signals and not cfg.checkpoint.enabled:
        raise ValueError(
            f"failure.requeue_signals={list(cfg.failure.requeue_signals)} with checkpoint.enabled=false: "
            "every requeue would start again from step 0; set checkpoint.enabled=true, or "
            "failure.requeue_signals=[] to let a signal end the job"
        )
    if not cfg.failure.requeue_signals or cfg.cluster.gpu_bf16_tflops <= 0:
        return
    plan = build_plan(cfg, measure=False)
    ck, mode = plan.checkpoint, cfg.checkpoint.async_mode
    check_checkpoint_timeout(cfg.failure, write_s=ck.get("write_s", 0.0), async_mode=mode)
    step_s = plan.step.get("step_s_at_mfu", 0.0)
    save_s = stop_path_s(
        step_s=0.0, blocking_s=ck.get("blocking_s", 0.0), write_s=ck.get("write_s", 0.0), async_mode=mode
    )
    need = step_s + save_s + cfg.failure.signal_margin_s
    if cfg.launcher.signal_delay_s < need:
        raise ValueError(
            f"launcher.signal_delay_s({cfg.launcher.signal_delay_s}) < one step ({step_s:.0f} s) + a save and the whole "
            f"of its write after any save in flight ({save_s:.0f} s, checkpoint.async_mode={mode}) + "
            f"failure.signal_margin_s({cfg.failure.signal_margin_s:.0f}) = {need:.0f} s (planner "
            f"estimates for cluster={cfg.cluster.name}): the job would be killed before it saved; set "
            f"launcher.signal_delay_s={int(need) + 1}"
        )


def login_checks(cfg: JobConfig) -> None:
    from jobs.validate import validate

    validate(cfg)
    check_slurm_config(cfg)
    check_signal_lead(cfg)


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
    # The batch step runs the supervisor (use_srun=False); it starts the ranks with srun itself
    # (jobs.launch.supervise: --kill-on-bad-exit=0, the container flags; with spares, on launcher.nodes of them).
    params: dict[str, Any] = dict(
        job_name=job_name,
        nodes=ln.nodes + ln.spare_nodes,
        ntasks_per_node=ln.tasks_per_node,
        cpus_per_task=cl.cpus_per_task,
        time=cl.time_min,
        signal_delay_s=ln.signal_delay_s,
        use_srun=False,
        setup=[*cl.setup, *(f"export {k}={shlex.quote(str(v))}" for k, v in cl.env.items())],
        # --no-kill with spares: a failed node leaves the allocation instead of ending it (jobs.failure.spares)
        additional_parameters={"requeue": True, **({"no_kill": True} if ln.spare_nodes else {})},
        array_parallelism=ln.array_parallelism or 256,
    )
    # The run's quarantine list (jobs.failure.quarantine) is excluded from every later submission too.
    exclude = ",".join(
        dict.fromkeys(
            [
                *filter(None, (cl.exclude or "").split(",")),
                *_known_quarantined(cfg.run.dir, ttl_h=cfg.failure.quarantine_ttl_h),
            ]
        )
    )
    optional = dict(partition=cl.partition, account=cl.account, qos=cl.qos, constraint=cl.constraint, exclude=exclude)
    params.update({k: v for k, v in optional.items() if v})
    if cl.gpus_per_node:
        params["gpus_per_node"] = cl.gpus_per_node
    if cl.mem_per_node_gb:
        params["mem"] = f"{cl.mem_per_node_gb}G"
    ex.update_parameters(**params)
    return ex


def _known_quarantined(run_dir: str, *, ttl_h: float = 0.0) -> list[str]:
    """The run's quarantined nodes that Slurm knows: sbatch refuses a job whose --exclude names a node it does
    not know (one since removed or renamed), so those are left out and named on stderr; all of them when
    sinfo cannot say."""
    listed = list(dict.fromkeys(e["node"] for e in quarantined(run_dir, ttl_h=ttl_h)))
    known = known_nodes() if listed else None
    if known is None:
        return listed
    dropped = [n for n in listed if n not in known]
    if dropped:
        print(
            f"warning: quarantined node(s) {', '.join(dropped)} ({run_dir}/quarantine.json) unknown to Slurm: "
            "not excluded",
            file=sys.stderr,
        )
    return [n for n in listed if n in known]


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
        prepare_inputs(cfg)  # the data file matches the model: refused before the run dir is touched
        claim_run_dir(cfg, launcher="slurm")  # another run or a live job there: refused before sbatch
        run_dir = prepare_run(cfg)
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    folder = run_dir / "slurm"
    try:
        job = make_executor(cfg, folder / "%j", job_name=f"meshjob-{cfg.model.name}").submit(SlurmJob(cfg))
    except submitit.core.utils.FailedJobError as e:
        print(f"error: sbatch refused the job (run dir {run_dir} kept): {str(e).strip()}", file=sys.stderr)
        return exitcodes.ENV_ERROR
    record_job(run_dir, job.job_id)
    out = folder / job.job_id
    print(f"submitted job {job.job_id}: {cfg.world_size} ranks ({cfg.world_size_expr}), cluster={cfg.cluster.name}")
    print(f"run dir  {run_dir}")
    print(f"logs     {out}/{job.job_id}_<rank>_log.out|err (appended across requeues)")
    print(f"metrics  {run_dir / 'metrics.jsonl'}")
    print(
        f"status   python -m jobs.status {run_dir}   (sacct -j {job.job_id} --duplicates -o JobID,State,ExitCode,NodeList)"
    )
    sys.stdout.flush()
    if not cfg.launcher.wait:
        return exitcodes.OK
    return wait_for_job(job.job_id, run_dir)


_MODES = ("--supervise", "--rank-config", "--prepare", "--rank", "--agent", "--after-agents")


def _script_cli(mode: str, argv: list[str], stop: StopSignals) -> int:
    """The steps of a rendered sbatch script. srun style: `--supervise OVERRIDES` (the batch step:
    prepare, then run the ranks, restarting them inside the allocation), `--rank-config PATH [--task-exits DIR]`
    (every rank, started by the supervisor; the srun task watches it and writes its exit record to DIR). torchrun style: `--prepare OVERRIDES` (the batch step, once),
    `--agent TORCHRUN_ARGS` (one per node), `--rank OVERRIDES` (every rank, started by the agent) and
    `--after-agents CODE OVERRIDES` (the batch step again, with the agents' srun exit code: the job's exit code)."""
    from jobs.config import compose
    from jobs.launch.supervise import after_agents, guarded, load_rank_config

    if mode == "--agent":
        return agent_main(argv)
    if mode == "--rank-config":
        return rank_main(load_rank_config(argv[0]), stop)
    if mode == "--after-agents":  # the agents' srun exit code, then the overrides
        try:
            code, cfg = int(argv[0]), compose(argv[1:])
        except Exception as e:  # noqa: BLE001 - as below
            print(f"config error: {e}", file=sys.stderr)
            return exitcodes.CONFIG_ERROR
        return after_agents(cfg, step_code=code)
    try:
        cfg = compose(argv)
        if mode != "--rank":
            login_checks(cfg)
    except Exception as e:  # noqa: BLE001 - ValueError from the checks or any Hydra composition error
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    if mode == "--rank":
        return rank_main(cfg, stop)
    try:  # the batch step, at every start of the job: its own earlier attempts are its own
        prepare_inputs(cfg)
        claim_run_dir(cfg, launcher="slurm", job_id=slurm_job_id(os.environ))
    except ValueError as e:
        print(f"config error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    prepare_run(cfg)
    if mode == "--prepare":
        return exitcodes.OK
    logs = f"{cfg.run.dir}/slurm/%j_r{{attempt}}_rank%t"
    return guarded(cfg, logs=(f"{logs}.out", f"{logs}.err"))


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in _MODES:
        print(
            "usage: python -m jobs.launch.slurm --supervise|--prepare|--rank [OVERRIDES...] | "
            "--rank-config PATH [--task-exits DIR] | "
            "--agent TORCHRUN_ARGS... | --after-agents SRUN_EXIT_CODE [OVERRIDES...]  "
            "(the steps of a script rendered by `python -m jobs.sbatch`; submit jobs with "
            "`python -m jobs.train launcher=slurm`)",
            file=sys.stderr,
        )
        sys.exit(exitcodes.CONFIG_ERROR)
    exitcodes.exit_command(_script_cli(sys.argv[1], sys.argv[2:], _stop))  # every rank, agent and batch step ends here
