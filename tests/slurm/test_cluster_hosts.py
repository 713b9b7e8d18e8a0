"""The local cluster's nodes are separate hosts (scripts/slurm/start): each its own hostname, address, processes
and /dev/shm, while the run directory's disk is shared by all of them and by this (login) host."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

# Each task: writes a file into its node's /dev/shm and its report onto the shared disk, waits until every task
# has reported (so that all three files exist at once), then lists the /dev/shm files of this test and the slurmd
# processes it can see, and removes its file once every task has listed.
_TASK = """
import json, os, socket, sys, time
from pathlib import Path
tag, shared = sys.argv[1], Path(sys.argv[2])
node = os.environ["SLURMD_NODENAME"]
Path(f"/dev/shm/{tag}-{node}").write_text(node)
(shared / f"{node}.ready").write_text("")
while len(list(shared.glob("*.ready"))) < 3:
    time.sleep(0.05)
def comm(pid):
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:  # gone meanwhile
        return None
slurmds = [p for p in os.listdir("/proc") if p.isdigit() and comm(p) == "slurmd"]
report = {
    "hostname": socket.gethostname(),
    "address": socket.gethostbyname(socket.gethostname()),
    "shm": sorted(f for f in os.listdir("/dev/shm") if f.startswith(tag)),
    "slurmds": len(slurmds),
}
(shared / f"{node}.json").write_text(json.dumps(report))
while len(list(shared.glob("*.json"))) < 3:  # every task has listed /dev/shm before any file goes
    time.sleep(0.05)
os.unlink(f"/dev/shm/{tag}-{node}")
"""


def test_srun_on_three_nodes_sees_three_hosts_each_with_its_own_processes_and_dev_shm(tmp_path: Path) -> None:
    tag, shared = f"meshjob-hosts-{uuid.uuid4().hex[:8]}", tmp_path  # the disk is shared: every node sees tmp_path
    script = shared / "task.py"
    script.write_text(_TASK)
    p = subprocess.run(
        ["srun", "-N3", "--ntasks-per-node=1", "-t", "2", sys.executable, str(script), tag, str(shared)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    reports = {n: json.loads((shared / f"{n}.json").read_text()) for n in ("node1", "node2", "node3")}
    assert reports == {
        f"node{k}": {
            "hostname": f"node{k}",
            "address": f"10.99.0.{10 + k}",
            "shm": [f"{tag}-node{k}"],  # its own file only: the others' are on the other hosts' /dev/shm
            "slurmds": 1,  # its own slurmd only
        }
        for k in (1, 2, 3)
    }
    assert [f for f in Path("/dev/shm").iterdir() if f.name.startswith(tag)] == []  # nor on this host's
    assert socket.gethostname() not in {r["hostname"] for r in reports.values()}
