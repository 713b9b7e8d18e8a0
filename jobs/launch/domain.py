"""A node's failure domain, for the RAM tier's partner ring: its leaf switch where Slurm's topology.conf names one,
else its physical host (the kernel's boot id, which every slurmd container on one machine shares)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from jobs.launch.env import expand_nodelist

__all__ = ["failure_domain", "leaf_switch", "topology_path"]

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def topology_path(env: Mapping[str, str] = os.environ) -> Path:
    """Slurm's topology.conf: next to the slurm.conf that SLURM_CONF names, else under /etc/slurm."""
    conf = env.get("SLURM_CONF")
    return (Path(conf).parent if conf else Path("/etc/slurm")) / "topology.conf"


def leaf_switch(hostname: str, text: str) -> str | None:
    """The switch whose `Nodes=` (a leaf switch's line in topology.conf) lists `hostname`, or None."""
    for line in text.splitlines():
        fields = dict(kv.split("=", 1) for kv in line.split("#", 1)[0].split() if "=" in kv)
        if "SwitchName" in fields and "Nodes" in fields and hostname in expand_nodelist(fields["Nodes"]):
            return fields["SwitchName"]
    return None


def failure_domain(hostname: str, *, topology: Path | None = None, boot_id: Path = BOOT_ID) -> str:
    """`switch:<name>` when `topology` lists the node under a leaf switch, else `host:<boot id>` (else the host
    name, when the boot id cannot be read). Two nodes of one domain go down together."""
    try:
        switch = leaf_switch(hostname, topology.read_text()) if topology is not None and topology.is_file() else None
    except OSError:
        switch = None
    if switch:
        return f"switch:{switch}"
    try:
        return f"host:{boot_id.read_text().strip()}"
    except OSError:
        return f"host:{hostname}"
