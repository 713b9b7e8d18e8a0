"""The RAM tier at the edges of a Slurm allocation: SCR's scavenge, then the run's RAM folders removed on every node.

Run at the end of every allocation (the supervisor, or its guard when it died, once the last attempt ended: success,
exit 2, 77, a final failure; whoever requeues, before `scontrol requeue`: after it Slurm starts no step in the job;
jobs/launch/supervise.py's `_supervisor_context` and `_end_allocation` are where) and at the start of the next one,
before any rank (what an allocation that could not scavenge left on these nodes: a requeue by Slurm, a killed batch
step). Each round is one `srun --overlap` of `python -m checkpoint.scavenge` per node, all at once, each bounded:
    list   every node's committed RAM copies of this run -> `plan_flush`: the newest step every rank holds from one
           save that is newer than the filesystem's newest committed step (none at exit 77: a diverged state is never
           made the newest checkpoint)
    flush  the nodes that hold the chosen copies write them into `step_<N>.scavenge-<tag>.tmp`; committed here
           (checkpoint/scavenge_commit.py) only when every rank's copy arrived
    clean  every node removes the run's RAM folder
A node that does not answer in time is left as it is (its folder goes at the next allocation on it, or never when
the job never runs there again: the limit of doing this from inside the job). Nothing here raises: the outcome is
one `ram_scavenged` record, and the requeue or exit goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from checkpoint.scavenge import flush_tmp, newest_committed, plan_flush
from jobs.config import JobConfig
from jobs.events import EventLog
from jobs.launch.rundir import memory_root, run_id
from jobs.log import get_logger

__all__ = ["scavenge_allocation", "node_command"]


def node_command(cfg: JobConfig, node: str, args: list[str]) -> list[str]:
    """One task on `node` of the current job running `python -m checkpoint.scavenge ARGS`, beside any step."""
    cl = cfg.cluster
    cmd = ["srun", "--overlap", "--quiet", "--job-name=meshjob-scavenge", f"--nodelist={node}"]
    cmd += ["--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if cl.container_image:
        cmd.append(f"--container-image={cl.container_image}")
    if cl.container_mounts:
        cmd.append(f"--container-mounts={cl.container_mounts}")
    return [*cmd, sys.executable, "-m", "checkpoint.scavenge", *args]


def _on_nodes(
    cfg: JobConfig, nodes: list[str], args: Callable[[str], list[str] | None], deadline: float
) -> tuple[dict[str, Any], dict[str, str]]:
    """Runs one round on `nodes` at once (`args(node)`: its arguments, None: none there); ({node: its JSON},
    {node: why it gave none}) by `deadline` (monotonic), past which the rest are killed."""
    # the step's own SLURM_* (task counts, binding) would shape these steps: only the job's identity goes along
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k in ("SLURM_JOB_ID", "SLURM_CONF")}
    procs = {}
    for node in nodes:
        a = args(node)
        if a is not None:
            cmd = node_command(cfg, node, a)
            procs[node] = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, failed = {}, {}
    for node, p in procs.items():
        try:
            so, se = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.terminate()  # srun cancels its step on the first SIGTERM
            try:
                p.communicate(timeout=2)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()
            failed[node] = "no answer in time"
            continue
        try:
            out[node] = json.loads(so.strip().splitlines()[-1])
        except (IndexError, ValueError):
            failed[node] = f"exit {p.returncode}: {(se or so).strip()[-300:]}"
    return out, failed


def scavenge_allocation(
    cfg: JobConfig, nodes: list[str], *, when: str, events: EventLog, flush: bool = True, timeout_s: float = 0.0
) -> dict[str, Any] | None:
    """Flushes the newest RAM step above the filesystem's (unless `flush` is False) and removes the run's RAM
    folders on `nodes`, within `timeout_s` (checkpoint.scavenge_timeout_s when 0); records and returns the outcome
    (`ram_scavenged`), None when the RAM tier is off. Never raises."""
    ck = cfg.checkpoint
    if not ck.enabled or not ck.memory_on or not nodes:
        return None
    t0, log = time.monotonic(), get_logger()
    deadline = t0 + (timeout_s or ck.scavenge_timeout_s)
    facts: dict[str, Any] = {"when": when, "nodes": nodes, "flushed_step": None}
    try:
        facts.update(_scavenge(cfg, nodes, deadline, flush=flush))
    except Exception as e:  # noqa: BLE001 - the end of the allocation goes on whatever happens here
        facts["error"] = f"{type(e).__name__}: {e}"[:2000]
    facts["seconds"] = round(time.monotonic() - t0, 3)
    events.emit("ram_scavenged", **facts)
    if facts.get("error") or facts.get("failed_nodes"):
        log.warning("RAM tier scavenge (%s): %s %s", when, facts.get("error", ""), facts.get("failed_nodes", ""))
    return facts


def _scavenge(cfg: JobConfig, nodes: list[str], deadline: float, *, flush: bool) -> dict[str, Any]:
    root, folder = memory_root(cfg), Path(cfg.run.dir) / "checkpoints"
    gone = _unreachable(nodes)
    listed, failed = _on_nodes(
        cfg, [n for n in nodes if n not in gone], lambda n: ["list", str(root)], _share(deadline, 4)
    )
    failed.update(gone)
    nodes = [n for n in nodes if n not in failed]  # a node that did not answer is not asked again
    newest = newest_committed(folder)
    plan = plan_flush(listed, newer_than=newest, run_id=run_id(cfg.run.dir)) if flush else None
    facts: dict[str, Any] = {"filesystem_step": newest, "ram_steps": _steps(listed)}
    if plan is not None:
        tmp = flush_tmp(folder, plan.step, f"{os.getpid()}-{time.time_ns()}")
        size = ["--size"] if cfg.checkpoint.verify == "size" else []
        copied, why = _on_nodes(
            cfg,
            nodes,
            lambda n: (
                ["flush", str(root), str(tmp), str(plan.step), json.dumps(plan.shares(n)), *size]
                if plan.shares(n)
                else None
            ),
            _share(deadline, 3),
        )
        problems = [f"{n}: {p}" for n, r in copied.items() for p in r.get("problems", [])]
        problems += [f"{n}: {w}" for n, w in why.items()]
        try:
            if problems:
                raise RuntimeError("; ".join(problems)[:1500])
            _commit(cfg, folder, tmp, plan.to_json(), env=_env_of(folder, newest), deadline=_share(deadline, 2))
            facts["flushed_step"] = plan.step
        except Exception as e:  # noqa: BLE001 - recorded; the folders are removed all the same
            shutil.rmtree(tmp, ignore_errors=True)
            facts["flush_error"] = f"step {plan.step}: {e}"[:2000]
            if newest_committed(folder) >= plan.step:  # the bound ran out after the commit's rename: it is whole
                facts["flushed_step"] = plan.step
    cleaned, why = _on_nodes(cfg, nodes, lambda n: ["clean", str(root)], deadline)
    failed.update(why)
    facts["removed_bytes"] = sum(int(r.get("removed_bytes", 0)) for r in cleaned.values())
    if failed:
        facts["failed_nodes"] = failed
    return facts


def _commit(cfg: JobConfig, folder: Path, tmp: Path, plan: str, *, env: dict | None, deadline: float) -> None:
    """checkpoint/scavenge_commit.py in a process of its own, by `deadline`; raises what went wrong."""
    cmd = [sys.executable, "-m", "checkpoint.scavenge_commit", str(folder), str(tmp), plan, str(cfg.world_size)]
    r = subprocess.run(
        [*cmd, json.dumps(env)], capture_output=True, text=True, timeout=max(0.1, deadline - time.monotonic())
    )
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        out = {"error": f"exit {r.returncode}: {r.stderr.strip()[-500:]}"}
    if "committed" not in out:
        raise RuntimeError(out.get("error"))


def _unreachable(nodes: list[str]) -> dict[str, str]:
    """{node: why} of the nodes Slurm says are down or not responding (a step there would wait out its share);
    {} when sinfo cannot say."""
    try:
        r = subprocess.run(
            ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out = {}
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        node, _, state = line.partition(" ")
        if state.endswith("*") or state.strip() in ("down", "fail", "failg"):
            out[node] = f"not reachable (sinfo: {state.strip()})"
    return out


def _share(deadline: float, rounds: int) -> float:
    """The deadline of the next of `rounds` rounds left: an equal share of the time left (a node that hangs in
    one round leaves the others their time)."""
    now = time.monotonic()
    return now + max(0.0, deadline - now) / rounds


def _steps(listed: dict[str, Any]) -> list[int]:
    """Every RAM step some node held of this run (for the record)."""
    return sorted({int(s) for nodes in listed.values() for fs in nodes.values() for st in fs.values() for s in st})


def _env_of(folder: Path, step: int) -> dict | None:
    """The environment fingerprint of the filesystem's newest step (the flushed step's manifest carries it, so a
    resume compares the environment as for any save), None when there is none."""
    try:
        return json.loads((folder / f"step_{step}" / "manifest.json").read_bytes()).get("env")
    except (OSError, ValueError):
        return None
