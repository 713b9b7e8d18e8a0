"""SCR's scavenge for the RAM tier: at the end of an allocation (and at the start of the next, for what an
allocation that ended without one left) the newest RAM step that is newer than the filesystem's newest committed
step is flushed to the filesystem as an ordinary checkpoint, then the run's RAM folders on the node are removed.

The RAM tier keeps one self-contained DCP folder per rank (checkpoint/memory_tier.py: each rank's local shards,
saved with no_dist) and records in its manifest where each DTensor shard lies in the global tensor
(`shards`: {fqn: [global size, global offset]}, `shard_geometry`). A flush turns one complete RAM step (every
rank's copy from one and the same save, own saves first, partner copies where an own one is gone) into a
filesystem step the normal load reads on any mesh:

    node side (`python -m checkpoint.scavenge list|flush|clean`, one task per node):
        list    prints the committed RAM copies of the run on this node (no file is read but the manifests)
        flush   checks each assigned copy against its manifest and copies it into `step_<N>.scavenge-<tag>.tmp/`
                under the checkpoint folder: `__<r>_<i>.distcp` (its data files renamed to rank r's), and its DCP
                metadata and manifest as `.ram-metadata.<r>` / `.ram-manifest.<r>.json`
        clean   removes the run's RAM folder on this node
    batch side (`plan_flush`, scavenge_commit.commit_flush): picks the step, then merges the ranks' DCP metadata into one
        `.metadata` (chunks placed at their global offsets, a replicated chunk once), writes the manifest and
        renames the folder to `step_<N>`, as a save commits; never over an existing `step_<N>`, and never a step
        older than or equal to the filesystem's newest committed one. A partial flush is never loadable: its
        temporary folder is removed (or by the next load, as any `step_*.tmp`).

This module imports no torch (each node runs it in a fresh process at the end of an allocation); the merge and the
commit are checkpoint/scavenge_commit.py's. jobs/launch/scavenge.py runs both on every node of a Slurm allocation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import Any

from checkpoint.config import folder_rank
from checkpoint.manifest import (
    ManifestError,
    check_files,
    file_record,
    fsync_dir,
    read_manifest,
    step_dirs,
    write_synced,
)

__all__ = [
    "Flush",
    "ScavengeError",
    "list_run",
    "plan_flush",
    "newest_committed",
    "flush_tmp",
    "copy_shares",
    "remove_run",
]

RAM_METADATA, RAM_MANIFEST = ".ram-metadata.{}", ".ram-manifest.{}.json"  # rank r's, in a flush's folder
DATA_FILE = re.compile(r"^__\d+_(\d+)\.distcp$")
# what a RAM manifest must share with every other rank's copy of a flushed step (one save of one run)
_IDENTITY = ("run_id", "world_size", "mesh", "config_hash", "attempt", "rollbacks")


class ScavengeError(RuntimeError):
    """A flush that cannot be committed; str() says why (nothing loadable was left behind)."""


@dataclasses.dataclass(frozen=True)
class Flush:
    """The RAM step to flush and where each rank's copy is read: {rank: (host, node folder, folder)}."""

    step: int
    attempt: str
    sources: dict[int, tuple[str, str, str]]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Flush:
        d = json.loads(text)
        return cls(int(d["step"]), str(d["attempt"]), {int(q): tuple(s) for q, s in d["sources"].items()})

    def shares(self, host: str) -> list[tuple[str, str, int]]:
        """(node folder, folder, rank) of the copies `host` sends."""
        return sorted((nf, f, r) for r, (h, nf, f) in self.sources.items() if h == host)


def list_run(root: Path) -> dict[str, dict[str, dict[int, dict[str, Any]]]]:
    """{node folder: {folder: {step: identity}}} of the committed RAM copies under the run's RAM folder `root`
    whose manifest reads (the identity: `_IDENTITY` and the rank); no data file is read."""
    out: dict[str, dict[str, dict[int, dict[str, Any]]]] = {}
    for node in sorted(root.iterdir()) if root.is_dir() else []:
        for d in sorted(node.iterdir()) if node.is_dir() else []:
            if folder_rank(d.name) is None:
                continue
            for step, sd in step_dirs(d):
                try:
                    m = read_manifest(sd, step=step)
                except (ManifestError, OSError):
                    continue
                ids = {k: m.get(k) for k in _IDENTITY} | {"rank": m.get("rank")}
                out.setdefault(node.name, {}).setdefault(d.name, {})[step] = ids
    return out


def plan_flush(
    listings: dict[str, dict[str, dict[str, dict[int, dict[str, Any]]]]], *, newer_than: int, run_id: str
) -> Flush | None:
    """The newest RAM step newer than `newer_than` (the filesystem's newest committed step) that every rank of one
    save of run `run_id` holds somewhere, and where each rank's copy is read (its own save first, then a partner
    copy; the lowest host and folder name among equals); None when there is none. `listings`: {host: list_run}."""
    held: dict[tuple[int, tuple], dict[int, list[tuple[int, str, str, str]]]] = {}
    for host, nodes in listings.items():
        for node, folders in nodes.items():
            for folder, steps in folders.items():
                q = folder_rank(folder)
                for step, m in steps.items():
                    if int(step) <= newer_than or m.get("run_id") != run_id or m.get("rank") != q:
                        continue
                    key = (int(step), tuple(json.dumps(m.get(k), sort_keys=True) for k in _IDENTITY))  # one save
                    own = 0 if folder.startswith("rank_") else 1
                    held.setdefault(key, {}).setdefault(q, []).append((own, host, node, folder))
    for (step, ident), by_rank in sorted(held.items(), key=lambda kv: kv[0], reverse=True):
        world = json.loads(ident[_IDENTITY.index("world_size")])
        if isinstance(world, int) and sorted(by_rank) == list(range(world)):
            attempt = json.loads(ident[_IDENTITY.index("attempt")])
            return Flush(step, str(attempt), {q: min(c)[1:] for q, c in by_rank.items()})
    return None


def newest_committed(folder: Path) -> int:
    """The newest step under the checkpoint folder whose manifest reads (0 when none): a flush goes above it."""
    for step, d in step_dirs(folder):
        try:
            read_manifest(d, step=step)
            return step
        except (ManifestError, OSError):
            continue
    return 0


def flush_tmp(folder: Path, step: int, tag: str) -> Path:
    """The temporary folder a flush of `step` writes (a `step_*.tmp`: the next load removes it if left)."""
    return folder / f"step_{step}.scavenge-{tag}.tmp"


def copy_shares(root: Path, tmp: Path, step: int, shares: list[tuple[str, str, int]], *, checksum: bool) -> list[str]:
    """Node side: each share (node folder, folder, rank) of `step` under the run's RAM folder `root`, checked
    against its manifest, copied into `tmp` as rank r's files (see the module docstring) and fsynced; returns the
    problems (empty: every share copied)."""
    problems = []
    tmp.mkdir(parents=True, exist_ok=True)
    for node, folder, rank in shares:
        src = root / node / folder / f"step_{step}"
        try:
            m = read_manifest(src, step=step)
            bad = check_files(src, m["files"], sorted(m["files"]), checksum=checksum)
            if bad:
                raise ScavengeError("; ".join(bad))
            for name in m["files"]:
                match = DATA_FILE.match(name)
                dst = f"__{rank}_{match.group(1)}.distcp" if match else RAM_METADATA.format(rank)
                if name != ".metadata" and not match:
                    raise ScavengeError(f"unexpected file {name}")
                shutil.copyfile(src / name, tmp / dst)
                file_record(tmp / dst, checksum=False)  # fsyncs it
            write_synced(tmp / RAM_MANIFEST.format(rank), json.dumps(m).encode())
        except Exception as e:  # noqa: BLE001 - reported; the flush is not committed
            problems.append(f"{node}/{folder}/step_{step}: {type(e).__name__}: {e}")
    fsync_dir(tmp)
    return problems


def remove_run(root: Path) -> int:
    """Node side: removes the run's RAM folder `root` on this node; returns the bytes it held (what another task
    removes meanwhile, where nodes share one memory folder, is not counted)."""
    nbytes = 0
    for d, _, names in os.walk(root):
        for name in names:
            try:
                nbytes += os.stat(os.path.join(d, name)).st_size
            except OSError:
                continue
    shutil.rmtree(root, ignore_errors=True)
    return nbytes


def main(argv: list[str] | None = None) -> int:
    """`list ROOT` | `flush ROOT TMP STEP SHARES_JSON [--size] [--clean]` | `clean ROOT`: one node's part; prints JSON."""
    p = argparse.ArgumentParser(prog="python -m checkpoint.scavenge")
    p.add_argument("what", choices=("list", "flush", "clean"))
    p.add_argument("root", type=Path)
    p.add_argument("rest", nargs="*")
    p.add_argument("--size", action="store_true", help="flush: check sizes only, not crc32")
    p.add_argument("--clean", action="store_true", help="flush: then remove the run's RAM folder on this node")
    a = p.parse_args(argv)
    if a.what == "list":
        out: Any = list_run(a.root)
    elif a.what == "flush":
        tmp, step, shares = Path(a.rest[0]), int(a.rest[1]), [tuple(s) for s in json.loads(a.rest[2])]
        out = {"problems": copy_shares(a.root, tmp, step, shares, checksum=not a.size) if shares else []}
        if a.clean:
            out["removed_bytes"] = remove_run(a.root)
    else:
        out = {"removed_bytes": remove_run(a.root)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
