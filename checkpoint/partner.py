"""Partner copies of the RAM tier: the ring over nodes that names each rank's partner, a committed step folder
sent between two ranks (gloo point-to-point) and committed again on the other side, and which copy of each rank's
state a restart reads, wherever it is held, and who sends it (checkpoint/memory_tier.py uses these)."""

from __future__ import annotations

import json
import pickle
import shutil
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoint.config import folder_rank, replicas_for
from checkpoint.errors import CheckpointConfigError
from checkpoint.manifest import MANIFEST, fsync_dir, read_manifest, write_synced

__all__ = [
    "replicas_for",
    "partner_ranks",
    "spread_ring",
    "shared_domains",
    "folder_rank",
    "MemoryLoad",
    "Placement",
    "plan_memory_load",
    "plan_step",
    "transfers",
    "pack_folder",
    "commit_folder",
    "exchange",
]


def partner_ranks(nodes: list[str], domains: list[str] | None = None) -> list[int]:
    """Rank r's partner, for every r (`nodes[r]`: rank r's node): the same local rank (r's index among its node's
    ranks) on the next node, nodes taken in the order of their first rank, the last node's partners on the first.
    `domains[r]`: the failure domain of rank r's node (its physical host and leaf switch, "" unknown): when two
    neighbours of that ring share one, the nodes are laid out again so that no neighbours do where that is possible
    (two slurmd on one host, or two hosts on one switch, never hold each other's copies; `shared_domains` names
    what is left). Raises CheckpointConfigError when there is one node, or the nodes hold different numbers of ranks."""
    order = list(dict.fromkeys(nodes))
    if domains is not None:
        order = spread_ring(order, {n: d for n, d in zip(nodes, domains)})
    groups = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    if len(order) < 2:
        raise CheckpointConfigError(
            f"checkpoint.memory_replicas=1: all {len(nodes)} ranks are on one node ({order[0] if order else '-'}), "
            "so no partner copy can go to another node; set checkpoint.memory_replicas=0 or use launcher.nodes >= 2"
        )
    sizes = {n: len(g) for n, g in groups.items()}
    if len(set(sizes.values())) != 1:
        raise CheckpointConfigError(
            f"checkpoint.memory_replicas=1 pairs the same local rank on neighbouring nodes, but the nodes hold "
            f"different numbers of ranks ({', '.join(f'{n}: {k}' for n, k in sizes.items())}); "
            "set checkpoint.memory_replicas=0 or run the same number of tasks on every node"
        )
    out = [0] * len(nodes)
    for k, n in enumerate(order):
        nxt = groups[order[(k + 1) % len(order)]]
        for i, r in enumerate(groups[n]):
            out[r] = nxt[i]
    return out


def spread_ring(order: list[str], domain: dict[str, str]) -> list[str]:
    """`order` itself when no two neighbours of its ring (the last node's neighbour: the first) share a failure
    domain; else the nodes grouped by domain, largest group first, laid on the even places of the ring and then
    the odd ones, which parts every domain of at most half the nodes from itself (kept only when it leaves fewer
    neighbours sharing one: nodes all of one domain keep their order)."""

    def shared(ring: list[str]) -> int:
        return sum(1 for a, b in zip(ring, ring[1:] + ring[:1]) if domain.get(a, "") and domain[a] == domain.get(b))

    if not shared(order):
        return order
    groups: dict[str, list[str]] = {}
    for n in order:
        groups.setdefault(domain.get(n, "") or n, []).append(n)
    flat = [n for g in sorted(groups.values(), key=len, reverse=True) for n in g]
    places = [*range(0, len(flat), 2), *range(1, len(flat), 2)]
    out = [""] * len(flat)
    for n, p in zip(flat, places):
        out[p] = n
    return out if shared(out) < shared(order) else order


def shared_domains(nodes: list[str], partners: list[int], domains: list[str]) -> list[tuple[str, str]]:
    """(node, the node holding its partner copies) for every node whose copies stay in its own failure domain."""
    return sorted({(nodes[r], nodes[p]) for r, p in enumerate(partners) if domains[r] and domains[r] == domains[p]})


@dataclass(frozen=True, slots=True)
class MemoryLoad:
    """How a restart reads one RAM step: the save it comes from (its attempt) and, for every rank r, the copy it
    reads, `sources[r]` = (node, folder under that node's folder of the tier)."""

    step: int
    attempt: str
    sources: tuple[tuple[str, str], ...]

    def copied(self, nodes: list[str]) -> list[int]:
        """The ranks that read anything but their own save on their own node (a partner copy, or another node's)."""
        return [r for r, src in enumerate(self.sources) if src != (nodes[r], f"rank_{r}")]


Listing = dict[str, dict[str, dict[int, str]]]  # {node: {folder: {step: the attempt that saved it}}}


def plan_memory_load(nodes: list[str], held: Listing) -> list[MemoryLoad]:
    """The RAM steps a restart can load, newest first (`nodes[r]`: rank r's node now; `held`: every node's committed
    copies, by folder). Only the nodes in `nodes` count: a copy held only on a node that is gone is no copy. A step
    counts when every rank can get a copy of its own state from one and the same save (never a mix of steps or of
    saves), from wherever it is held (plan_step)."""
    live = {n: held.get(n, {}) for n in dict.fromkeys(nodes)}
    steps = sorted({s for fs in live.values() for c in fs.values() for s in c}, reverse=True)
    return [p for p in (plan_step(nodes, live, s) for s in steps) if p is not None]


def plan_step(
    nodes: list[str], held: Listing, step: int, *, exclude: frozenset[tuple[str, str]] = frozenset()
) -> MemoryLoad | None:
    """Where every rank reads its copy of `step` (None when some rank has none): for each rank, a copy on its own
    node (its own save first, then a partner copy held there: read in place) before one on another node (sent);
    among the saves (attempts) that every rank can get, the one with the most ranks reading on their own node.
    `exclude`: (node, folder) copies found damaged. The same answer on every rank."""
    pos = {n: i for i, n in enumerate(dict.fromkeys(nodes))}
    by_rank: dict[int, list[tuple[str, str, str]]] = {}  # rank -> (node, folder, attempt) of its copies of `step`
    for n in pos:
        for f, c in sorted(held.get(n, {}).items()):
            q = folder_rank(f)
            if q is not None and step in c and (n, f) not in exclude:
                by_rank.setdefault(q, []).append((n, f, c[step]))
    best: tuple[int, MemoryLoad] | None = None
    for att in sorted({a for cs in by_rank.values() for _, _, a in cs}):
        srcs = []
        for r, node in enumerate(nodes):
            mine = [(n, f) for n, f, a in by_rank.get(r, []) if a == att]
            if not mine:
                break
            srcs.append(min(mine, key=lambda c, r=r, node=node: (c[0] != node, c[1] != f"rank_{r}", pos[c[0]])))
        else:
            local = sum(n == nodes[r] for r, (n, _) in enumerate(srcs))
            if best is None or local > best[0]:
                best = (local, MemoryLoad(step=step, attempt=att, sources=tuple(srcs)))
    return best[1] if best else None


def transfers(nodes: list[str], sources: Sequence[tuple[str, str]]) -> list[tuple[int, int, int]]:
    """(round, sender, receiver) for every rank whose copy is on another node: one rank of the holding node sends it,
    the node's copies dealt over its ranks in turn, one copy per sender per round (one payload in memory at a time)."""
    ranks_on = {n: [r for r, m in enumerate(nodes) if m == n] for n in dict.fromkeys(nodes)}
    dealt = dict.fromkeys(ranks_on, 0)
    out = []
    for r, (n, _) in enumerate(sources):
        if n != nodes[r]:
            k, group = dealt[n], ranks_on[n]
            dealt[n] += 1
            out.append((k // len(group), group[k % len(group)], r))
    return out


def pack_folder(d: Path) -> bytes:
    """A committed step folder as one payload: {file name: bytes}, the manifest among them."""
    return pickle.dumps(
        {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.is_file()}, protocol=pickle.HIGHEST_PROTOCOL
    )


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
    _wait(
        [
            *([dist.isend(size_out, dst=send_to, group=pg)] if send_to is not None else []),
            *([dist.irecv(size_in, src=recv_from, group=pg)] if recv_from is not None else []),
        ]
    )
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


@dataclass(frozen=True)
class Placement:
    """Where one rank's RAM copies are: the tier's folder on this rank's node (`root`,
    `checkpoint.memory_dir/meshjob-<run id>/<node>/`), every rank's node, each rank's partner (`partners[r]`) and
    source (`sources[r]`: the rank whose partner r is), and the copies each save sends (`replicas`, 0 or 1)."""

    root: Path
    rank: int
    node: str
    nodes: list[str]
    partners: list[int] = field(default_factory=list)
    sources: list[int] = field(default_factory=list)
    replicas: int = 0

    @property
    def rank_dir(self) -> Path:
        return self.root / f"rank_{self.rank}"

    @property
    def held_dir(self) -> Path:
        """The partner copies this rank holds: those of the rank whose partner it is."""
        return self.root / f"partner_of_rank_{self.sources[self.rank]}"

    @property
    def speaker(self) -> bool:
        """Whether this rank lists and tidies its node's folder for the node: the node's lowest rank."""
        return self.nodes.index(self.node) == self.rank

    def stale_dirs(self) -> list[Path]:
        """On the node's speaker: the node's folders that no rank there saves into or holds partner copies in now
        (copies from before the ranks were placed as they are: a spare swap); [] on the other ranks."""
        if not self.speaker or not self.root.is_dir():
            return []
        here = [r for r, n in enumerate(self.nodes) if n == self.node]
        used = {f"rank_{r}" for r in here}
        if self.replicas:
            used |= {f"partner_of_rank_{self.sources[r]}" for r in here}
        return [p for p in sorted(self.root.iterdir()) if folder_rank(p.name) is not None and p.name not in used]
