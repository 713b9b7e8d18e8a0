"""A filesystem that behaves like one: ext4 on a sparse image behind a loop device with direct I/O, its reads and
writes throttled by the root blkio cgroup; used by the checkpoint benchmarks and tests/multiproc/test_slow_filesystem.py.

The loop device's direct I/O keeps the host's page cache out (each read and write of the loop device reaches the
image file's disk), and the blkio controller of the root cgroup (cgroup v1, `blkio.throttle.{read,write}_bps_device`)
holds the loop device to the given rates; this kernel has no device-mapper and no NFS to do it otherwise. Mounted
`dirsync` by default: a rename or create waits for the disk, as a network filesystem's metadata RPC does. The page
cache of the ext4 on top still works as on any filesystem (a benchmark evicts its files to read the disk). Needs root.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

__all__ = ["THROTTLE_DIR", "add_bench_args", "bench_dir", "run_in_bench_dir", "slow_filesystem"]

THROTTLE_DIR = Path("/sys/fs/cgroup/blkio")  # the root blkio cgroup (cgroup v1)


def _run(*cmd: str) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise OSError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()}")
    return p.stdout.strip()


def _throttle(device: str, kind: str, bps: int) -> None:
    """Sets the root cgroup's `kind` (read or write) limit on `device` ("major:minor") to `bps` (0: none)."""
    path = THROTTLE_DIR / f"blkio.throttle.{kind}_bps_device"
    path.write_text(f"{device} {bps}\n")
    if bps and f"{device} {bps}" not in path.read_text():
        raise OSError(f"{path} does not hold {device} {bps} after writing it")


@contextlib.contextmanager
def slow_filesystem(
    workdir: Path, *, write_bps: int, read_bps: int = 0, size: int = 2 << 30, dirsync: bool = True
) -> Iterator[Path]:
    """Yields the mount point (`workdir`/slow) of an ext4 whose writes go at `write_bps` and reads at `read_bps`
    bytes/s (0: unthrottled), on a sparse image `workdir`/disk.img of `size` bytes (only what is written takes disk
    space). Afterwards unthrottled, unmounted, detached, the mount point and image removed, each step tried even if one before it
    failed; a failed step raises OSError naming every one that failed (a leftover loop device or limit is a fault)."""
    if os.geteuid() != 0:
        raise PermissionError("a loop device, a mount and the blkio throttle need root")
    workdir.mkdir(parents=True, exist_ok=True)
    image, mount = workdir / "disk.img", workdir / "slow"
    with image.open("wb") as f:
        f.truncate(size)
    undo = [image.unlink]
    try:
        loop = _run("losetup", "--find", "--show", "--direct-io=on", str(image))
        undo.append(lambda: _run("losetup", "-d", loop))
        _run("mkfs.ext4", "-q", loop)
        mount.mkdir(exist_ok=True)
        undo.append(mount.rmdir)
        # noinit_itable: no background thread zeroing inode tables through the throttle while a benchmark runs
        _run("mount", "-o", "dirsync,noinit_itable" if dirsync else "noinit_itable", loop, str(mount))
        undo.append(lambda: _run("umount", str(mount)))
        rdev = os.stat(loop).st_rdev
        device = f"{os.major(rdev)}:{os.minor(rdev)}"
        for kind, bps in (("write", write_bps), ("read", read_bps)):
            if bps:
                undo.append(lambda kind=kind: _throttle(device, kind, 0))
                _throttle(device, kind, bps)
        yield mount
    finally:
        failed = []
        for step in reversed(undo):
            try:
                step()
            except OSError as e:
                failed.append(str(e))
        if failed:
            raise OSError(f"undoing the slow filesystem under {workdir} failed: {'; '.join(failed)}")


@contextlib.contextmanager
def bench_dir(folder: str, *, mb_per_rank: float, ranks: int, size: int = 16 << 30) -> Iterator[Path]:
    """A benchmark's working folder: `folder` itself when `mb_per_rank` is 0, else `folder`/bench on a slow filesystem
    (its image under `folder`-image) whose reads and writes go at `mb_per_rank` x `ranks` MB/s, as if each rank had
    its own share of a parallel filesystem's bandwidth."""
    if not mb_per_rank:
        yield Path(folder)
        return
    bps = int(mb_per_rank * 1e6 * ranks)
    signal.signal(signal.SIGTERM, _exit_on_term)  # `kill` undoes the mount and the throttle too
    workdir = Path(f"{folder}-image")
    with slow_filesystem(workdir, write_bps=bps, read_bps=bps, size=size) as mount:
        try:
            yield mount / "bench"
        finally:
            subprocess.run(["rm", "-rf", str(mount / "bench")], check=False)  # before the umount
    with contextlib.suppress(OSError):
        workdir.rmdir()


def _exit_on_term(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def add_bench_args(ap: argparse.ArgumentParser, *, folder: str, what: str = "--dir") -> None:
    """The arguments every checkpoint benchmark takes: ranks, threads, its folder, --slow-fs and --out."""
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: the cores / --ranks)")
    ap.add_argument("--dir", default=folder)
    ap.add_argument(
        "--slow-fs",
        type=float,
        default=0,
        help=f"MB/s per rank: {what} on ext4 over a loop device with direct I/O, reads and writes throttled to "
        "--ranks x this rate (scripts/bench/_slowfs.py; needs root); 0: --dir as it is",
    )
    ap.add_argument("--out", default=None, help="append the JSON line here too")


def run_in_bench_dir(a: argparse.Namespace, main: Callable[[argparse.Namespace], int]) -> int:
    """`main(a)` with `a.dir` on the throttled filesystem that --slow-fs asks for (as it is for 0)."""
    with bench_dir(a.dir, mb_per_rank=a.slow_fs, ranks=a.ranks) as d:
        a.dir = str(d)
        return main(a)
