"""The RAM checkpoint tier on the local cluster: a rank of a Slurm job killed with `kill -9` comes back, inside the
same allocation, from node-local memory at a step newer than the filesystem's newest; a corrupted RAM shard sends
the next restart to the filesystem tier; the run ends bitwise equal to an uninterrupted one and leaves no RAM copy."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from checkpoint.config import memory_root
from checkpoint.manifest import read_manifest, step_dirs
from jobs.launch.rundir import run_id
from jobs.status import status_text
from tests.chaos.chaos_helpers import (
    DONE_S,
    STEP_S,
    assert_bitwise_equal_to_reference,
    bound_s,
    events,
    node_path,
    rank_node,
    rank_pid,
    submit,
    wait_job_done,
)
from tests.slurm.slurm_helpers import scontrol_job

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.slow,
    pytest.mark.usefixtures("slurm_cluster"),
    pytest.mark.timeout(bound_s(STEP_S, STEP_S, STEP_S, STEP_S, DONE_S)),
]

# 30 steps and a reference of its own (made once per session): a RAM save every step makes a step ~3 x slower, and on
# the loaded 2-core box this case took 141 s at the other chaos cases' 100 steps, 115 s at 30 with the reference run.
STEPS = 30
FS_EVERY = 5  # the filesystem tier's interval; the RAM tier saves every step (its own copy only: no partner)
RAM = [f"checkpoint.every_steps={FS_EVERY}", "checkpoint.memory_every_steps=1", "checkpoint.memory_replicas=0"]


def _ram_step(roots: dict[int, Path], attempt: str) -> int | None:
    """The step both ranks hold committed in the RAM tier from one save of `attempt` (what a restart would load),
    when no RAM save is under way on either (one committed step per rank, no temporary folder: the saves are
    asynchronous, and between a save's commit and the deletion of the older step there are two candidates).
    `roots`: rank -> the run's RAM folder on that rank's node."""
    steps = set()
    for r in (0, 1):
        dirs = list(roots[r].glob(f"*/rank_{r}"))  # <node>/rank_<r>: one node folder per Slurm node
        if len(dirs) != 1 or any(dirs[0].glob("*.tmp")) or len(held := step_dirs(dirs[0])) != 1:
            return None
        ((s, d),) = held
        try:
            if read_manifest(d, step=s)["attempt"] != attempt:
                return None
        except Exception:  # noqa: BLE001 - a folder without its manifest is no commit
            return None
        steps.add(s)
    return steps.pop() if len(steps) == 1 else None


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            raise AssertionError(f"rank pid {pid} gone before RAM held a step newer than the filesystem's") from None


def _freeze_then_kill_rank1(run_dir: Path, attempt: str, *, corrupt: bool) -> tuple[int, int]:
    """Stops both ranks of `attempt` (SIGSTOP) at a moment when RAM holds a complete step R of theirs and no
    filesystem save can commit after the freeze (else lets them run a little and tries again); optionally flips a
    byte of rank 0's shard of R; then SIGKILLs rank 1 and lets rank 0 go on. Returns (R, F): F the newest filesystem
    step then, the one every filesystem save up to R wrote.
    At the freeze the ranks have issued the saves up to step R + 1 at most (a RAM save waits for the one in flight,
    and a step's RAM save comes before its filesystem save); with R and R + 1 off the filesystem's interval and the
    save of F, the last one at or before R, recorded (`checkpoint_saved` comes after the commit), none is in flight:
    nothing on the filesystem is newer than F, before the restart's load or after it, and F < R."""
    pids = [rank_pid(run_dir, attempt, r) for r in (0, 1)]
    root = str(memory_root("/dev/shm", run_id(run_dir)))
    roots = {r: node_path(rank_node(run_dir, attempt, r), root) for r in (0, 1)}
    deadline = time.monotonic() + STEP_S
    while True:
        assert time.monotonic() < deadline, f"RAM never held a step of {attempt} with no filesystem save in flight"
        _signal(pids, signal.SIGSTOP)
        ram = _ram_step(roots, attempt)
        if ram is not None and ram % FS_EVERY not in (0, FS_EVERY - 1):
            fs = ram - ram % FS_EVERY
            if any(e["step"] == fs and e["tier"] == "filesystem" for e in events(run_dir, "checkpoint_saved")):
                break
        _signal(pids, signal.SIGCONT)
        time.sleep(0.05)
    if corrupt:
        (shard,) = roots[0].glob(f"*/rank_0/step_{ram}/*.distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
        shard.write_bytes(bytes(data))
    os.kill(pids[1], signal.SIGKILL)
    os.kill(pids[0], signal.SIGCONT)
    return ram, fs


def _wait_for(what: str, ready, *, timeout: float = STEP_S) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.1)


def _restarted_and_loaded(run_dir: Path, attempt: str) -> bool:
    """Whether `attempt` has loaded its checkpoint; fails at once when the job was not restarted inside its
    allocation (a requeue: another allocation, whose ranks can find no RAM copy of theirs on a new node)."""
    other = [d for d in events(run_dir, "decision") if d["action"] != "restart"]
    assert not other, f"not restarted inside the allocation: {other}"
    return any(e["attempt"] == attempt for e in events(run_dir, "checkpoint_loaded"))


def _newest_fs_commit_before(ledger: list[dict], *, loaded_index: int) -> int:
    """The newest filesystem step whose `checkpoint_saved` precedes the `loaded_index`-th `checkpoint_loaded`."""
    newest, loads = 0, 0
    for e in ledger:
        if e["kind"] == "checkpoint_loaded":
            if loads == loaded_index:
                return newest
            loads += 1
        elif e["kind"] == "checkpoint_saved" and e.get("tier") == "filesystem":
            newest = max(newest, e["step"])
    raise AssertionError(f"fewer than {loaded_index + 1} checkpoint_loaded events")


def test_a_killed_rank_restarts_from_ram_in_the_allocation_and_a_corrupted_ram_shard_from_the_filesystem_bitwise(
    run_root: Path, chaos_references, tmp_path
) -> None:
    reference = chaos_references(STEPS)
    job = submit(run_root, *RAM, steps=STEPS)
    first, second, third = f"{job}.0", f"{job}.0.1", f"{job}.0.2"
    try:
        _wait_for(
            f"filesystem checkpoint of step {FS_EVERY}",
            (run_root / f"checkpoints/step_{FS_EVERY}/manifest.json").exists,
        )
        ram1, fs1 = _freeze_then_kill_rank1(run_root, first, corrupt=False)
        _wait_for(f"load by attempt {second}", lambda: _restarted_and_loaded(run_root, second))
        ram2, fs2 = _freeze_then_kill_rank1(run_root, second, corrupt=True)  # a RAM step the restarted ranks saved
        recs = wait_job_done(job)
    finally:  # a no-op once the job is done; on a failure above, no job (maybe with stopped ranks) stays behind
        subprocess.run(["scancel", job], capture_output=True)
    # one allocation from start to end: restarted twice inside it, never requeued
    assert [r["State"].split()[0] for r in recs] == ["COMPLETED"], recs
    assert scontrol_job(job)["Restarts"] == "0"
    decisions = [(d["attempt"], d["action"], d["reason"].split(":")[0]) for d in events(run_root, "decision")]
    assert decisions == [(first, "restart", "dead_rank"), (second, "restart", "dead_rank")], decisions

    ledger = events(run_root)
    loaded = [(e["attempt"], e["step"], e["tier"]) for e in ledger if e["kind"] == "checkpoint_loaded"]
    # the first restart: RAM, newer than anything the filesystem had committed before that load
    assert FS_EVERY <= fs1 == _newest_fs_commit_before(ledger, loaded_index=0) < ram1, (fs1, ram1, loaded)
    assert loaded[0] == (second, ram1, "memory"), loaded
    # the second: the damaged RAM step skipped for its checksum, the newest filesystem commit before the load read
    assert fs2 == _newest_fs_commit_before(ledger, loaded_index=1) < ram2, (fs2, ram2, loaded)
    assert loaded[1:] == [(third, fs2, "filesystem")], loaded
    skipped = [e for e in ledger if e["kind"] == "checkpoint_skipped"]
    assert [(e["attempt"], e["step"], e["tier"]) for e in skipped] == [(third, ram2, "memory")], skipped
    assert "crc32" in skipped[0]["reason"], skipped
    # jobs.status names the tier each attempt resumed from; the finished run left nothing in memory
    rows = [r for r in map(str.split, status_text(run_root).splitlines()) if r and r[0].isdigit()]  # the attempts table
    assert [(r[1], r[5]) for r in rows] == [(first, "-"), (second, "ram"), (third, "fs")], rows
    ram_root = str(memory_root("/dev/shm", run_id(run_root)))
    assert [n for n in ("node1", "node2") if node_path(n, ram_root).exists()] == []
    assert_bitwise_equal_to_reference(run_root, reference, tmp_path)
