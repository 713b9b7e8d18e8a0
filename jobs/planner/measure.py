"""The readiness gate's measurement: which pipeline role each rank plays, and the per-rank parameter memory of
the real `parallelize()` over a fake process group for a sample of ranks covering every role (jobs.planner.gate
calls it; no rank is started and nothing is written)."""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, replace

from jobs.config import JobConfig
from jobs.planner import arith as P

__all__ = ["Measured", "measure", "roles", "stage_shapes"]


# --------------------------------------------------------------------------------------------- roles


def stage_shapes(cfg: JobConfig, d) -> dict[int, list[P.StageShape]]:
    """The stages every pp rank holds, from the real split (parallel.pipeline)."""
    from parallel.pipeline import layer_ranges, stage_ids

    dims = d.dims
    if dims.pp <= 1:
        return {0: [P.StageShape(tuple(range(cfg.model.n_layers)), True, True)]}
    ranges = layer_ranges(cfg.model.n_layers, d.num_stages, layers_per_stage=d.pp_layers_per_stage)
    out = {}
    for r in range(dims.pp):
        out[r] = [
            P.StageShape(tuple(ranges[s]), s == 0, s == d.num_stages - 1)
            for s in stage_ids(r, dims.pp, d.stages_per_rank, cfg.mesh.pp_schedule)
        ]
    return out


def roles(shapes: dict[int, list[P.StageShape]]) -> dict[int, str]:
    """One pp rank per distinct role (what its stages hold), with a name for it."""
    seen: dict[tuple, int] = {}
    for r, stages in shapes.items():
        key = tuple((len(s.layers), s.first, s.last) for s in stages)
        seen.setdefault(key, r)
    names = {}
    for key, r in seen.items():
        stages = shapes[r]
        extra = "".join(
            [", embedding" if any(x.first for x in stages) else "", ", head" if any(x.last for x in stages) else ""]
        )
        names[r] = f"pp{r} [{sum(len(x.layers) for x in stages)} layers{extra}]"
    return names


# -------------------------------------------------------------------------------------- measurement


def _measurement_mesh(dims):
    """The world mesh with its size-1 axes left out: the same row-major rank layout and the same
    groups on every axis parallelize() uses (an axis of size 1 is never sharded over), but without
    the world_size one-rank groups per size-1 axis that the fake backend would otherwise create one
    by one (about 2 x 16,384 `new_group` calls at 16K ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.dims import MESH_AXES

    axes = [(a, n) for a, n in zip(MESH_AXES, dims.shape) if n > 1] or [("dp_shard", 1)]
    return init_device_mesh("cpu", tuple(n for _, n in axes), mesh_dim_names=tuple(a for a, _ in axes))


def _dim0_sizes(m, stages: list[P.StageShape], *, tp: int) -> list[int]:
    """Dim-0 sizes of a stage's parameters after tensor parallelism: FSDP2 shards dim 0, so these
    decide whether the last dp_shard ranks get smaller (uneven) shards."""
    hd = m.dim // m.n_heads
    out = []
    if any(s.layers for s in stages):
        out += [m.n_heads * hd // tp, m.n_kv_heads * hd // tp, m.dim, m.ffn_dim // tp]
    if any(s.first or s.last for s in stages):
        out.append(m.vocab_size // tp)
    return out


@dataclass
class Measured:
    rank: int
    role: str
    coords: dict[str, int]
    params_elems: int
    params_bytes: int
    analytic_elems: int
    seconds: float


def measure(cfg: JobConfig, d, roles: dict[int, str], shapes) -> tuple[list[Measured], list[str], float]:
    """Real `parallelize()` on a meta-device model over the fake backend, one rank at a time.

    Samples, for each pipeline role, the first and the last dp_shard coordinate (FSDP's uneven
    shards fall on the last ones). With cp > 1 the mesh folds cp into dp_shard (FSDP over
    dp_shard*cp, which is how context parallel shards parameters); cp does not change shard sizes
    otherwise. Returns (measurements, notes, seconds).
    """
    import torch

    from jobs.models.model import Transformer

    t0 = time.perf_counter()
    dims = d.dims
    mdims = replace(dims, dp_shard=dims.dp_shard * dims.cp, cp=1, ep=1)
    fsdp = mdims.dp_shard
    samples = _samples(cfg, mdims, roles, shapes)
    base = None
    if dims.pp > 1:
        with torch.device("meta"):
            base = Transformer(cfg.model)
    out = []
    for rank, role, coords in samples:
        t1 = time.perf_counter()
        elems, nbytes = _measure_rank(cfg, d, mdims, rank, base)
        analytic = P.shard_elems(cfg.model, shapes[coords["pp"]], tp=dims.tp, fsdp=fsdp)
        out.append(Measured(rank, role, coords, elems, nbytes, analytic, time.perf_counter() - t1))
    notes = []
    if dims.cp > 1:
        notes.append(f"fake backend: cp folded into dp_shard ({dims.dp_shard}*{dims.cp} = {fsdp}) for the measurement")
    return out, notes, time.perf_counter() - t0


def _samples(cfg: JobConfig, mdims, roles: dict[int, str], shapes) -> list[tuple[int, str, dict[str, int]]]:
    """(rank, role, coords) to measure: dp_shard 0 of each pipeline role, and the last dp_shard too
    when a dim-0 size does not divide by the FSDP degree (only there do shards come out smaller)."""
    fsdp = mdims.dp_shard
    shape = mdims.shape  # (pp, dp_replicate, dp_shard, cp, tp)
    samples = []
    for pp_rank, role in roles.items():
        uneven = any(n % fsdp for n in _dim0_sizes(cfg.model, shapes[pp_rank], tp=mdims.tp))
        for s in sorted({0, fsdp - 1}) if uneven else [0]:
            rank = ((pp_rank * shape[1] + 0) * shape[2] + s) * shape[3] * shape[4]
            samples.append((rank, role, {"pp": pp_rank, "dp_replicate": 0, "dp_shard": s, "tp": 0}))
    return samples


def _measure_rank(cfg: JobConfig, d, mdims, rank: int, base) -> tuple[int, int]:
    """(elements, bytes) of the parameters `rank` holds after the real `parallelize()`, in its own
    fake process group (torn down afterwards). Parallelizes `base` when given (pp > 1), else a fresh
    meta-device model."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from jobs.models.model import Transformer
    from parallel.recipe import parallelize

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=mdims.world_size, store=FakeStore())
    try:
        mesh = _measurement_mesh(mdims)
        if base is None:
            with torch.device("meta"):
                model = Transformer(cfg.model)
        else:
            model = base
        parts, _ = parallelize(
            model,
            dims=mdims,
            mesh=mesh,
            stages_per_rank=d.stages_per_rank,
            pp_schedule=cfg.mesh.pp_schedule,
            sequence_parallel=cfg.mesh.sequence_parallel,
            loss_parallel=cfg.mesh.loss_parallel,
            pp_layers_per_stage=d.pp_layers_per_stage,
        )
        elems = nbytes = 0
        for part in parts:
            for p in part.parameters():
                local = p.to_local() if isinstance(p, DTensor) else p
                elems += local.numel()
                nbytes += local.numel() * local.element_size()
    finally:
        dist.destroy_process_group()
        gc.collect()
    return elems, nbytes
