"""Partner copies of the RAM tier: the ring over nodes that names each rank's partner, a committed step folder
sent between two ranks (gloo point-to-point) and committed again on the other side, and which copy of each rank's
state a restart reads (checkpoint/memory_tier.py uses these)."""

from __future__ import annotations

import json
import pickle
import shutil
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.config import replicas_for
from checkpoint.errors import CheckpointConfigError
from checkpoint.manifest import MANIFEST, fsync_dir, read_manifest, write_synced

__all__ = ["PARTNER", "replicas_for", "partner_ranks", "plan_memory_load", "pack_folder", "commit_folder", "exchange"]

PARTNER = "memory_partner"  # the `tier` of a checkpoint_loaded record when some rank read its partner's copy


def partner_ranks(nodes: list[str]) -> list[int]:
    """Rank r's partner, for every r (`nodes[r]`: rank r's node): the same local rank (r's index among its node's
    ranks) on the next node, nodes taken in the order of their first rank, the last node's partners on the first.
    Raises CheckpointConfigError when there is one node, or the nodes hold different numbers of ranks."""
    order = list(dict.fromkeys(nodes))
    groups = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    if len(order) < 2:
        raise CheckpointConfigError(
            f"checkpoint.memory_replicas=1: all {len(nodes)} ranks are on one node ({order[0] if order else '-'}), "
            "so no partner copy can go to another node; set checkpoint.memory_replicas=0 or use launcher.nodes >= 2")
    sizes = {n: len(g) for n, g in groups.items()}
    if len(set(sizes.values())) != 1:
        raise CheckpointConfigError(
            f"checkpoint.memory_replicas=1 pairs the same local rank on neighbouring nodes, but the nodes hold "
            f"different numbers of ranks ({', '.join(f'{n}: {k}' for n, k in sizes.items())}); "
            "set checkpoint.memory_replicas=0 or run the same number of tasks on every node")
    out = [0] * len(nodes)
    for k, n in enumerate(order):
        nxt = groups[order[(k + 1) % len(order)]]
        for i, r in enumerate(groups[n]):
            out[r] = nxt[i]
    return out


def plan_memory_load(own: list[dict[int, str]], held: list[dict[int, str]]) -> list[tuple[int, list[bool], list[bool]]]:
    """The RAM steps a restart can load, newest first: (step, which ranks hold their own copy of it, which ranks'
    partners hold a copy of it). `own[r]`/`held[r]`: {step: saving attempt} of rank r's own copies / of the copies
    of rank r's state its partner holds. A step counts when every rank has one copy of it from one and the same
    save (the attempt that saved the step on most ranks' own copies wins), never a mix of steps or of saves."""
    out = []
    for step in sorted(set().union(*own, *held), reverse=True):
        best: tuple[list[bool], list[bool]] | None = None
        for att in sorted({d[step] for d in (*own, *held) if step in d}):
            has_own = [o.get(step) == att for o in own]
            has_held = [h.get(step) == att for h in held]
            if all(a or b for a, b in zip(has_own, has_held)) and (best is None or sum(has_own) > sum(best[0])):
                best = (has_own, has_held)
        if best is not None:
            out.append((step, *best))
    return out


def pack_folder(d: Path) -> bytes:
    """A committed step folder as one payload: {file name: bytes}, the manifest among them."""
    return pickle.dumps({p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()},
                        protocol=pickle.HIGHEST_PROTOCOL)


def commit_folder(payload: bytes, *, tmp: Path, final: Path, step: int) -> dict[str, Any]:
    """Writes a payload of pack_folder as `final`, with the commit rules of the RAM tier: every file checked
    against its manifest record (size, crc32) and fsync'ed, the manifest last, one rename. Returns the manifest;
    raises ValueError (a damaged payload) or OSError, leaving no `final`."""
    files: dict[str, bytes] = pickle.loads(payload)
    manifest = json.loads(files[MANIFEST])
    if manifest.get("step") != step:
        raise ValueError(f"the copy is of step {manifest.get('step')}, not {step}")
    for name, rec in manifest["files"].items():
        data = files.get(name)
        if data is None or len(data) != rec["size"] or ("crc32" in rec and f"{zlib.crc32(data):08x}" != rec["crc32"]):
            raise ValueError(f"{name} of the copy does not match its manifest (size or crc32)")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    for name in [*sorted(n for n in files if n != MANIFEST), MANIFEST]:  # the manifest last
        write_synced(tmp / name, files[name])
    fsync_dir(tmp)
    read_manifest(tmp, step=step)  # its own crc: the bytes written are the ones the sender committed
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    fsync_dir(final.parent)
    return manifest


def exchange(payload: bytes | None, *, send_to: int | None, recv_from: int | None, pg: Any) -> bytes | None:
    """Sends `payload` to rank `send_to` and receives one from rank `recv_from` (either may be None), both at
    once, on group `pg` (every rank of the job; its ranks are the global ranks): first the sizes, then the bytes.
    A None payload is sent as "nothing" (size -1); returns what was received, None for nothing."""
    size_out = torch.tensor([-1 if payload is None else len(payload)], dtype=torch.int64)
    size_in = torch.tensor([-1], dtype=torch.int64)
    _wait([*([dist.isend(size_out, dst=send_to, group=pg)] if send_to is not None else []),
           *([dist.irecv(size_in, src=recv_from, group=pg)] if recv_from is not None else [])])
    n = int(size_in.item()) if recv_from is not None else -1
    buf = torch.empty(max(n, 0), dtype=torch.uint8)
    reqs = []
    if send_to is not None and payload:
        reqs.append(dist.isend(torch.frombuffer(bytearray(payload), dtype=torch.uint8), dst=send_to, group=pg))
    if n > 0:
        reqs.append(dist.irecv(buf, src=recv_from, group=pg))
    _wait(reqs)
    return None if n < 0 else buf.numpy().tobytes()


def _wait(reqs: list[Any]) -> None:
    for q in reqs:
        q.wait()
