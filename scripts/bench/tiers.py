"""Checkpoint tiers benchmark: B11 failure -> first step from the RAM tier / from the filesystem tier, B12 training time lost per RAM save / per filesystem save, in one run.

    python scripts/bench/tiers.py [--ranks 2] [--dim 4096] [--layers 10] [--out bench.jsonl]   # ~1 GB state per rank
    python scripts/bench/tiers.py --ranks 1 --dim 4096 --layers 5                              # the same per rank, one rank
    python scripts/bench/tiers.py --ranks 1 --dim 4096 --layers 5 --threads 1                  # a core left to the savers

Every rank holds an FSDP2 shard of an MLP stack trained by AdamW (state = 3x params: --dim 4096 --layers 10 on 2 ranks
is 1.0 GB per rank). One CheckpointManager per rank with the RAM tier on (checkpoint.memory_dir under /dev/shm) and
both tiers in the default async_mode=thread, verify=checksum, as a run gets them.

B12, in the first launch: rounds of three blocks of --b12-steps training steps each (the order rotates by round): a
plain one, one that begins with a RAM save (`save_memory`: the step waits for its staging copy, the write runs on the
tier's thread) and one that begins with a filesystem save (`save`); both saving blocks end once their save is
committed (`wait_memory` / `wait`), so a write the steps did not hide counts; one untimed round first (a tier's
first save allocates its staging buffers, once per run). Lost per save = the median over rounds of
(saving block - plain block of the same round); B12 = lost per RAM save / lost per filesystem save (goal <= 0.1). Each
block's save call, steps and final wait are kept apart; a synchronous filesystem save (async_mode=none) is timed too.
Beside the wall clock, the CPU seconds a save adds to its block (the rank's process, all its threads): what it takes
from the steps when every core is busy, and not moved by other processes' load as block times are on a shared box.

B11: the first launch ends with step S in both tiers and its ranks die (os._exit, no cleanup, like kill -9). Then, in
the same run, --b11-rounds rounds of two fresh launches of the same ranks (RAM first in even rounds, filesystem first
in odd ones), each timed from its start (the dead ranks' detection is the launcher's and the same for both) to the end
of its first training step: one whose manager finds step S in RAM (the ledger's checkpoint_loaded says tier=memory),
one with the RAM tier lost (a node lost or a requeue: tier off), which reads step S from the filesystem. Before each
filesystem launch the checkpoint's files are evicted from the page cache (posix_fadvise DONTNEED on each file, which the
save fsync'ed: clean pages go; targeted, where `echo 1 > drop_caches` would evict the whole shared box's cache) and the
bytes still cached are counted (fincore), so that launch reads the disk, as a restart elsewhere reads storage, not
this node's cache (this VM's virtual disk may still be cached by its host). Every first step must give the same loss
(the tiers hold the same state). B11 = median RAM restart / median filesystem restart (goal <= 0.2). Each launch's
seconds are split: rank start, model build, manager init, load_latest (listing both tiers' steps, checksum: manifest and
crc32 of every file, DCP load: state dict build + dcp.load, apply: set_state_dict) and the first step. Ranks are forked
from this process (torch and AdamW's lazy imports already done): process start is nearly free here, so the ratio is the
load's and the first step's; a real restart adds the same start-up, imports and rendezvous to both sides.
Prints the ratios and appends one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _fork import gather_forked_ranks  # noqa: E402 - scripts/bench is on sys.path when run as a script
from _models import mlp_stack  # noqa: E402
from _slowfs import add_bench_args, run_in_bench_dir  # noqa: E402

from checkpoint import CheckpointConfig, CheckpointManager  # noqa: E402

ARMS = ("plain", "memory", "filesystem")
# load_latest's parts, timed by wrapping the manager's methods on the instance (the product is unchanged)
_LOAD_PARTS = {
    "fs_restore.candidates": "list",
    "memory.candidates": "list",
    "fs_restore.validate": "checksum",
    "memory.validate": "checksum",
    "state.state_dict": "state_dict",
    "state.apply_loaded": "apply",
    "fs_restore.load": "load",
    "memory.load": "load",
}


def _step(model, opt, dim: int, seed: int) -> float:
    """One training step on a batch fixed by `seed`; returns its loss (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    loss = model(torch.randn(16, dim, generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def _manager(a: argparse.Namespace, rank: int, world: int, *, memory: bool, mode: str = "thread", events=None):
    cfg = CheckpointConfig(
        async_mode=mode, every_steps=1, keep=2, memory_every_steps=1 if memory else 0, memory_dir=a.shm
    )
    sub = "fs" if mode != "none" else "fs_sync"
    emit = (lambda kind, **f: events.append((kind, f))) if events is not None else None
    return CheckpointManager(
        Path(a.dir) / sub, cfg=cfg, rank=rank, world_size=world, total_steps=10**6, run_id="tierbench", emit=emit
    )


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _block(ck, model, opt, a: argparse.Namespace, arm: str, step: int) -> dict:
    """One B12 block: the save of `arm` (none for plain), --b12-steps steps, the wait for that save's commit."""
    t0, cpu0 = time.perf_counter(), time.process_time()
    if arm == "memory":
        ck.save_memory(step)
    elif arm == "filesystem":
        ck.save(step)
    t1 = time.perf_counter()
    steps = []
    for i in range(a.b12_steps):
        ts = time.perf_counter()
        _step(model, opt, a.dim, seed=1000 * step + i)
        steps.append(time.perf_counter() - ts)
    t2 = time.perf_counter()
    if arm == "memory":
        ck.wait_memory()
    elif arm == "filesystem":
        ck.wait()
    t3 = time.perf_counter()
    return {"total": t3 - t0, "call": t1 - t0, "steps": steps, "wait": t3 - t2, "cpu": time.process_time() - cpu0}


def _b12(model, opt, a: argparse.Namespace, rank: int, world: int) -> dict:
    """Rounds of a plain, a RAM-saving and a filesystem-saving block (rotating order); then step S in both tiers."""
    ck = _manager(a, rank, world, memory=True)
    ck.load_latest(model_parts=[model], optimizers=[opt])
    blocks: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    step = 0
    for arm in ARMS:  # warm-up, not timed: the first save of each tier allocates its staging buffers
        step += 1
        _block(ck, model, opt, a, arm, step)
    for r in range(a.b12_rounds):
        for arm in ARMS[r % 3 :] + ARMS[: r % 3]:
            _barrier(world)
            step += 1
            blocks[arm].append(_block(ck, model, opt, a, arm, step))
            if rank == 0:
                print(f"  B12 round {r} {arm:10} block {blocks[arm][-1]['total']:.2f} s", flush=True)
    step += 1  # B11's step S: committed in both tiers
    ck.save(step)
    ck.wait()
    ck.save_memory(step)
    ck.close()
    return {"b12_blocks": blocks, "last_step": step}


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


def _time_load_parts(ck) -> dict[str, float]:
    """Wraps the manager's load methods on this instance; returns the seconds each part took, summed."""
    spent = {part: 0.0 for part in _LOAD_PARTS.values()}

    def wrap(name: str, part: str):
        *path, name = name.split(".")  # a part's method: "state.state_dict", "fs_restore.load"
        owner = ck
        for attr in path:
            owner = getattr(owner, attr)
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - t0

        setattr(owner, name, timed)

    for name, part in _LOAD_PARTS.items():
        wrap(name, part)
    return spent


def _restart(a: argparse.Namespace, rank: int, world: int, t_launch: float, started: float, *, memory: bool) -> dict:
    """A fresh launch after the failure: build, load the newest checkpoint (RAM when `memory` and it is there), one
    training step; seconds from the launch to the end of that step and its parts, the tier read and the step's loss."""
    events: list = []
    t_start = time.perf_counter()
    model, opt = mlp_stack(a.dim, a.layers, world)
    t_model = time.perf_counter()
    ck = _manager(a, rank, world, memory=memory, events=events)
    spent = _time_load_parts(ck)
    t_mgr = time.perf_counter()
    step = ck.load_latest(model_parts=[model], optimizers=[opt])
    t_load = time.perf_counter()
    loss = _step(model, opt, a.dim, seed=7)
    t_step = time.perf_counter()
    done = time.time()
    ck.close()
    load = t_load - t_mgr
    parts = {
        "rank_start": started - t_launch,
        "model": t_model - t_start,
        "manager_init": t_mgr - t_model,
        "load_latest": load,
        "list": spent["list"],
        "checksum": spent["checksum"],
        "dcp_load": spent["load"] - spent["apply"],
        "apply": spent["apply"],
        "load_other": load - spent["list"] - spent["checksum"] - spent["load"],
        "first_step": t_step - t_load,
    }
    parts["state_dict"] = spent["state_dict"]  # inside dcp_load: the state dict the checkpoint is read into
    loaded = [f for k, f in events if k == "checkpoint_loaded"]
    return {
        "to_first_step_s": done - t_launch,
        "parts_s": parts,
        "step": step,
        "loss": loss,
        "tier": loaded[0]["tier"] if loaded else None,
    }


def _rank(rank: int, world: int, a: argparse.Namespace, t_launch: float, started: float) -> dict:
    if a.phase == "train":
        model, opt = mlp_stack(a.dim, a.layers, world)
        _step(model, opt, a.dim, seed=0)  # the optimizer state exists: the saves hold all of it
        out = {"sync_lost_s": _sync_lost(model, opt, a, rank, world)}
        out.update(_b12(model, opt, a, rank, world))
        out["bytes"] = sum(
            p.stat().st_size for p in (Path(a.shm) / "meshjob-tierbench").rglob(f"rank_{rank}/**/*") if p.is_file()
        )
        return out
    return _restart(a, rank, world, t_launch, started, memory=a.phase == "memory")


def _evict(root: Path) -> int | None:
    """Evicts `root`'s files from the page cache (fsync, then posix_fadvise DONTNEED: clean pages go); returns the
    bytes still cached after (fincore), None where fincore is missing."""
    files = [p for p in root.rglob("*") if p.is_file()]
    for p in files:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(x) for x in out.split())


def _launch(a: argparse.Namespace) -> list[dict]:
    t_launch = time.time()

    def rank_result(rank: int, started: float) -> dict:
        # the failure: no process-group teardown, no cleanup (the RAM tier's copies stay, as after kill -9)
        torch.set_num_threads(a.threads)
        return _rank(rank, a.ranks, a, t_launch, started)

    return gather_forked_ranks(a.ranks, rank_result, timeout_s=900, teardown=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_bench_args(ap, folder="/tmp/meshjob-tierbench", what="--dir (the filesystem tier)")
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--saves", type=int, default=2, help="synchronous filesystem saves timed for reference (0: none)")
    ap.add_argument("--b12-rounds", type=int, default=3, help="B12: rounds of a plain, a RAM and a filesystem block")
    ap.add_argument("--b12-steps", type=int, default=6, help="B12: training steps per block")
    ap.add_argument("--b11-rounds", type=int, default=3, help="B11: rounds of a RAM and a filesystem restart")
    ap.add_argument("--shm", default="/dev/shm/meshjob-tierbench", help="the RAM tier's checkpoint.memory_dir")
    return run_in_bench_dir(ap.parse_args(), _main)


def _main(a: argparse.Namespace) -> int:
    cores = os.cpu_count() or 1
    a.threads = a.threads or max(1, cores // a.ranks)
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])  # its lazy imports (~1 s) once here, not in every launch
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
    row: dict = {
        "bench": "tiers",
        "ranks": a.ranks,
        "threads_per_rank": a.threads,
        "cores": cores,
        "cores_free": max(0, cores - a.ranks * a.threads),
        "dim": a.dim,
        "layers": a.layers,
        "slow_fs_MBps_per_rank": a.slow_fs,
        "time": time.time(),
        "loadavg_start": os.getloadavg(),
    }
    a.phase = "train"
    train = _launch(a)
    row["bytes_per_rank_max"] = max(o["bytes"] for o in train)
    print(
        f"state {row['bytes_per_rank_max'] / 1e9:.2f} GB per rank on {row['ranks']} ranks; {row['cores']} cores, "
        f"{row['threads_per_rank']} torch threads per rank; load average {row['loadavg_start'][0]:.1f} at the start",
        flush=True,
    )
    _b12_row(row, train, a)
    restarts: dict[str, list[list[dict]]] = {"memory": [], "fs": []}
    cached = []
    for r in range(a.b11_rounds):
        for tier in ("memory", "fs") if r % 2 == 0 else ("fs", "memory"):
            if tier == "fs":
                cached.append(_evict(Path(a.dir) / "fs"))  # before the launch: not timed
            a.phase = tier
            restarts[tier].append(_launch(a))
            print(f"  B11 round {r} {tier:6} restart: {_launch_summary(restarts[tier][-1])}", flush=True)
    row["loadavg_end"] = os.getloadavg()
    ram, fs = restarts["memory"], restarts["fs"]
    # the ledger's checkpoint_loaded comes from rank 0 (the manager emits on rank 0 only)
    assert {g[0]["tier"] for g in ram} == {"memory"} and {g[0]["tier"] for g in fs} == {"filesystem"}, (ram, fs)
    everyone = [o for g in ram + fs for o in g]
    assert {o["step"] for o in everyone} == {train[0]["last_step"]}
    assert len({o["loss"] for o in everyone}) == 1, "the RAM and the filesystem tier restored different states"
    row["fs_cached_bytes_after_evict"] = cached
    _b11(row, ram, fs)
    return row


def _launch_summary(group: list[dict]) -> dict:
    """One launch: the slowest rank's time to its first step, and each part's max over the ranks."""
    parts = {k: round(max(o["parts_s"][k] for o in group), 3) for k in group[0]["parts_s"]}
    return {"to_first_step_s": round(max(o["to_first_step_s"] for o in group), 3), **parts}


def _b11(row: dict, ram: list[list[dict]], fs: list[list[dict]]) -> None:
    row["b11_ram"] = [_launch_summary(g) for g in ram]
    row["b11_fs"] = [_launch_summary(g) for g in fs]
    med = {k: {p: statistics.median(x[p] for x in row[k]) for p in row[k][0]} for k in ("b11_ram", "b11_fs")}
    row["ram_restart_s"], row["fs_restart_s"] = med["b11_ram"]["to_first_step_s"], med["b11_fs"]["to_first_step_s"]
    row["B11_ram_over_fs_restart"] = row["ram_restart_s"] / row["fs_restart_s"]
    row["b11_rounds_ratio"] = [
        r["to_first_step_s"] / f["to_first_step_s"] for r, f in zip(row["b11_ram"], row["b11_fs"])
    ]
    print(f"load average {row['loadavg_end'][0]:.1f} at the end")
    print(
        f"B11 failure->first step, RAM / filesystem = {row['B11_ram_over_fs_restart']:.3f}  (goal <= 0.2)  "
        f"[medians of {len(ram)}: {row['ram_restart_s']:.2f} s vs {row['fs_restart_s']:.2f} s (page cache evicted, "
        f"bytes still cached: {row['fs_cached_bytes_after_evict']}); per round "
        f"{', '.join(f'{x:.3f}' for x in row['b11_rounds_ratio'])}]"
    )
    for k, name in (("b11_ram", "RAM"), ("b11_fs", "filesystem")):
        print(f"   {name:10} median s: " + ", ".join(f"{p} {v:.2f}" for p, v in med[k].items()))


def _b12_row(row: dict, train: list[dict], a: argparse.Namespace) -> None:
    per_rank = [o["b12_blocks"] for o in train]
    # the slowest rank's block sets the time lost (the others wait for it at the next collective)
    total = {arm: [max(b[arm][i]["total"] for b in per_rank) for i in range(a.b12_rounds)] for arm in ARMS}
    lost_each = {arm: [s - p for s, p in zip(total[arm], total["plain"])] for arm in ("memory", "filesystem")}
    lost = {arm: statistics.median(v) for arm, v in lost_each.items()}
    rank0 = per_rank[0]
    row.update(
        ram_lost_per_save_s=lost["memory"],
        fs_lost_per_save_s=lost["filesystem"],
        ram_lost_each_s=lost_each["memory"],
        fs_lost_each_s=lost_each["filesystem"],
        plain_block_s=statistics.median(total["plain"]),
        b12_blocks_rank0=rank0,
        fs_sync_save_s=statistics.median(max(o["sync_lost_s"][i] for o in train) for i in range(a.saves))
        if a.saves
        else None,
    )
    row["B12_ram_over_fs_lost"] = lost["memory"] / lost["filesystem"] if lost["filesystem"] > 0 else float("inf")
    # the CPU seconds a save adds to its block (all the rank's threads): what it takes from the steps when every core
    # is busy, and unlike wall-clock blocks not moved by other processes' load
    cpu = {
        arm: statistics.median(s["cpu"] - p["cpu"] for s, p in zip(rank0[arm], rank0["plain"]))
        for arm in ("memory", "filesystem")
    }
    row.update(
        ram_cpu_per_save_s=cpu["memory"],
        fs_cpu_per_save_s=cpu["filesystem"],
        B12_cpu_ram_over_fs=cpu["memory"] / cpu["filesystem"] if cpu["filesystem"] > 0 else float("inf"),
    )
    print(
        f"B12 lost per save, RAM / filesystem = {row['B12_ram_over_fs_lost']:.3f}  (goal <= 0.1)  "
        f"[medians of {a.b12_rounds}: {lost['memory']:.3f} s vs {lost['filesystem']:.3f} s (both async, each block "
        f"to its save's commit) over {a.b12_steps} steps (plain block {row['plain_block_s']:.3f} s); "
        + (
            f"a synchronous filesystem save {row['fs_sync_save_s']:.3f} s: RAM / sync "
            f"{lost['memory'] / row['fs_sync_save_s']:.3f}; "
            if a.saves
            else ""
        )
        + f"{row['cores_free']} cores left free beside the ranks' torch threads for the savers' threads]",
        flush=True,
    )
    print(
        f"   CPU seconds a save adds to its block (rank 0, medians), RAM / filesystem = "
        f"{row['B12_cpu_ram_over_fs']:.3f}  [{cpu['memory']:.3f} s vs {cpu['filesystem']:.3f} s]",
        flush=True,
    )
    for arm in ARMS:
        med = {k: statistics.median(b[k] for b in rank0[arm]) for k in ("call", "wait")}
        first = statistics.median(b["steps"][0] for b in rank0[arm])
        rest = statistics.median(s for b in rank0[arm] for s in b["steps"][1:]) if a.b12_steps > 1 else 0.0
        print(
            f"   rank 0 {arm:10} median s: save call {med['call']:.3f}, first step {first:.3f}, "
            f"later steps {rest:.3f} each, wait for the commit {med['wait']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
