"""Measures the trainer's per-step overhead: `Trainer.train_step` vs a bare torch loop on the same model, mesh and batches.

    python scripts/bench/step_overhead.py [--rounds 8 --block 2 --warmup 2 --phases --telemetry] [hydra overrides, e.g. mesh.tp=1 mesh.dp_shard=4]

Every rank builds both (a) a bare loop (the same `parallelize()` / `build_schedule()` calls, the
same BatchSource batches, AdamW; no grad clipping, LR schedule, loss reduction or metrics) and
(b) the real `jobs.trainer.Trainer`, warms up each, then alternates blocks of steps (ABBA order
per round) so machine drift hits both alike. A step's time is the slowest rank's, each step
started after a barrier. Rank 0 prints one human line, then one JSON line. With --phases it also
times the pieces of the trainer's step (see `_trainer_phases`) to show where any overhead goes.
With --telemetry a third runner joins the rotation: a second Trainer with metrics.phase_timing=false;
the trainer runners also end each step as `Trainer.fit` does (`telemetry.step_done`: the row, and at
each train.log_every the HDF5 flush and the straggler all-reduce), and the JSON line gets
`telemetry_ratio` = trainer (phase timing on) / trainer (off), goal <= 1.03, and
`telemetry_cpu_ratio`, the same for rank 0's CPU time (on a loaded machine the wall-clock ratio
mostly measures the neighbours).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import ctypes
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

import torch  # noqa: E402 - imported once in the parent, before forking the ranks
import torch.distributed as dist  # noqa: E402
from _fork import join_group, published_port, run_forked_ranks  # noqa: E402 - scripts/bench is on sys.path when run as a script
from torch.distributed.tensor.parallel import loss_parallel  # noqa: E402

from jobs import trainer as trainer_mod  # noqa: E402
from jobs.config import JobConfig, compose  # noqa: E402
from jobs.data import BatchSource, ensure_dataset  # noqa: E402
from jobs.events import EventLog  # noqa: E402
from jobs.launch.env import DistEnv  # noqa: E402
from jobs.models.model import Transformer, init_weights  # noqa: E402
from jobs.validate import Derived, validate  # noqa: E402
from parallel.pipeline import build_schedule  # noqa: E402
from parallel.recipe import parallelize  # noqa: E402

_PR_SET_PDEATHSIG = 1


class BareLoop:
    """The minimal hand-written step: batch -> forward/backward (schedule or accumulation) -> AdamW."""

    def __init__(self, cfg: JobConfig, derived: Derived) -> None:
        dims = derived.dims
        self.cfg, self.n_micro = cfg, derived.microbatches
        self.mesh = dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(cfg.model)
        self.parts, stages = parallelize(
            model,
            dims=dims,
            mesh=self.mesh,
            stages_per_rank=derived.stages_per_rank,
            pp_schedule=cfg.mesh.pp_schedule,
            sequence_parallel=cfg.mesh.sequence_parallel,
            loss_parallel=cfg.mesh.loss_parallel,
            pp_layers_per_stage=derived.pp_layers_per_stage,
        )
        for part in self.parts:
            part.to_empty(device="cpu")
            init_weights(part, seed=cfg.train.seed)
            part.train()
        self.first, self.last = 0 in stages, derived.num_stages - 1 in stages
        self.fsdp = dims.fsdp_enabled
        self.schedule = None
        if dims.pp_enabled:
            self.schedule = build_schedule(
                self.parts,
                stages,
                num_stages=derived.num_stages,
                schedule=cfg.mesh.pp_schedule,
                n_microbatches=self.n_micro,
                pp_group=self.mesh.get_group("pp"),
                device=torch.device("cpu"),
                loss_fn=trainer_mod.cross_entropy,
            )
        o = cfg.optim
        self.opts = [
            torch.optim.AdamW(
                p.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, foreach=True
            )
            for p in self.parts
        ]
        self.data = BatchSource(
            cfg.data.path,
            seed=cfg.train.seed,
            global_batch=cfg.train.global_batch,
            seq_len=cfg.train.seq_len,
            dp_rank=dims.dp_rank(self.mesh),
            dp=dims.dp,
        )
        self.lp = dims.tp_enabled and cfg.mesh.loss_parallel

    def step(self, step: int) -> None:
        self.forward_backward(*self.data.batch(step))
        self.optimizer()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> None:
        ctx = loss_parallel() if self.lp else contextlib.nullcontext()
        if self.schedule is not None:
            with ctx:
                self.schedule.step(
                    *((x,) if self.first else ()),
                    target=y if self.last else None,
                    losses=[] if self.last else None,
                    return_outputs=False,
                )
        else:
            (model,) = self.parts
            for i, (xm, ym) in enumerate(zip(x.chunk(self.n_micro), y.chunk(self.n_micro))):
                if self.fsdp:
                    model.set_requires_gradient_sync(i == self.n_micro - 1)
                with ctx:
                    (trainer_mod.cross_entropy(model(xm), ym) / self.n_micro).backward()

    def optimizer(self) -> None:
        for opt in self.opts:
            opt.step()
            opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        self.data.close()


def _timed_part(out: dict[str, float], name: str, fn):
    """Runs `fn` after a barrier and records its time under `name`.

    The barrier keeps the pipeline's rank skew out of the part that follows forward/backward (its
    first collective would otherwise absorb the wait for the slowest stage).
    """
    dist.barrier()
    t0 = time.perf_counter()
    r = fn()
    out[name] = time.perf_counter() - t0
    return r


def _trainer_phases(tr: trainer_mod.Trainer, step: int) -> dict[str, float]:
    """Trainer.train_step's parts (the same Trainer methods it calls), each timed."""
    out: dict[str, float] = {}
    inputs, targets = _timed_part(out, "data", lambda: tr.data.batch(step))
    local_loss = _timed_part(out, "forward_backward", lambda: tr.forward_backward(inputs, targets))
    if not tr.derived.dims.fsdp_enabled:
        _timed_part(out, "replicate_partial_grads", lambda: trainer_mod._replicate_partial_grads(tr.parts))
    grad_norm, _, _ = _timed_part(out, "grad_norm_loss_all_reduce", lambda: tr.reduce_totals(local_loss))
    _timed_part(
        out, "clip", lambda: trainer_mod.clip_grads_(tr.parts, max_norm=tr.cfg.optim.grad_clip, total_norm=grad_norm)
    )
    _timed_part(out, "optimizer_lr", tr.optimizer_step)
    return out


def _bare_phases(bare: BareLoop, step: int) -> dict[str, float]:
    """The bare step's parts, timed like `_trainer_phases` (names prefixed bare_)."""
    out: dict[str, float] = {}
    x, y = _timed_part(out, "bare_data", lambda: bare.data.batch(step))
    _timed_part(out, "bare_forward_backward", lambda: bare.forward_backward(x, y))
    _timed_part(out, "bare_optimizer", bare.optimizer)
    return out


def _as_in_fit(tr: trainer_mod.Trainer):
    """One step as Trainer.fit runs it, telemetry included (fit numbers steps from 1)."""

    def step(s: int) -> None:
        tr.train_step(s)
        tr.telemetry.step_done(s + 1, interval_end=(s + 1) % tr.cfg.train.log_every == 0)

    return step


def _timed(fn, step: int, cpu: list[float] | None = None) -> float:
    """The step's wall time; its CPU time (all of this rank's threads) appended to `cpu`."""
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    fn(step)
    if cpu is not None:
        cpu.append(time.process_time() - c0)
    return time.perf_counter() - t0


def _slowest(times: list[float]) -> list[float]:
    """Per-step max over ranks (a step ends when its slowest rank does)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


class _Rotation:
    """The runners taking turns; each walks the same batches 0, 1, 2, ... and keeps the times it records."""

    def __init__(self, runners: dict[str, Callable[[int], None]]) -> None:
        self.runners = runners
        self.cursor = dict.fromkeys(runners, 0)
        self.times: dict[str, list[float]] = {name: [] for name in runners}
        self.cpu_times: dict[str, list[float]] = {name: [] for name in runners}  # less sensitive to a loaded machine

    def run(self, name: str, n: int, record: bool) -> list[float]:
        out = []
        for _ in range(n):
            out.append(_timed(self.runners[name], self.cursor[name], self.cpu_times[name] if record else None))
            self.cursor[name] += 1
        if record:
            self.times[name].extend(out)
        return out


def _alternate(rot: _Rotation, *, warmup: int, rounds: int, block: int) -> tuple[list[float], list[float]]:
    """Warms up every runner, then runs `rounds` rounds of one block each, in ABBA order; (trainer/bare per round,
    trainer/trainer_off per round, empty without trainer_off), each from the medians of the slowest rank's steps."""
    for name in rot.runners:
        rot.run(name, warmup, record=False)
    round_ratios: list[float] = []
    tel_ratios: list[float] = []
    for r in range(rounds):
        order = tuple(rot.runners) if r % 2 == 0 else tuple(reversed(rot.runners))
        got = {name: _slowest(rot.run(name, block, record=True)) for name in order}
        round_ratios.append(statistics.median(got["trainer"]) / statistics.median(got["bare"]))
        if "trainer_off" in got:
            tel_ratios.append(statistics.median(got["trainer"]) / statistics.median(got["trainer_off"]))
    return round_ratios, tel_ratios


def _phase_medians(tr: trainer_mod.Trainer, bare: BareLoop, cursor: dict[str, int], *, steps: int) -> dict[str, float]:
    """The median over `steps` steps of each timed part of both steps (max over ranks), and their `extras`."""
    rows = []
    for _ in range(steps):
        rows.append({**_trainer_phases(tr, cursor["trainer"]), **_bare_phases(bare, cursor["bare"])})
        cursor["trainer"] += 1
        cursor["bare"] += 1
    keys = list(rows[0])
    mx = _slowest([row[k] for row in rows for k in keys])  # max over ranks, per (step, phase)
    phases = {k: statistics.median(mx[i :: len(keys)]) for i, k in enumerate(keys)}
    # What the trainer adds to the bare step (the bare loop has data, forward_backward and AdamW).
    phases["extras"] = sum(phases.get(k, 0.0) for k in ("replicate_partial_grads", "grad_norm_loss_all_reduce", "clip"))
    return phases


def _telemetry_fields(
    rot: _Rotation, *, med_t: float, off_t: list[float], tel_ratios: list[float], log_every: int
) -> dict:
    """The JSON line's fields for trainer (phase timing on) against trainer_off."""
    return {
        "telemetry_ratio": med_t / statistics.median(off_t),
        "median_trainer_off_s": statistics.median(off_t),
        "telemetry_cpu_ratio": sum(rot.cpu_times["trainer"]) / sum(rot.cpu_times["trainer_off"]),
        "telemetry_round_ratios": [round(x, 4) for x in tel_ratios],
        "log_every": log_every,
    }


def bench_rank(cfg: JobConfig, derived: Derived, env: DistEnv, args: argparse.Namespace) -> dict | None:
    events = EventLog(Path(cfg.run.dir) / "events.jsonl", rank=env.rank)
    tr = trainer_mod.Trainer(cfg, derived, env, events=events)
    bare = BareLoop(cfg, derived)
    runners = {"bare": bare.step, "trainer": tr.train_step}
    off = None
    if args.telemetry:
        cfg_off = copy.deepcopy(cfg)
        cfg_off.metrics.phase_timing = False
        off = trainer_mod.Trainer(cfg_off, derived, env, events=events)
        runners = {"bare": bare.step, "trainer": _as_in_fit(tr), "trainer_off": _as_in_fit(off)}
    rot = _Rotation(runners)
    round_ratios, tel_ratios = _alternate(rot, warmup=args.warmup, rounds=args.rounds, block=args.block)
    bare_t, tr_t = _slowest(rot.times["bare"]), _slowest(rot.times["trainer"])
    off_t = _slowest(rot.times["trainer_off"]) if off is not None else None
    phases = _phase_medians(tr, bare, rot.cursor, steps=max(4, args.block * 2)) if args.phases else None
    tr.close()
    bare.close()
    if off is not None:
        off.close()
    if env.rank != 0:
        return None
    med_b, med_t = statistics.median(bare_t), statistics.median(tr_t)
    tel = (
        _telemetry_fields(rot, med_t=med_t, off_t=off_t, tel_ratios=tel_ratios, log_every=cfg.train.log_every)
        if off_t
        else {}
    )
    return {
        **tel,
        "bench": "step_overhead",
        "ratio": med_t / med_b,
        "median_bare_s": med_b,
        "median_trainer_s": med_t,
        "goal": 1.03,
        "mesh": derived.dims.describe(),
        "world_size": env.world_size,
        "model": cfg.model.name,
        "microbatches": derived.microbatches,
        "steps_each": len(tr_t),
        "rounds": args.rounds,
        "block": args.block,
        "warmup": args.warmup,
        "round_ratios": [round(x, 4) for x in round_ratios],
        "min_bare_s": min(bare_t),
        "min_trainer_s": min(tr_t),
        "trainer_phases_s": phases,
        "extras_over_bare": phases["extras"] / med_b if phases else None,
    }


def _rank_main(cfg: JobConfig, derived: Derived, rank: int, port, parent: int, args) -> int:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        return 1
    world = cfg.world_size
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # as jobs.launch.rank does
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(args.threads)
    join_group(rank, world, port, timeout_s=300)  # rank 0 binds the store's port and publishes it
    env = DistEnv(
        rank=rank,
        local_rank=rank,
        world_size=world,
        local_world_size=world,
        node_rank=0,
        nodes=1,
        master_addr="127.0.0.1",
        master_port=port.value,
    )
    os.environ.update(env.torch_environ())
    try:
        result = bench_rank(cfg, derived, env, args)
        if result is not None:
            b, t = result["median_bare_s"], result["median_trainer_s"]
            print(
                f"step_overhead: trainer/bare = {result['ratio']:.3f} (goal <= 1.03) | bare {b * 1e3:.1f} ms, "
                f"trainer {t * 1e3:.1f} ms median over {result['steps_each']} steps each | "
                f"{result['mesh']} on {world} ranks, model {result['model']}",
                flush=True,
            )
            if "telemetry_ratio" in result:
                print(
                    f"step_overhead: telemetry on/off = {result['telemetry_ratio']:.3f} (goal <= 1.03), "
                    f"CPU time on/off = {result['telemetry_cpu_ratio']:.3f} (rank 0) | "
                    f"off {result['median_trainer_off_s'] * 1e3:.1f} ms, train.log_every={result['log_every']}",
                    flush=True,
                )
            print(json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8, help="alternating rounds of (bare block, trainer block)")
    p.add_argument("--block", type=int, default=2, help="steps per block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each runner first")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--phases", action="store_true", help="also time the parts of the trainer's step")
    p.add_argument(
        "--telemetry",
        action="store_true",
        help="also run a Trainer with metrics.phase_timing=false: telemetry on/off ratio",
    )
    args, overrides = p.parse_known_args(argv)
    tmp = tempfile.mkdtemp(prefix="step_overhead-")
    cfg = compose([f"run.dir={tmp}", *overrides])
    cfg.train.steps = max(cfg.train.steps, args.warmup + args.rounds * args.block + max(4, 2 * args.block) + 1)
    cfg.cluster.run_root = tmp  # no straggler baseline of a benchmark in the real baseline root
    cfg.failure.straggler_baseline_root = f"{tmp}/baselines"
    derived = validate(cfg)  # ValueError names the override
    ensure_dataset(cfg.data, vocab_size=cfg.model.vocab_size, sample_len=cfg.model.max_seq_len + 1)
    port, parent = published_port(), os.getpid()
    failed = run_forked_ranks(cfg.world_size, lambda rank: _rank_main(cfg, derived, rank, port, parent, args))
    if failed:
        print(f"step_overhead: ranks failed, exit codes {sorted(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
