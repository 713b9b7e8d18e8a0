"""Checkpoint tiers benchmark: B11 failure -> first step from the RAM tier / from the filesystem tier, B12 training time lost per RAM save / per filesystem save, in one run.

    python scripts/bench/tiers.py [--ranks 2] [--dim 4096] [--layers 10] [--out bench.jsonl]   # ~1 GB state per rank
    python scripts/bench/tiers.py --ranks 1 --dim 4096 --layers 5                              # the same per rank, one rank

Every rank holds an FSDP2 shard of an MLP stack trained by AdamW (state = 3x params: --dim 4096 --layers 10 on 2 ranks
is 1.0 GB per rank). One CheckpointManager per rank with the RAM tier on (checkpoint.memory_dir under /dev/shm) and the
filesystem tier in its default async_mode=thread, verify=checksum, as a run gets them.

B12, in the first launch: rounds of three blocks of --b12-steps training steps each (the order rotates by round): a
plain one, one that begins with a RAM save (`save_memory`, blocking) and one that begins with a filesystem save
(`save`, thread) and ends once that save is committed (so a write the steps did not hide counts). Lost per save =
the median over rounds of (saving block - plain block); B12 = lost per RAM save / lost per filesystem save (goal
<= 0.1). The lost time of a synchronous filesystem save (async_mode=none) is printed beside it.

B11: the first launch ends with step S in both tiers (the filesystem's committed, the RAM tier's committed) and its
ranks die (os._exit, no cleanup, like kill -9). Then, in the same run, two fresh launches of the same ranks, each
timed from its start (the dead ranks' detection is the launcher's and the same for both) to the end of its first
training step: one whose manager finds step S in RAM (the ledger's checkpoint_loaded says tier=memory), one with the
RAM tier lost (a node lost or a requeue: tier off), which reads step S from the filesystem with the checkpoint's pages
dropped from the page cache first (posix_fadvise DONTNEED: a restart elsewhere reads storage, not this node's cache).
Both first steps must give the same loss (the two tiers hold the same state). B11 = RAM restart / filesystem restart
(goal <= 0.2). Ranks are forked from this process (torch already imported): process start is nearly free here, so the
ratio is the load's and the first step's; a real restart adds the same start-up, imports and rendezvous to both sides.
Prints the ratios and appends one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from checkpoint import CheckpointConfig, CheckpointManager  # noqa: E402
from _fork import gather_forked_ranks  # noqa: E402 - scripts/bench is on sys.path when run as a script
from _models import mlp_stack  # noqa: E402


def _step(model, opt, dim: int, seed: int) -> float:
    """One training step on a batch fixed by `seed`; returns its loss (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(16, dim, generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _manager(a: argparse.Namespace, rank: int, world: int, *, memory: bool, mode: str = "thread", events=None):
    cfg = CheckpointConfig(async_mode=mode, every_steps=1, keep=2, memory_every_steps=1 if memory else 0,
                           memory_dir=a.shm)
    sub = "fs" if mode != "none" else "fs_sync"
    emit = (lambda kind, **f: events.append((kind, f))) if events is not None else None
    return CheckpointManager(Path(a.dir) / sub, cfg=cfg, rank=rank, world_size=world, total_steps=10**6,
                             run_id="tierbench", emit=emit)


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _b12(model, opt, a: argparse.Namespace, rank: int, world: int) -> dict:
    """Rounds of a plain, a RAM-saving and a filesystem-saving block (rotating order); then step S in both tiers."""
    ck = _manager(a, rank, world, memory=True)
    ck.load_latest(model_parts=[model], optimizers=[opt])
    times: dict[str, list[float]] = {"plain": [], "memory": [], "filesystem": []}
    arms = ("plain", "memory", "filesystem")
    step = 0
    for r in range(a.b12_rounds):
        for arm in arms[r % 3:] + arms[:r % 3]:
            _barrier(world)
            t0 = time.perf_counter()
            step += 1
            if arm == "memory":
                ck.save_memory(step)
            elif arm == "filesystem":
                ck.save(step)
            for i in range(a.b12_steps):
                _step(model, opt, a.dim, seed=1000 * step + i)
            if arm == "filesystem":
                ck.wait()
            times[arm].append(time.perf_counter() - t0)
    step += 1  # B11's step S: committed in both tiers
    ck.save(step)
    ck.wait()
    ck.save_memory(step)
    ck.close()
    return {"b12_times": times, "last_step": step}


def _sync_lost(model, opt, a: argparse.Namespace, rank: int, world: int) -> list[float]:
    """A synchronous filesystem save's lost time (its whole duration), --saves times, for reference."""
    ck = _manager(a, rank, world, memory=False, mode="none")
    ck.load_latest(model_parts=[model], optimizers=[opt])
    out = []
    for i in range(1, a.saves + 1):
        _barrier(world)
        t0 = time.perf_counter()
        ck.save(i)
        out.append(time.perf_counter() - t0)
    ck.close()
    return out


def _restart(a: argparse.Namespace, rank: int, world: int, t_launch: float, *, memory: bool) -> dict:
    """A fresh launch after the failure: build, load the newest checkpoint (RAM when `memory` and it is there), one
    training step; seconds from the launch to the end of that step, the tier read and the step's loss."""
    events: list = []
    model, opt = mlp_stack(a.dim, a.layers, world)
    ck = _manager(a, rank, world, memory=memory, events=events)
    t_load = time.time()
    step = ck.load_latest(model_parts=[model], optimizers=[opt])
    load_s = time.time() - t_load
    loss = _step(model, opt, a.dim, seed=7)
    out = {"to_first_step_s": time.time() - t_launch, "load_s": load_s, "step": step, "loss": loss}
    ck.close()
    loaded = [f for k, f in events if k == "checkpoint_loaded"]
    out["tier"] = loaded[0]["tier"] if loaded else None
    return out


def _rank(rank: int, world: int, a: argparse.Namespace, t_launch: float) -> dict:
    if a.phase == "train":
        model, opt = mlp_stack(a.dim, a.layers, world)
        _step(model, opt, a.dim, seed=0)  # the optimizer state exists: the saves hold all of it
        out = {"sync_lost_s": _sync_lost(model, opt, a, rank, world)}
        out.update(_b12(model, opt, a, rank, world))
        out["bytes"] = sum(p.stat().st_size for p in (Path(a.shm) / "meshjob-tierbench" / f"rank_{rank}").rglob("*")
                           if p.is_file())
        return out
    return _restart(a, rank, world, t_launch, memory=a.phase == "memory")


def _drop_cache(root: Path) -> None:
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _launch(a: argparse.Namespace) -> list[dict]:
    t_launch = time.time()

    def rank_result(rank: int, started: float) -> dict:
        # the failure: no process-group teardown, no cleanup (the RAM tier's copies stay, as after kill -9)
        torch.set_num_threads(a.threads)
        return _rank(rank, a.ranks, a, t_launch)

    return gather_forked_ranks(a.ranks, rank_result, timeout_s=900, teardown=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: the cores / --ranks)")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--saves", type=int, default=2, help="synchronous filesystem saves timed for reference")
    ap.add_argument("--b12-rounds", type=int, default=6, help="B12: rounds of a plain, a RAM and a filesystem block")
    ap.add_argument("--b12-steps", type=int, default=4, help="B12: training steps per block")
    ap.add_argument("--dir", default="/tmp/meshjob-tierbench")
    ap.add_argument("--shm", default="/dev/shm/meshjob-tierbench", help="the RAM tier's checkpoint.memory_dir")
    ap.add_argument("--out", default=None, help="append the JSON line here too")
    a = ap.parse_args()
    cores = os.cpu_count() or 1
    a.threads = a.threads or max(1, cores // a.ranks)
    for d in (a.dir, a.shm):
        shutil.rmtree(d, ignore_errors=True)
        Path(d).mkdir(parents=True)
    try:
        row = _run(a, cores)
    finally:
        for d in (a.dir, a.shm):
            shutil.rmtree(d, ignore_errors=True)
    line = json.dumps(row)
    print(line)
    if a.out:
        with open(a.out, "a") as f:
            f.write(line + "\n")
    return 0


def _run(a: argparse.Namespace, cores: int) -> dict:
    a.phase = "train"
    train = _launch(a)
    a.phase = "memory"
    ram = _launch(a)
    a.phase = "fs"
    _drop_cache(Path(a.dir) / "fs")  # before the launch: not timed
    fs = _launch(a)
    row: dict = {"bench": "tiers", "ranks": a.ranks, "threads_per_rank": a.threads, "cores": cores, "dim": a.dim,
                 "layers": a.layers, "bytes_per_rank_max": max(o["bytes"] for o in train), "time": time.time()}
    # the ledger's checkpoint_loaded comes from rank 0 (the manager emits on rank 0 only)
    assert (ram[0]["tier"], fs[0]["tier"]) == ("memory", "filesystem"), (ram, fs)
    assert {o["step"] for o in ram + fs} == {train[0]["last_step"]}
    assert len({o["loss"] for o in ram + fs}) == 1, "the RAM and the filesystem tier restored different states"
    _b11(row, ram, fs)
    _b12_row(row, train, a)
    return row


def _b11(row: dict, ram: list[dict], fs: list[dict]) -> None:
    worst = lambda grp, k: max(o[k] for o in grp)  # noqa: E731 - the slowest rank sets the step
    row.update(ram_restart_s=worst(ram, "to_first_step_s"), fs_restart_s=worst(fs, "to_first_step_s"),
               ram_load_s=worst(ram, "load_s"), fs_load_s=worst(fs, "load_s"))
    row["B11_ram_over_fs_restart"] = row["ram_restart_s"] / row["fs_restart_s"]
    print(f"state {row['bytes_per_rank_max'] / 1e9:.2f} GB per rank on {row['ranks']} ranks; {row['cores']} cores, "
          f"{row['threads_per_rank']} torch threads per rank")
    print(f"B11 failure->first step, RAM / filesystem = {row['B11_ram_over_fs_restart']:.3f}  (goal <= 0.2)  "
          f"[{row['ram_restart_s']:.2f} s (load {row['ram_load_s']:.2f} s) vs {row['fs_restart_s']:.2f} s "
          f"(load {row['fs_load_s']:.2f} s, page cache dropped)]")


def _b12_row(row: dict, train: list[dict], a: argparse.Namespace) -> None:
    t = [o["b12_times"] for o in train]
    block = {arm: [max(x[arm][i] for x in t) for i in range(len(t[0][arm]))] for arm in t[0]}
    lost = {arm: statistics.median(s - p for s, p in zip(block[arm], block["plain"])) for arm in ("memory", "filesystem")}
    row.update(ram_lost_per_save_s=lost["memory"], fs_lost_per_save_s=lost["filesystem"],
               plain_block_s=statistics.median(block["plain"]),
               fs_sync_save_s=statistics.median(max(o["sync_lost_s"][i] for o in train) for i in range(a.saves)))
    row["B12_ram_over_fs_lost"] = lost["memory"] / lost["filesystem"] if lost["filesystem"] > 0 else float("inf")
    print(f"B12 lost per save, RAM / filesystem = {row['B12_ram_over_fs_lost']:.3f}  (goal <= 0.1)  "
          f"[{lost['memory']:.3f} s vs {lost['filesystem']:.3f} s (async_mode=thread, to its commit) over "
          f"{a.b12_steps} steps (plain block {row['plain_block_s']:.3f} s); a synchronous filesystem save "
          f"{row['fs_sync_save_s']:.3f} s: RAM / sync {lost['memory'] / row['fs_sync_save_s']:.3f}]")


if __name__ == "__main__":
    sys.exit(main())
