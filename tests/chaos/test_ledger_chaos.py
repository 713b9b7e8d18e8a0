"""Several hosts writing one run's ledger, from outside: the cluster's three nodes, separate hosts sharing the run directory's disk, add
to one run's quarantine list and ledger at once (jobs/failure/quarantine.py, jobs/events.py). Both are written under
one O_EXCL lock file (jobs.events.exclusive): without it, each adder reads the list, adds its node and renames its
copy over the others' (here 102-137 of 300 additions were kept in 8 runs). The ledger's other half, O_APPEND records
that two NFS clients can write over each other (open(2)), cannot fail on this cluster: its disk is local (and the
kernel has no NFS), where an O_APPEND write is atomic, so the ledger's records are all kept with or without the lock."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jobs.events import read_events
from jobs.failure.quarantine import quarantined
from tests.slurm.slurm_helpers import REPO

pytestmark = [pytest.mark.chaos, pytest.mark.usefixtures("slurm_cluster")]

NODES, ADDITIONS = ("node1", "node2", "node3"), 100

# Each task: waits until every task has started (so that the three loops overlap), then adds its node's
# ADDITIONS names to the run's quarantine list and a record of each to its ledger, one after the other.
_TASK = """
import os, socket, sys, time
from pathlib import Path
from jobs.events import EventLog
from jobs.failure.quarantine import add_to_quarantine
run, n = Path(sys.argv[1]), int(sys.argv[2])
node = os.environ["SLURMD_NODENAME"]
(run / f"{node}.ready").write_text("")
deadline = time.monotonic() + 60
while len(list(run.glob("*.ready"))) < 3:
    assert time.monotonic() < deadline, "the other tasks did not start within 60 s"
    time.sleep(0.005)
log = EventLog(run / "events.jsonl", rank=int(os.environ["SLURM_PROCID"]), attempt=node)
for i in range(n):
    add_to_quarantine(run, [f"{node}-{i}"], reason="test", incident=f"{node}.{i}")
    log.emit("note", host=socket.gethostname(), i=i)
"""


@pytest.mark.timeout(180)
def test_three_hosts_adding_to_one_run_s_quarantine_list_and_ledger_at_once_lose_nothing(tmp_path: Path) -> None:
    run = tmp_path / "run"  # the disk is shared: every node sees tmp_path
    run.mkdir()
    (tmp_path / "task.py").write_text(_TASK)
    p = subprocess.run(
        ["srun", "-N3", "--ntasks-per-node=1", "-t", "2", sys.executable, str(tmp_path / "task.py"), str(run)]
        + [str(ADDITIONS)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    listed = [(e["node"], e["incident"]) for e in quarantined(run)]
    assert sorted(listed) == sorted((f"{n}-{i}", f"{n}.{i}") for n in NODES for i in range(ADDITIONS)), (
        f"{len(listed)} of {len(NODES) * ADDITIONS} additions kept"
    )
    records = read_events(run / "events.jsonl")
    assert len((run / "events.jsonl").read_text().splitlines()) == len(records)  # no line torn or overwritten
    # Every host's records, each once and in its own order; the hosts are the three nodes (each its own hostname).
    assert {n: [r["i"] for r in records if r["attempt"] == n] for n in NODES} == {
        n: list(range(ADDITIONS)) for n in NODES
    }
    assert sorted({(r["attempt"], r["host"]) for r in records}) == [(n, n) for n in NODES]
    left = sorted(f.name for f in run.iterdir())  # no lock file, no temporary copy of the list
    assert left == sorted(["events.jsonl", "quarantine.json", *(f"{n}.ready" for n in NODES)])
