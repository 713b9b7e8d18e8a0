"""What every rank runs, under any launcher: rendezvous, train, tear down, and say how it ended."""

from __future__ import annotations

import logging
import os
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from jobs import exitcodes
from jobs.config import JobConfig
from jobs.launch.env import DistEnv
from jobs.events import EventLog
from jobs.log import setup_logging

__all__ = ["run_rank"]


def run_rank(cfg: JobConfig, env: DistEnv) -> int:
    """Trains this rank's share of `cfg`; returns an exit code from `jobs.exitcodes` (never raises)."""
    from jobs.validate import validate  # the same checks as on the login node, now on every rank

    log = setup_logging(env.rank)
    events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=env.rank, restart=env.restart_count)
    try:
        derived = validate(cfg)
    except ValueError as e:
        log.error("config error: %s", e)
        return exitcodes.CONFIG_ERROR
    threads = cfg.launcher.threads_per_rank or max(1, (os.cpu_count() or 1) // env.local_world_size)
    torch.set_num_threads(threads)
    if cfg.train.deterministic and torch.cuda.is_available():  # bitwise resume needs deterministic kernels
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    # DTensor warns on every grad-norm redistribute over the 2-D (dp_shard, tp) mesh; it is expected here.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    trainer = None
    try:
        os.environ.update(env.torch_environ())
        dist.init_process_group(
            "gloo", init_method="env://", rank=env.rank, world_size=env.world_size,
            timeout=timedelta(seconds=cfg.launcher.pg_timeout_s),
        )
        if env.rank == 0:
            events.emit("rendezvous", world_size=env.world_size, master=f"{env.master_addr}:{env.master_port}",
                        nodes=env.nodes, job_id=env.job_id)
        from jobs.trainer import Trainer

        trainer = Trainer(cfg, derived, env, events=events)
        return exitcodes.OK if trainer.fit() else exitcodes.REQUEUE
    except FloatingPointError as e:
        log.error("%s", e)
        events.emit("failure", cls="nan_loss", error=str(e))
        return exitcodes.FAILED
    except (RuntimeError, dist.DistError) as e:
        log.error("distributed/runtime error: %s\n%s", e, traceback.format_exc())
        events.emit("failure", cls="runtime_error", error=str(e)[:2000])
        return exitcodes.ENV_ERROR
    except Exception as e:  # noqa: BLE001 - the rank reports and exits; the launcher decides
        log.error("unexpected error: %s\n%s", e, traceback.format_exc())
        events.emit("failure", cls="exception", error=f"{type(e).__name__}: {e}"[:2000])
        return exitcodes.FAILED
    finally:
        if trainer is not None:
            trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()
