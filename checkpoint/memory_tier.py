"""The RAM checkpoint tier: every `checkpoint.memory_every_steps` each rank writes its own state to node-local
memory, committed like the filesystem tier, and a restart inside the allocation reads it back when every rank
holds the same step (CheckpointManager's memory half).

Layout under the run's root, `checkpoint.memory_dir/meshjob-<run id>/` (one per node, see config.memory_root):
    rank_<r>/step_<N>.<attempt>.tmp/   a save in progress
    rank_<r>/step_<N>/                 committed by one rename: DCP files of rank r's local shards
                                       (`__0_0.distcp`, `.metadata`) and `manifest.json`, written last
Each rank's folder is self-contained: it is written with no_dist from the rank's local tensors (DTensors as
their local shards, nothing deduplicated across ranks), so rank r reloads it on the same mesh with nothing from
another rank or node, and it is the unit a partner copy would send to another node's root unchanged.

The commit, per save: rank r writes and fsyncs its files (crc32 taken as they are written) -> its manifest
(step, rank, world size, mesh, run id, the saving attempt, sizes and crc32) -> rename to step_<N> -> every rank
reports its outcome (one all_gather); only when all committed does each rank delete its older steps, so two
copies are held at most and some common step always survives a kill at any point. A failed RAM save removes
that step everywhere and training goes on (the filesystem tier is untouched): it is a cache, not the record.

Load: every rank lists the steps whose manifest names this run, its rank, world size and mesh; a step counts
only when every rank holds it from the same save (`complete_steps`); its files are checked in full by each rank
and the outcome agreed; the manager weighs it against the filesystem's newest (`CheckpointManager._restore_newest`).
"""

from __future__ import annotations

import logging
import platform
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.tensor import DTensor

from checkpoint.errors import CheckpointConfigError, describe_error
from checkpoint.manifest import ManifestError, check_files, file_record, fsync_dir, read_manifest, step_dirs, write_manifest
from checkpoint.writer import RecordingWriter

__all__ = ["MEMORY", "FILESYSTEM", "MemoryTierMixin", "complete_steps", "capacity_error", "local_steps"]

log = logging.getLogger("meshjob.checkpoint")
MEMORY, FILESYSTEM = "memory", "filesystem"  # the `tier` of checkpoint_saved / checkpoint_loaded records
COPIES = 2  # copies of a rank's state the tier holds at most: the committed one and one being written


def local_steps(rank_dir: Path, *, run_id: str, rank: int, world_size: int, mesh: Any) -> dict[int, str]:
    """{step: the attempt that saved it} of every committed step under `rank_dir` whose manifest reads and
    belongs to this run, rank, world size and mesh (files are not read here)."""
    out: dict[int, str] = {}
    for step, d in step_dirs(rank_dir):
        try:
            m = read_manifest(d, step=step)
        except (ManifestError, OSError):
            continue
        if (m.get("run_id"), m.get("rank"), m.get("world_size"), m.get("mesh")) == (run_id, rank, world_size, mesh):
            out[step] = str(m.get("attempt", ""))
    return out


def complete_steps(per_rank: list[dict[int, str]]) -> list[int]:
    """The steps every rank holds from one and the same save (the same saving attempt), newest first: a step
    one rank lacks, or holds from another attempt, is never one to load (never a mix of steps or of saves)."""
    if not per_rank:
        return []
    common = set(per_rank[0]).intersection(*per_rank[1:])
    return sorted((s for s in common if len({r[s] for r in per_rank}) == 1), reverse=True)


def capacity_error(per_rank: list[tuple[str, int, int]], *, memory_dir: str, every: int,
                   auto: bool = False) -> str | None:
    """Why the RAM tier does not fit, or None: per rank (node, bytes of its state, bytes free for the tier in
    memory_dir there); a node needs COPIES x the sum of its ranks' states. `auto`: the tier is on through
    checkpoint.memory_interval=auto (the message names that override)."""
    need: dict[str, int] = {}
    free: dict[str, int] = {}
    ranks: dict[str, int] = {}
    for node, nbytes, avail in per_rank:
        need[node] = need.get(node, 0) + COPIES * nbytes
        free[node] = max(free.get(node, 0), avail)
        ranks[node] = ranks.get(node, 0) + 1
    short = [n for n in sorted(need) if need[n] > free[n]]
    if not short:
        return None
    n = short[0]
    on, off = (("checkpoint.memory_interval=auto", "checkpoint.memory_interval=steps checkpoint.memory_every_steps=0")
               if auto else (f"checkpoint.memory_every_steps={every}", "checkpoint.memory_every_steps=0"))
    return (f"{on}: the RAM tier needs {need[n] / 2**20:.1f} MiB on node {n} "
            f"({COPIES} copies x {ranks[n]} ranks' state) but checkpoint.memory_dir={memory_dir} has "
            f"{free[n] / 2**20:.1f} MiB free there" + (f" (also short: {', '.join(short[1:])})" if len(short) > 1 else "")
            + f"; point checkpoint.memory_dir at a larger tmpfs, spread the ranks over more nodes, or set {off}")


class MemoryTierMixin:
    """CheckpointManager's methods of the RAM tier (`self.memory_root`, `self.run_id`, `self.cfg`, `self.rank`,
    `self.world_size`, `self.attempt`, `self.manifest_extra`, `self._ctl_pg`, `self._emit`, `self._all_gather`,
    `self._state_dict`, `self._apply_loaded`)."""

    @property
    def _rank_dir(self) -> Path:
        return self.memory_root / f"rank_{self.rank}"

    def memory_due(self, step: int) -> bool:
        """Whether `step` (just finished) goes to the RAM tier: every checkpoint.memory_every_steps, or once the tier's
        own interval (memory_interval=auto, CheckpointManager.memory_interval_steps) has passed since its last save;
        never the last step (the filesystem tier always saves that one). Identical on all ranks."""
        n = self.memory_interval_steps()
        if not self.cfg.enabled or n <= 0 or step <= self._last_memory_step:
            return False
        fixed = self.cfg.memory_interval == "steps"
        if (step % n) if fixed else (step - self._last_memory_step < n):
            return False
        return self.total_steps is None or step < self.total_steps

    def save_memory(self, step: int) -> None:
        """Writes this rank's state of `step` to the RAM tier and agrees on the commit with every rank; blocks
        for the whole save (a memory copy). A failure is recorded (`checkpoint_failed`, tier memory) and the
        step removed on every rank; training goes on."""
        if self._bound is None:
            raise RuntimeError("CheckpointManager.save_memory before load_latest: call load_latest(...) to bind the state")
        t0 = time.perf_counter()
        self._last_memory_step = step
        err, nbytes = None, 0
        try:
            nbytes = self._write_memory(step)
        except Exception as e:  # noqa: BLE001 - agreed on below
            err = describe_error(e, self.memory_root)
        gathered = self._all_gather((err, nbytes, time.perf_counter() - t0), self._ctl_pg)
        errors = [f"rank {r}: {e}" for r, (e, _, _) in enumerate(gathered) if e]
        if errors:
            shutil.rmtree(self._rank_dir / f"step_{step}", ignore_errors=True)  # never a step some rank lacks
            self._emit("checkpoint_failed", step=step, tier=MEMORY, error="; ".join(errors)[:2000])
            if self.rank == 0:
                log.warning("RAM checkpoint of step %d not committed (training goes on): %s", step, errors[0])
            return
        self._retire_memory(keep=step)
        self._retune_memory(step, max(g[2] for g in gathered))  # memory_interval=auto: the tier's interval from this cost
        self._emit("checkpoint_saved", step=step, tier=MEMORY, path=str(self.memory_root),
                   bytes=sum(g[1] for g in gathered), blocking_s=round(max(g[2] for g in gathered), 4),
                   total_s=round(time.perf_counter() - t0, 4))

    def _write_memory(self, step: int) -> int:
        """Writes and commits this rank's step folder (see the module docstring); returns its bytes."""
        d = self._rank_dir
        tmp, final = d / f"step_{step}.{self.attempt}.tmp", d / f"step_{step}"
        if tmp.exists():
            shutil.rmtree(tmp)
        d.mkdir(parents=True, exist_ok=True)
        writer = RecordingWriter(tmp, thread_count=1)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(_local_tree(self._state_dict()), storage_writer=writer, no_dist=True)
        files = dict(writer.records)
        for p in sorted(tmp.iterdir()):
            if p.name not in files:
                files[p.name] = file_record(p)
        nbytes = sum(f["size"] for f in files.values())
        write_manifest(tmp, {"step": step, "time": time.time(), "tier": MEMORY, "run_id": self.run_id,
                             "rank": self.rank, "world_size": self.world_size, "attempt": self.attempt,
                             "mesh": self.manifest_extra.get("mesh"), "node": platform.node(),
                             "files": files, "bytes": nbytes})
        if final.exists():  # this rank's copy of the same step from an earlier attempt: the new save replaces it
            shutil.rmtree(final)
        tmp.rename(final)  # the commit of this rank's share
        fsync_dir(d)
        return nbytes

    def _retire_memory(self, *, keep: int) -> None:
        """Deletes this rank's RAM steps other than `keep` and any leftover temporary folder."""
        if not self._rank_dir.is_dir():
            return
        for p in self._rank_dir.iterdir():
            if p.name != f"step_{keep}":
                shutil.rmtree(p, ignore_errors=True)

    def _memory_candidates(self) -> list[int]:
        """The steps complete in the RAM tier (every rank holds one from the same save), newest first; agreed."""
        if not self.cfg.memory_on:
            return []
        mine: dict[int, str] = {}
        try:
            mine = local_steps(self._rank_dir, run_id=self.run_id, rank=self.rank, world_size=self.world_size,
                               mesh=self.manifest_extra.get("mesh"))
        except OSError as e:
            log.warning("RAM tier %s unreadable on rank %d: %s", self._rank_dir, self.rank, e)
        return complete_steps(self._all_gather(mine, self._ctl_pg))

    def _validate_memory(self, step: int) -> tuple[Path, list[str], dict[str, Any] | None]:
        """This rank's folder of `step`, the problems every rank found in its own (agreed), its manifest."""
        d, manifest = self._rank_dir / f"step_{step}", None
        try:
            manifest = read_manifest(d, step=step)
            problems = [f"rank {self.rank}: {p}" for p in check_files(
                d, manifest["files"], sorted(manifest["files"]), checksum=self.cfg.verify == "checksum")]
        except ManifestError as e:
            problems = [f"rank {self.rank}: {e}"]
        except Exception as e:  # noqa: BLE001 - agreed on below like any problem
            problems = [f"rank {self.rank}: {describe_error(e, self.memory_root)}"]
        problems = sorted({p for ps in self._all_gather(problems, self._ctl_pg) for p in ps})
        return d, problems, (manifest if not problems else None)

    def _load_memory(self, d: Path, manifest: dict[str, Any]) -> dict[str, Any]:
        """Reads this rank's RAM folder into the bound objects (same mesh only: the candidates are filtered so)."""
        md_keys = set(FileSystemReader(str(d)).read_metadata().state_dict_metadata)
        part_keys: list[list[str]] = []
        sd = self._state_dict(md_keys, part_keys)
        local = _local_tree(sd)  # DTensors as their local shards: views of the same storage, loaded in place
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(local, checkpoint_id=str(d), no_dist=True)
        return self._apply_loaded(_keep_dtensors(sd, local), part_keys, resharded=False)

    def _after_load_memory(self, step: int) -> None:
        """After any load: this rank's RAM steps newer than the loaded one (incomplete, or of an abandoned
        timeline) and leftover temporary folders are deleted; older complete ones stay until the next commit."""
        self._last_memory_step = step
        if not self.cfg.memory_on or not self._rank_dir.is_dir():
            return
        for s, p in step_dirs(self._rank_dir):
            if s > step:
                shutil.rmtree(p, ignore_errors=True)
        for p in self._rank_dir.glob("step_*.tmp"):
            shutil.rmtree(p, ignore_errors=True)

    def local_state_bytes(self) -> int:
        """This rank's bytes in a checkpoint, from the bound objects without building their state dict: the
        local shards of parameters and buffers, and the optimizer state; before the first step (no optimizer
        state yet) estimated as two moments per trainable parameter (AdamW, its dtype)."""
        b = self._bound
        assert b is not None
        size = lambda t: _local(t).numel() * _local(t).element_size()  # noqa: E731
        nbytes = sum(size(t) for part in b["model_parts"] for t in (*part.parameters(), *part.buffers()))
        for opt in b["optimizers"]:
            if opt.state:
                nbytes += sum(size(t) for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor))
            else:
                nbytes += sum(2 * size(p) for g in opt.param_groups for p in g["params"] if p.requires_grad)
        return nbytes

    def check_memory_capacity(self, nbytes: int) -> None:
        """Raises CheckpointConfigError (a ValueError) on every rank when some node's checkpoint.memory_dir cannot hold COPIES of its
        ranks' states (`nbytes`: this rank's); what this run holds there already counts as free."""
        if not self.cfg.memory_on:
            return
        try:
            self.memory_root.mkdir(parents=True, exist_ok=True)
            avail = shutil.disk_usage(self.memory_root).free + _tree_bytes(self._rank_dir)
        except OSError as e:
            avail = -1
            log.error("checkpoint.memory_dir=%s unusable on rank %d: %s", self.cfg.memory_dir, self.rank, e)
        gathered = self._all_gather((platform.node(), int(nbytes), int(avail)), self._ctl_pg)
        why = capacity_error(gathered, memory_dir=self.cfg.memory_dir, every=self.cfg.memory_every_steps,
                             auto=self.cfg.memory_interval == "auto")
        if why is not None:
            raise CheckpointConfigError(why)

    def drop_memory(self) -> None:
        """Deletes this rank's RAM copies, and the run's root on this node once it is empty (the run finished or
        stopped with its state on the filesystem tier). Best effort: a failure is only logged."""
        if not self.cfg.memory_on:
            return
        shutil.rmtree(self._rank_dir, ignore_errors=True)
        try:
            self.memory_root.rmdir()
        except OSError:
            pass  # another rank of this node still has its folder there, or it is gone already


def _local_tree(obj: Any) -> Any:
    """The same nested dict with every DTensor replaced by its local shard (detached, same storage)."""
    if isinstance(obj, dict):
        return {k: _local_tree(v) for k, v in obj.items()}
    if isinstance(obj, DTensor):
        return obj.to_local().detach()
    return obj


def _keep_dtensors(sd: Any, loaded: Any) -> Any:
    """`sd`'s tensors (filled in place through their local views) with `loaded`'s non-tensor values (DCP
    replaces those in the dict it loads into)."""
    if isinstance(sd, dict):
        return {k: _keep_dtensors(v, loaded[k]) for k, v in sd.items()}
    return sd if isinstance(sd, torch.Tensor) else loaded


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0
