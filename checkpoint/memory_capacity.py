"""The RAM tier's bound: how many bytes a rank's state takes there and whether every host's
`checkpoint.memory_dir` holds them, checked before the first step (a config error naming the override when not)."""

from __future__ import annotations

import logging
import platform
import shutil
from pathlib import Path
from typing import Any

import torch

from checkpoint.errors import CheckpointConfigError
from checkpoint.group import Group
from checkpoint.partner import Placement
from checkpoint.statedict import local_tensor

log = logging.getLogger("meshjob.checkpoint")

__all__ = [
    "COPIES",
    "HEADROOM",
    "capacity_error",
    "cgroup_room",
    "check_capacity",
    "memory_available",
    "state_bytes",
]

COPIES = 2  # copies of a rank's state the tier holds at most: the committed one and one being written
HEADROOM = 1 << 30  # bytes per host the tier leaves free: NCCL's shm segments, the processes' own growth


def capacity_error(
    per_rank: list[tuple[str, int, int]],
    *,
    memory_dir: str,
    every: int,
    partners: list[int] | None = None,
    auto: bool = False,
) -> str | None:
    """Why the RAM tier does not fit, or None: per rank (host, bytes of its state, bytes the host's memory_dir
    offers the tier: its free bytes plus this run's copies there, the same for every rank of the host); a node needs COPIES x the sum of its ranks' states, plus COPIES x the states of the ranks
    whose partner copies it holds (`partners[r]`: rank r's partner; None = no partner copies). `auto`: the tier
    is on through checkpoint.memory_interval=auto (the message names that override)."""
    need: dict[str, int] = {}
    free: dict[str, int] = {}
    ranks: dict[str, int] = {}
    held: dict[str, int] = {}
    for node, nbytes, avail in per_rank:
        need[node] = need.get(node, 0) + COPIES * nbytes
        free[node] = max(free.get(node, 0), avail)
        ranks[node] = ranks.get(node, 0) + 1
    for r, p in enumerate(partners or []):
        node = per_rank[p][0]
        need[node] += COPIES * per_rank[r][1]
        held[node] = held.get(node, 0) + 1
    short = [n for n in sorted(need) if need[n] > free[n]]
    if not short:
        return None
    n = short[0]
    what = f"{ranks[n]} ranks' state" + (f" + {held[n]} partner copies" if held.get(n) else "")
    on, off = (
        ("checkpoint.memory_interval=auto", "checkpoint.memory_interval=steps checkpoint.memory_every_steps=0")
        if auto
        else (f"checkpoint.memory_every_steps={every}", "checkpoint.memory_every_steps=0")
    )
    return (
        f"{on}: the RAM tier needs {need[n] / 2**20:.1f} MiB on node {n} "
        f"({COPIES} copies x ({what})) but checkpoint.memory_dir={memory_dir} has "
        f"{free[n] / 2**20:.1f} MiB free there"
        + (f" (also short: {', '.join(short[1:])})" if len(short) > 1 else "")
        + "; point checkpoint.memory_dir at a larger tmpfs, spread the ranks over more nodes, "
        + ("set checkpoint.memory_replicas=0 (no partner copies), " if partners else "")
        + f"or set {off}"
    )


def state_bytes(objects: dict[str, Any]) -> int:
    """One rank's bytes in a checkpoint, from its bound objects (BoundState.objects) without building their state
    dict: the local shards of parameters and buffers, and the optimizer state; before the first step (no optimizer
    state yet) estimated as two moments per trainable parameter (AdamW, its dtype)."""
    size = lambda t: local_tensor(t).numel() * local_tensor(t).element_size()  # noqa: E731
    nbytes = sum(size(t) for part in objects["model_parts"] for t in (*part.parameters(), *part.buffers()))
    for opt in objects["optimizers"]:
        if opt.state:
            nbytes += sum(size(t) for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
        else:
            nbytes += sum(2 * size(p) for g in opt.param_groups for p in g["params"] if p.requires_grad)
    return nbytes


def memory_available(root: Path) -> int:
    """Bytes the host's checkpoint.memory_dir offers the tier (`root`: the tier's folder on this node,
    `memory_dir/meshjob-<run id>/<node>/`): its free bytes (at most what the memory cgroup still allows: under Slurm's
    ConstrainRAMSpace tmpfs pages count against the job) plus every copy of this run held there already (all its
    nodes' own and partner copies, `memory_dir/meshjob-<run id>/`: the new saves replace them), less HEADROOM. The
    same for every rank of a host (measured when none writes), so a host counts its copies once."""
    root.mkdir(parents=True, exist_ok=True)
    run_root = root.parent
    free, room = shutil.disk_usage(run_root).free, cgroup_room()
    return (free if room is None else min(free, room)) + _tree_bytes(run_root) - HEADROOM


def check_capacity(cfg: Any, at: Placement, *, nbytes: int, ctl: Group) -> None:
    """Raises CheckpointConfigError (a ValueError) on every rank when some host's checkpoint.memory_dir cannot
    hold COPIES of its ranks' states and of the partner copies it holds (`nbytes`: this rank's; `at`: where this
    rank's copies are; collective on `ctl`); every copy of this run held there already counts as free
    (`memory_available`), so a restart passes whenever the first start did. Hosts by their real name: simulated
    nodes on one host share its memory."""
    if not cfg.memory_on:
        return
    try:
        avail = memory_available(at.root)
    except OSError as e:
        avail = -1
        log.error("checkpoint.memory_dir=%s unusable on rank %d: %s", cfg.memory_dir, at.rank, e)
    gathered = ctl.all_gather((platform.node(), int(nbytes), int(avail)))
    why = capacity_error(
        gathered,
        memory_dir=cfg.memory_dir,
        every=cfg.memory_every_steps,
        partners=at.partners if at.replicas else None,
        auto=cfg.memory_interval == "auto",
    )
    if why is not None:
        raise CheckpointConfigError(why)


def cgroup_room(*, proc: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's memory cgroups still allow (the tightest of its cgroup and their ancestors: limit less
    usage, tmpfs pages included), cgroup v2 or v1; None when no limit is set or none can be read."""
    try:
        lines = proc.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, ctrl, path = line.split(":", 2)
        if ctrl == "":
            base, files = root, ("memory.max", "memory.current")
        elif "memory" in ctrl.split(","):
            base, files = root / "memory", ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        d = base / path.lstrip("/")
        while True:
            rooms.append(_room(d / files[0], d / files[1]))
            if d == base or base not in d.parents:
                break
            d = d.parent
    known = [r for r in rooms if r is not None]
    return min(known) if known else None


def _room(limit: Path, usage: Path) -> int | None:
    try:
        text, used = limit.read_text().strip(), int(usage.read_text())
    except (OSError, ValueError):
        return None
    if text == "max" or int(text) >= 1 << 60:  # v1 writes "no limit" as a page-rounded 2**63 - 1
        return None
    return max(0, int(text) - used)


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0
