"""DistEnv: the one object through which a rank learns where it is (rank, world, master, restarts).

Two sources fill it: the local launcher (torch's standard RANK/WORLD_SIZE/... variables) and Slurm
(SLURM_PROCID/SLURM_NTASKS/SLURM_JOB_NODELIST/...). Nothing else in the project reads os.environ
for these facts.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["DistEnv", "expand_nodelist", "attempt_name", "slurm_job_id", "RESTART_IN_ALLOCATION_VAR", "parse_hostlist"]

# Set by the supervisor (jobs.launch.supervise) on every srun step it starts: 0, 1, 2, ...
RESTART_IN_ALLOCATION_VAR = "MESHJOB_RESTART_IN_ALLOCATION"


def attempt_name(job_id: str | None, restart_count: int, restart_in_allocation: int = 0) -> str:
    base = f"{job_id or 'local'}.{restart_count}"
    return f"{base}.{restart_in_allocation}" if restart_in_allocation else base


@dataclass(frozen=True, slots=True)
class DistEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    nodes: int
    master_addr: str
    master_port: int
    restart_count: int = 0  # 0 on the first run; Slurm's SLURM_RESTART_COUNT after requeues
    restart_in_allocation: int = 0  # 0 on the first start in this allocation; n after n restarts inside it
    job_id: str | None = None  # Slurm job id (ARRAY_TASK form for array elements), None locally
    hostname: str = ""
    torchrun: bool = False  # the ranks are torchrun's workers (its agents restart them; TORCHELASTIC_RUN_ID set)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        """Reads the launcher's contract: Slurm's variables when inside a Slurm step, torch's otherwise."""
        env = os.environ if environ is None else environ
        # Under torchrun inside a Slurm job, SLURM_PROCID/SLURM_NTASKS count torchrun agents (one per
        # node), not ranks: torchrun's own variables are the truth there.
        under_torchrun = "TORCHELASTIC_RUN_ID" in env
        if not under_torchrun and "SLURM_PROCID" in env and "SLURM_NTASKS" in env and "SLURM_JOB_ID" in env:
            return cls._from_slurm(env)
        return cls._from_torch(env)

    @classmethod
    def _from_torch(cls, env: Mapping[str, str]) -> DistEnv:
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing:
            raise RuntimeError(
                f"rank environment incomplete: {', '.join(missing)} not set; start ranks with "
                "`python -m jobs.train` (local launcher) or under Slurm (launcher=slurm)"
            )
        world = int(env["WORLD_SIZE"])
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        return cls(
            rank=int(env["RANK"]),
            local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
            world_size=world,
            local_world_size=local_world,
            node_rank=int(env.get("GROUP_RANK", 0)),
            nodes=max(1, world // max(1, local_world)),
            master_addr=env["MASTER_ADDR"],
            master_port=int(env["MASTER_PORT"]),
            restart_count=int(env.get("MESHJOB_RESTART_COUNT") or env.get("SLURM_RESTART_COUNT") or 0),
            # torchrun's agents restart the ranks inside the allocation (the torchrun-style sbatch script)
            restart_in_allocation=int(env.get(RESTART_IN_ALLOCATION_VAR) or env.get("TORCHELASTIC_RESTART_COUNT") or 0),
            job_id=slurm_job_id(env) if "SLURM_JOB_ID" in env else None,  # torchrun inside a Slurm job
            hostname=env.get("SLURMD_NODENAME") or env.get("HOSTNAME") or os.uname().nodename,
            torchrun="TORCHELASTIC_RUN_ID" in env,
        )

    @classmethod
    def _from_slurm(cls, env: Mapping[str, str]) -> DistEnv:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST", "")
        hosts = expand_nodelist(nodelist) if nodelist else [os.uname().nodename]
        world = int(env["SLURM_NTASKS"])
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_JOB_NUM_NODES") or len(hosts))
        job_id = slurm_job_id(env)
        port = env.get("MASTER_PORT")
        return cls(
            rank=int(env["SLURM_PROCID"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            world_size=world,
            local_world_size=max(1, world // max(1, nodes)),
            node_rank=int(env.get("SLURM_NODEID", 0)),
            nodes=nodes,
            master_addr=env.get("MASTER_ADDR") or hosts[0],
            master_port=int(port) if port else 0,  # 0: rank 0 publishes the port it got (jobs.launch.rendezvous)
            restart_count=int(env.get("SLURM_RESTART_COUNT", 0)),
            restart_in_allocation=int(env.get(RESTART_IN_ALLOCATION_VAR, 0)),
            job_id=job_id,
            hostname=env.get("SLURMD_NODENAME", os.uname().nodename),
        )

    @property
    def attempt(self) -> str:
        """This start of the job's ranks, as the ledger names it: `<job id>.<restart>`, then
        `<job id>.<restart>.<n>` after n restarts inside the allocation; `local.<n>` locally."""
        return attempt_name(self.job_id, self.restart_count, self.restart_in_allocation)

    def torch_environ(self) -> dict[str, str]:
        """The variables torch's env:// rendezvous expects, for this rank."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def slurm_job_id(env: Mapping[str, str]) -> str:
    """The id `scontrol requeue` takes: ARRAY_TASK for array elements, the job id otherwise."""
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{array_task}" if array_job and array_task else env["SLURM_JOB_ID"]


def always_excluded(cfg) -> list[str]:
    """cluster.exclude as node names: the exclusion every `scontrol update ExcNodeList=` must keep (it replaces
    the job's whole list, the one sbatch got included)."""
    return expand_nodelist(cfg.cluster.exclude) if cfg.cluster.exclude else []


def expand_nodelist(nodelist: str) -> list[str]:
    """Expands a Slurm hostlist (`node[1-3,7],gpu01`) into host names, in Slurm's order.

    Uses `scontrol show hostnames` when available (the authority); falls back to a parser of the
    common forms so this works on a login node without Slurm too.
    """
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return parse_hostlist(nodelist)


_BRACKET_GROUP = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"(\d+)(?:-(\d+))?", re.ASCII)


def parse_hostlist(nodelist: str) -> list[str]:
    """Expands a hostlist as `scontrol show hostnames` does: any number of bracket groups per name,
    zero-padding to the width of each range's lower bound, commas or whitespace between names."""
    return [host for item in _split_top_level(nodelist) for host in _expand_item(item, nodelist)]


def _split_top_level(nodelist: str) -> list[str]:
    """The names of a hostlist: split at commas and whitespace outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in nodelist:
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ValueError(f"invalid hostlist {nodelist!r}: nested or unmatched brackets")
        if depth == 0 and (ch == "," or ch.isspace()):
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"invalid hostlist {nodelist!r}: unclosed bracket")
    parts.append("".join(cur))
    return [p for p in parts if p]


def _expand_item(item: str, nodelist: str) -> list[str]:
    """One name with k bracket groups, in Slurm's order: the last group varies fastest; before it, the
    groups vary from the first (fastest) to the one before last (slowest), as Slurm's hostlist.c
    recurses from the rightmost group of the prefix."""
    if "[" not in item:
        return [item]
    pieces = _BRACKET_GROUP.split(item)  # literal, group, literal, group, ..., literal
    literals, groups = pieces[0::2], pieces[1::2]
    if literals[-1] or any("[" in s or "]" in s for s in literals):
        raise ValueError(f"invalid hostlist {nodelist!r}: {item!r} must end with its last bracket group")
    values = [_expand_ranges(g, nodelist) for g in groups]
    order = [*range(len(groups) - 2, -1, -1), len(groups) - 1]  # slowest first
    hosts = []
    for combo in itertools.product(*(values[g] for g in order)):
        picked = dict(zip(order, combo))
        hosts.append("".join(lit + picked.get(g, "") for g, lit in enumerate(literals)))
    return hosts


def _expand_ranges(group: str, nodelist: str) -> list[str]:
    """The numbers of one bracket group (`001-002,010`), each padded to its range's lower-bound width."""
    out = []
    for rng in group.split(","):
        m = _RANGE.fullmatch(rng)
        if not m or int(m[2] or m[1]) < int(m[1]):
            raise ValueError(f"invalid hostlist {nodelist!r}: invalid range {rng!r}")
        out += [f"{i:0{len(m[1])}d}" for i in range(int(m[1]), int(m[2] or m[1]) + 1)]
    return out
