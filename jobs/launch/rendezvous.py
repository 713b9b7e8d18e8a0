"""Rendezvous: the world process group, on a port nobody has to guess.

With a pinned port (torchrun's, or `launcher.master_port`) ranks meet through torch's env:// contract.
Without one (the local launcher, Slurm), rank 0 opens the TCPStore on a port the
kernel picks and publishes `host:port` in `RUN_DIR/rendezvous/<attempt>.json` on the shared
filesystem; the others wait for that file. No port is derived from the job id, so two jobs on one
node never collide and no port is taken from the ephemeral range by guesswork.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from jobs.launch.env import DistEnv, attempt_name

__all__ = ["rendezvous", "port_file", "agreed_torchrun_restart"]


def port_file(run_dir: str | os.PathLike[str], attempt: str) -> Path:
    return Path(run_dir) / "rendezvous" / f"{attempt}.json"


def _under_agent_store(env: DistEnv) -> bool:
    return bool(env.master_port) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def agreed_torchrun_restart(env: DistEnv, *, timeout_s: float) -> DistEnv:
    """Under torchrun, the DistEnv with `restart_in_allocation` every rank of this worker group agrees on.
    TORCHELASTIC_RESTART_COUNT is each agent's own: the agent of a node whose rank failed counts the restart,
    the agent that restarts its healthy ranks because another node left the round (a membership change)
    does not, so ranks of one group could name different attempts and wait in different PrefixStores
    until the watchdog requeued the job (seen in CI). Each rank counts its own starts in the agents'
    store, which outlives the ranks' restarts; torchrun starts every rank again on every restart, so the
    n-th start of each rank belongs to the same group. Other launchers: `env` unchanged."""
    if not _under_agent_store(env):
        return env
    store = dist.TCPStore(
        env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    starts = store.add(f"meshjob/{attempt_name(env.job_id, env.restart_count)}/starts/rank{env.rank}", 1)
    return replace(env, restart_in_allocation=starts - 1)


def rendezvous(env: DistEnv, *, run_dir: str, timeout_s: float, backend: str = "gloo") -> DistEnv:
    """Joins the world group; returns the DistEnv with the port actually used. RuntimeError on timeout."""
    timeout = timedelta(seconds=timeout_s)
    if _under_agent_store(env):
        # Under torchrun the agents' store outlives a restart of the ranks and env:// writes no prefix
        # per restart: the restarted ranks read the dead ranks' gloo addresses ("Connection refused",
        # seen on the torchrun-style script's first restart). A prefix per attempt keeps them apart.
        os.environ.update(env.torch_environ())
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout)
        dist.init_process_group(
            backend,
            store=dist.PrefixStore(f"meshjob/{env.attempt}", store),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timeout,
        )
        return env
    if env.master_port:
        os.environ.update(env.torch_environ())
        dist.init_process_group(
            backend, init_method="env://", rank=env.rank, world_size=env.world_size, timeout=timeout
        )
        return env
    store, env = _published_store(env, port_file(run_dir, env.attempt), timeout)
    os.environ.update(env.torch_environ())
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    return env


def _published_store(env: DistEnv, path: Path, timeout: timedelta) -> tuple[dist.Store, DistEnv]:
    if env.rank == 0:
        store = dist.TCPStore(
            env.master_addr, 0, env.world_size, is_master=True, timeout=timeout, wait_for_workers=False
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"host": env.master_addr, "port": store.port, "time": time.time()}))
        os.replace(tmp, path)
        return store, replace(env, master_port=store.port)
    deadline = time.monotonic() + timeout.total_seconds()
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"rendezvous timed out: rank 0 never published {path} within "
                f"failure.init_timeout_s({timeout.total_seconds():.0f})"
            )
        time.sleep(0.1)
    where = json.loads(path.read_text())
    store = dist.TCPStore(where["host"], int(where["port"]), env.world_size, is_master=False, timeout=timeout)
    return store, replace(env, master_addr=where["host"], master_port=int(where["port"]))
