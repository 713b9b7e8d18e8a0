"""The batch side of the RAM tier's scavenge (checkpoint/scavenge.py): where each rank's DTensor shards lie in the
global tensors (recorded in every RAM manifest), and the merge of the ranks' copied RAM folders into one filesystem
checkpoint, committed as a save commits (manifest written and fsynced, then one rename)."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor

from checkpoint.manifest import file_record, fsync_dir, write_manifest
from checkpoint.scavenge import DATA_FILE, RAM_MANIFEST, RAM_METADATA, Flush, ScavengeError, newest_committed

__all__ = ["shard_geometry", "merge_metadata", "commit_flush"]


def shard_geometry(tree: Any, prefix: str = "") -> dict[str, list[list[int]]]:
    """{fqn: [global size, global offset]} of every DTensor in a nested dict, its fqn as DCP flattens it (keys
    joined by "."): where the rank's local shard lies in the whole tensor (a RAM folder saves the shard alone)."""
    out: dict[str, list[list[int]]] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(shard_geometry(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(tree, DTensor):
        (chunk,) = tree.__create_chunk_list__()
        out[prefix] = [list(tree.shape), list(chunk.offsets)]
    return out


def merge_metadata(metas: dict[int, Metadata], shards: dict[int, dict[str, list[list[int]]]]) -> Metadata:
    """One DCP metadata over the ranks' RAM folders (rank r's data files renamed `__<r>_<i>.distcp`): each tensor
    at its global size with every rank's chunk at its global offset (a chunk several ranks hold, replicated, read
    from the lowest of them), each non-tensor entry from the lowest rank that has it."""
    md: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner: dict[str, Any] = {}
    for rank in sorted(metas):
        meta = metas[rank]
        planner.update({k: v for k, v in (meta.planner_data or {}).items() if k not in planner})
        by_fqn = {idx.fqn: info for idx, info in meta.storage_data.items()}
        for fqn, item in meta.state_dict_metadata.items():
            info = by_fqn[fqn]
            m = DATA_FILE.match(info.relative_path)
            info = dataclasses.replace(info, relative_path=f"__{rank}_{m.group(1) if m else 0}.distcp")
            if isinstance(item, BytesStorageMetadata):
                if fqn not in md:
                    md[fqn], storage[MetadataIndex(fqn)] = item, info
                continue
            (chunk,) = item.chunks
            size, offset = shards[rank].get(fqn, [list(item.size), [0] * len(item.size)])
            entry = md.setdefault(fqn, TensorStorageMetadata(item.properties, torch.Size(size), []))
            if list(entry.size) != list(size):
                raise ScavengeError(f"{fqn}: rank {rank} says size {size}, another {list(entry.size)}")
            if any(list(c.offsets) == list(offset) for c in entry.chunks):
                continue  # replicated: the same chunk from a lower rank
            entry.chunks.append(ChunkStorageMetadata(torch.Size(offset), chunk.sizes))
            storage[MetadataIndex(fqn, offset)] = info
    first = metas[min(metas)]
    return Metadata(state_dict_metadata=md, planner_data=planner, storage_data=storage, version=first.version)


def commit_flush(folder: Path, tmp: Path, flush: Flush, *, world_size: int, env: dict | None = None) -> Path:
    """Batch side: merges what the nodes copied into `tmp` into one checkpoint of `flush.step` and commits it as a
    save does (manifest written and fsynced, then one rename); raises ScavengeError (and removes `tmp`) when a
    rank's copy is missing or a step at or above it is committed now. Returns the committed folder."""
    try:
        final = folder / f"step_{flush.step}"
        if final.exists() or newest_committed(folder) >= flush.step:
            raise ScavengeError(f"{final.name} or a newer step is on the filesystem already: nothing to flush")
        metas, shards, manifests = {}, {}, {}
        for r in range(world_size):
            try:
                manifests[r] = json.loads((tmp / RAM_MANIFEST.format(r)).read_bytes())
                metas[r] = _read_meta(tmp, r)
            except OSError as e:
                raise ScavengeError(f"rank {r}'s copy of step {flush.step} did not arrive ({e})") from None
            shards[r] = manifests[r].get("shards") or {}
        merged = merge_metadata(metas, shards)
        with open(tmp / ".metadata", "wb") as f:
            pickle.dump(merged, f)
            f.flush()
            os.fsync(f.fileno())
        for r in range(world_size):
            (tmp / RAM_METADATA.format(r)).unlink()
            (tmp / RAM_MANIFEST.format(r)).unlink()
        files = {".metadata": file_record(tmp / ".metadata")}
        for r in range(world_size):  # the data files as copied: their records (size, crc32) are the RAM manifest's
            for name, rec in manifests[r]["files"].items():
                m = DATA_FILE.match(name)
                if m:
                    files[f"__{r}_{m.group(1)}.distcp"] = rec
        write_manifest(tmp, _manifest(flush, manifests[0], files, world_size=world_size, env=env))
        os.rename(tmp, final)  # the commit
        fsync_dir(folder)
        return final
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> int:
    """`python -m checkpoint.scavenge_commit FOLDER TMP FLUSH_JSON WORLD_SIZE [ENV_JSON]`: `commit_flush` in a
    process of its own (the supervisor imports no torch, and bounds it); prints {"committed": path} or {"error"}."""
    a = sys.argv[1:] if argv is None else argv
    env = json.loads(a[4]) if len(a) > 4 else None
    try:
        final = commit_flush(Path(a[0]), Path(a[1]), Flush.from_json(a[2]), world_size=int(a[3]), env=env)
    except Exception as e:  # noqa: BLE001 - reported to the caller
        print(json.dumps({"error": f"{type(e).__name__}: {e}"[:2000]}))
        return 1
    print(json.dumps({"committed": str(final)}))
    return 0


def _read_meta(tmp: Path, rank: int) -> Metadata:
    with open(tmp / RAM_METADATA.format(rank), "rb") as f:
        return pickle.load(f)


def _manifest(flush: Flush, ram: dict, files: dict, *, world_size: int, env: dict | None) -> dict[str, Any]:
    """The filesystem manifest of a flushed step (as checkpoint/commit.py writes one; `scavenged` says whence)."""
    return {
        "step": flush.step,
        "time": time.time(),
        "world_size": world_size,
        "files": files,
        "bytes": sum(f["size"] for f in files.values()),
        "env": env or {},
        "data_cursor": {"step": flush.step},
        "rng_keys": [f"rng.rank{r}" for r in range(world_size)],
        "interval": {},
        "async_mode": "none",
        "mesh": ram.get("mesh"),
        "config_hash": ram.get("config_hash"),
        "scavenged": {"from": "memory", "attempt": flush.attempt, "ram_saved": ram.get("time")},
    }


if __name__ == "__main__":
    sys.exit(main())
