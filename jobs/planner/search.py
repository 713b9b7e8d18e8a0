"""`python -m jobs.plan plan.search=true`: every feasible mesh for the model, world size and cluster, predicted and ranked.

The search enumerates shapes (tp within the NVLink domain, cp, pp, schedule and virtual stages,
dp_replicate x dp_shard, micro batch), rejects the ones that cannot work before planning them when a
cheap rule says so (divisibility, batch arithmetic, a lower bound on memory), and plans the rest with
`gate.build_plan(measure=False)`: analytic, because the fake-backend measurement takes seconds per shape.
Activation checkpointing is not a free axis: a shape takes the cheapest mode that fits (none, then
selective, then full), since the others only add recomputation. Every number the ranking uses is read
from a `Plan` by `predicted()`, so the step-time model behind it can change without touching the rest.
A shape is trainable when the trainer's own validation accepts it; `plan.search_trainable_only` (default true:
the ranking is advice to submit) ranks only those and lists the others as one rejection, `false` ranks them after.
"""

from __future__ import annotations

import re
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from jobs.config import JobConfig
from jobs.planner import arith as P
from jobs.planner.gate import Plan, build_plan
from jobs.planner.render import GiB
from jobs.validate import validate

__all__ = [
    "Shape",
    "Candidate",
    "SearchResult",
    "PLANNED_ONLY",
    "predicted",
    "shapes",
    "search",
    "render_search",
    "write_top_k",
    "visit_shape",
    "own_candidate",
]

AC_ORDER = ("none", "selective", "full")  # cheapest first: the first that fits wins
MICRO_BATCHES = (1, 2, 4, 8)
VIRTUAL_STAGES = (2, 4, 8)


@dataclass(frozen=True, slots=True)
class Shape:
    """One point of the search: the mesh and the knobs that go with it."""

    tp: int
    cp: int
    pp: int
    dp_replicate: int
    dp_shard: int
    micro_batch: int
    schedule: str = "1f1b"
    v: int = 1  # virtual stages per pp rank
    split: tuple[int, ...] | None = None  # mesh.pp_layers_per_stage; None = balanced by cost
    ac: str = "none"

    def label(self) -> str:
        v = f" v{self.v}{'*' if self.split else ''}" if self.v > 1 else ""
        return (
            f"tp{self.tp} cp{self.cp} pp{self.pp}{v} dp{self.dp_replicate}x{self.dp_shard} "
            f"mb{self.micro_batch} ac={self.ac}"
        )

    def trainable(self, cfg: JobConfig) -> bool:
        """Whether `python -m jobs.train` builds this shape: the trainer's own validation accepts it (one rule
        for both: ep only folded over dp_shard * cp, MLA without tp or cp, ...)."""
        return self.refusal(cfg) is None

    def refusal(self, cfg: JobConfig) -> str | None:
        """Why `python -m jobs.train` refuses this shape (its validation's message); None when it builds it."""
        try:
            validate(self.apply(cfg), training=True)
        except ValueError as e:
            return str(e)
        return None

    def overrides(self) -> list[str]:
        """Hydra overrides that set this shape on any config of the same model and world size."""
        split = "[" + ",".join(map(str, self.split)) + "]" if self.split else "null"
        return [
            f"mesh.tp={self.tp}",
            f"mesh.cp={self.cp}",
            f"mesh.pp={self.pp}",
            f"mesh.dp_replicate={self.dp_replicate}",
            f"mesh.dp_shard={self.dp_shard}",
            f"mesh.pp_schedule={self.schedule}",
            f"mesh.pp_stages_per_rank={self.v if self.pp > 1 else -1}",
            f"mesh.pp_layers_per_stage={split}",
            "mesh.pp_microbatches=-1",
            f"train.micro_batch={self.micro_batch}",
            f"train.activation_checkpointing={self.ac}",
        ]

    def apply(self, cfg: JobConfig) -> JobConfig:
        mesh = replace(
            cfg.mesh,
            tp=self.tp,
            cp=self.cp,
            pp=self.pp,
            dp_replicate=self.dp_replicate,
            dp_shard=self.dp_shard,
            pp_schedule=self.schedule,
            pp_microbatches=-1,
            pp_stages_per_rank=self.v if self.pp > 1 else -1,
            pp_layers_per_stage=list(self.split) if self.split else None,
        )
        return replace(
            cfg, mesh=mesh, train=replace(cfg.train, micro_batch=self.micro_batch, activation_checkpointing=self.ac)
        )


@dataclass
class Candidate:
    shape: Shape
    numbers: dict[str, float]  # predicted(): step_s, tokens_per_s, mfu, peak_bytes, bubble, goodput, in_flight
    own: bool = False  # the composed config's own shape
    trainable: bool = False  # Shape.trainable, asked once per search


@dataclass
class SearchResult:
    ranked: list[Candidate]
    rejected: dict[str, list[tuple[str, str]]]  # reason -> [(shape label, full message)]
    enumerated: int
    planned: int  # build_plan calls
    seconds: float
    world_size: int
    own_why: str = ""  # why the composed config itself is not ranked, or with which AC it is when its own does not fit
    trainable_only: bool = False  # plan.search_trainable_only: the planned-only shapes are under `rejected`

    def own_rank(self) -> int | None:
        return next((i + 1 for i, c in enumerate(self.ranked) if c.own), None)


def _goodput_cell(goodput: float | None) -> str:
    return f"{goodput:7.3f}" if goodput is not None else "unknown"


def predicted(plan: Plan) -> dict[str, float]:
    """The figures the ranking reads from a plan, in one place: the predicted step of
    `jobs/planner/steptime.py` (compute at the achieved matmul rate, each collective's alpha-beta cost on
    its link, the recipe's overlap, the bubble) and its MFU, the peak memory, bubble and expected goodput."""
    s = plan.step
    step_s = s["step_s"]
    tokens = s["model_tflop_per_rank"] * 1e12 * plan.world_size / s["flops_per_token"]  # tokens per step
    return {
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "mfu": s["mfu"],
        "peak_bytes": plan.per_rank["peak_bytes"],
        "bubble": plan.bubble_fraction,
        "goodput": plan.goodput_expected,
        "in_flight": plan.activation["layers_in_flight"],
    }


# ------------------------------------------------------------------------------------------ enumeration


def _pow2_upto(n: int) -> list[int]:
    return [1 << i for i in range(max(n, 1).bit_length()) if (1 << i) <= n]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _pipelines(n_layers: int, pp: int) -> list[tuple[str, int, tuple[int, ...] | None]]:
    """(schedule, virtual stages, split) for a pp degree: 1F1B, and interleaved with v chunks per rank
    when the layers fill them, or 1-layer chunks with an embedding-only first and output-only last
    chunk (Llama 3 §3.3.2) when pp·v = n_layers + 2."""
    if pp == 1:
        return [("1f1b", 1, None)]
    out = [("1f1b", 1, None)]
    for v in VIRTUAL_STAGES:
        if pp * v <= n_layers:
            out.append(("interleaved_1f1b", v, None))
        elif pp * v == n_layers + 2:
            out.append(("interleaved_1f1b", v, (0,) + (1,) * n_layers + (0,)))
    return out


def shapes(cfg: JobConfig) -> list[Shape]:
    """Every shape of the search space for cfg's world size (activation checkpointing set later)."""
    world, m, cl = cfg.world_size, cfg.model, cfg.cluster
    out = []
    for tp in _pow2_upto(min(max(cl.nvlink_domain, 1), world)):
        for cp in _pow2_upto(world // tp):
            for pp in (d for d in _divisors(world // (tp * cp)) if d <= m.n_layers):
                dp = world // (tp * cp * pp)
                for rep in (r for r in _pow2_upto(dp) if dp % r == 0):
                    for mb in MICRO_BATCHES:
                        for sched, v, split in _pipelines(m.n_layers, pp):
                            out.append(Shape(tp, cp, pp, rep, dp // rep, mb, sched, v, split))
    return out


# -------------------------------------------------------------------------------------------- pruning


def _quick_reject(cfg: JobConfig, s: Shape, params_total: int) -> str | None:
    """Why `s` cannot work, from arithmetic alone (None: plan it)."""
    m, t = cfg.model, cfg.train
    for name, n in (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads), ("ffn_dim", m.ffn_dim)):
        if n % s.tp:
            return f"model.{name}({n}) % mesh.tp({s.tp}) != 0"
    if s.cp > 1 and t.seq_len % (2 * s.cp):
        return f"train.seq_len({t.seq_len}) % (2 * mesh.cp({s.cp})) != 0"
    dp = s.dp_replicate * s.dp_shard
    if t.global_batch % (dp * s.micro_batch):
        return f"train.global_batch({t.global_batch}) % (dp({dp}) * train.micro_batch({s.micro_batch})) != 0"
    mbs = t.global_batch // (dp * s.micro_batch)
    if s.pp > 1 and mbs < s.pp:
        return f"microbatches({mbs}) < mesh.pp({s.pp})"
    if s.v > 1 and mbs % s.pp:
        return f"microbatches({mbs}) % mesh.pp({s.pp}) != 0 (interleaved_1f1b)"
    if cfg.cluster.gpu_mem_gib > 0:
        floor = P.HEURISTIC_BYTES_PER_PARAM * params_total / (s.pp * s.tp * s.dp_shard * s.cp)
        usable = cfg.cluster.gpu_mem_gib * GiB * cfg.plan.usable_mem_fraction
        if floor > usable:
            return (
                f"memory floor: 16 B x params / (pp*tp*dp_shard*cp) = {floor / GiB:.0f} GiB > "
                f"{usable / GiB:.0f} GiB usable"
            )
    return None


def _reason_key(why: str) -> str:
    """A reject message with its numbers folded, so that the same rule groups together."""
    head = re.split(r";|: (?=[a-z])", why, maxsplit=1)[0]
    return re.sub(r"\d+(\.\d+)?", "N", head)[:100]


def _full_ac_peak(plan: Plan) -> int:
    """The plan's peak with full activation checkpointing, from its own per-role figures."""
    return max(r["peak_bytes"] - r["activation_bytes"] + r["activation_bytes_full_ac"] for r in plan.roles)


def _plan_shape(cfg: JobConfig, s: Shape) -> tuple[Candidate | None, str, int]:
    """(candidate, reject message, build_plan calls) for the cheapest activation checkpointing that passes.
    When only memory fails without checkpointing, the full-AC peak read off that plan decides whether
    selective and full are worth planning."""
    calls, why = 0, ""
    usable = cfg.cluster.gpu_mem_gib * GiB * cfg.plan.usable_mem_fraction
    for ac in AC_ORDER:
        calls += 1
        try:
            plan = build_plan(replace(s, ac=ac).apply(cfg), measure=False)
        except ValueError as e:
            return None, str(e), calls
        failed = [c for c in plan.checks if not c.ok]
        if not failed:
            return Candidate(replace(s, ac=ac), predicted(plan)), "", calls
        if any(c.name != "memory" for c in failed):
            return None, f"{failed[0].name}: {failed[0].why}", calls  # only memory improves with checkpointing
        if ac == "none" and _full_ac_peak(plan) > usable:
            return (
                None,
                (f"memory even with full AC: peak {_full_ac_peak(plan) / GiB:.1f} GiB > {usable / GiB:.1f} GiB usable"),
                calls,
            )
        why = f"memory even with full AC: {failed[0].why}"
    return None, why, calls


def _group(s: Shape) -> tuple:
    return (s.tp, s.cp, s.pp, s.schedule, s.v, s.split)


def _dominated(s: Shape, too_big: dict[tuple, list[tuple[int, int]]]) -> bool:
    """A shape needs at least the memory of a failing one of its group with no more dp_replicate (so
    no smaller dp_shard) and, with a pipeline, no larger micro batch (without one, fewer microbatches
    can drop the unsharded gradient buffer, so only dp_replicate orders memory there)."""
    for rep, mb in too_big.get(_group(s), ()):
        if s.dp_replicate >= rep and (s.micro_batch >= mb if s.pp > 1 else s.micro_batch == mb):
            return True
    return False


def visit_shape(
    cfg: JobConfig, s: Shape, params_total: int, too_big: dict, cp1: dict | None = None
) -> tuple[Candidate | None, str, int]:
    """(candidate, reject message, build_plan calls) for one shape, pruned as early as it can be; `cp1`: the verdicts
    on the shapes without CP so far (`_cp_not_needed`), None to rank every cp."""
    why = _quick_reject(cfg, s, params_total)
    if why is None and cp1 is not None:
        why = _cp_not_needed(s, cp1)
    if why is not None:
        return None, why, 0
    if _dominated(s, too_big):
        return (
            None,
            "memory even with full AC: needs more than a failing shape with a larger dp_shard / smaller micro batch",
            0,
        )
    cand, why, calls = _plan_shape(cfg, s)
    if cand is None and why.startswith("memory even with full AC"):
        too_big.setdefault(_group(s), []).append((s.dp_replicate, s.micro_batch))
    return cand, why, calls


def _without_cp(s: Shape) -> tuple:
    """The shape with its cp ranks moved into dp_shard: what runs the same batch without context parallelism."""
    return (s.tp, s.pp, s.dp_replicate, s.dp_shard * s.cp, s.micro_batch, s.schedule, s.v, s.split)


def _memory(why: str) -> bool:
    return why.startswith(("memory even with full AC", "memory floor"))


def _cp_not_needed(s: Shape, cp1: dict[tuple, tuple[str, bool]]) -> str | None:
    """Why a cp > 1 shape is not ranked (plan.search_cp_only_when_needed): the same mesh without CP (its cp ranks in
    dp_shard, enumerated first) did not fail for memory, so the sequence does not need CP. CP is for a sequence
    whose activations do not fit otherwise (Llama 3 §3.3.2 uses it for the long-context stage only); the step-time
    model prices a CP rank's shorter GEMMs at the full GEMM rate, so it would rank CP where nobody runs it (405B at
    8K on 16,384 GPUs: tp4 cp16 pp32 first, 512 tokens per rank)."""
    verdict, needed = cp1.get(_without_cp(s), ("", True))
    if s.cp == 1 or needed:
        return None
    return f"cp not needed for the sequence: without it {verdict} (plan.search_cp_only_when_needed=false ranks it)"


def search(cfg: JobConfig) -> SearchResult:
    """Enumerates, prunes, plans and ranks (by predicted tokens/s). Raises ValueError when the cluster
    profile has no compute peak (nothing to predict a step time from)."""
    if cfg.cluster.gpu_bf16_tflops <= 0:
        raise ValueError(
            f"plan.search=true needs a step-time prediction, but cluster.gpu_bf16_tflops=0 "
            f"({cfg.cluster.name}); use a GPU cluster profile, e.g. cluster=h100_ib"
        )
    t0 = time.perf_counter()
    params_total = P.count_params(cfg.model).total
    ranked, rejected, calls, too_big, cp1 = [], {}, 0, {}, {}
    space = shapes(cfg)
    for s in space:
        cand, why, n = visit_shape(cfg, s, params_total, too_big, cp1 if cfg.plan.search_cp_only_when_needed else None)
        calls += n
        if s.cp == 1:
            cp1[_without_cp(s)] = (
                (cand.shape.label() + " fits", False) if cand else (f"{s.label()}: {why}", _memory(why))
            )
        if cand:
            ranked.append(cand)
        else:
            rejected.setdefault(_reason_key(why), []).append((s.label(), why))
    own, own_why = own_candidate(cfg)
    calls += 1
    if own is not None:
        ranked = [c for c in ranked if c.shape != own.shape] + [own]
    ranked, own_why = _mark_trainable(cfg, ranked, rejected, own_why)
    ranked.sort(key=lambda c: (not c.trainable, -c.numbers["tokens_per_s"]))  # what jobs.train builds first
    return SearchResult(
        ranked,
        rejected,
        len(space),
        calls,
        time.perf_counter() - t0,
        cfg.world_size,
        own_why,
        trainable_only=cfg.plan.search_trainable_only,
    )


PLANNED_ONLY = "planned only: jobs.train refuses the shape"  # the rejection group of plan.search_trainable_only


def _mark_trainable(
    cfg: JobConfig, ranked: list[Candidate], rejected: dict, own_why: str
) -> tuple[list[Candidate], str]:
    """Marks each candidate with the trainer's own validation; with plan.search_trainable_only the refused ones
    move to the rejections (one group, each with the trainer's message), the composed config's too."""
    kept = []
    for c in ranked:
        why = c.shape.refusal(cfg)
        c.trainable = why is None
        if c.trainable or not cfg.plan.search_trainable_only:
            kept.append(c)
            continue
        rejected.setdefault(PLANNED_ONLY, []).append((c.shape.label(), f"{PLANNED_ONLY}: {why}"))
        if c.own:
            own_why = (
                f"{PLANNED_ONLY} (plan.search_trainable_only=true; =false ranks it among the planned-only "
                f"shapes): {why}"
            )
    return kept, own_why


def own_candidate(cfg: JobConfig) -> tuple[Candidate | None, str]:
    """The composed config as it stands, ranked among the others when it plans and passes; when only its memory
    fails, its mesh with the cheapest AC after its own that fits (AC_ORDER), which the second value says; else
    None and why not."""
    from jobs.planner.gate import validate_for_planning

    ac = cfg.train.activation_checkpointing
    tried = AC_ORDER[AC_ORDER.index(ac) :] if ac in AC_ORDER else (ac,)
    first = ""
    for mode in tried:
        run = replace(cfg, train=replace(cfg.train, activation_checkpointing=mode))
        try:
            d, _ = validate_for_planning(run)
            plan = build_plan(run, measure=False)
        except ValueError as e:
            return None, f"config: {e}"
        failed = [c for c in plan.checks if not c.ok]
        if not failed:
            break
        if failed[0].name != "memory" or mode == tried[-1]:
            return None, f"{failed[0].name}: {failed[0].why}"
        first = first or f"at train.activation_checkpointing={ac}, {failed[0].name}: {failed[0].why}"
    note = f"ranked with train.activation_checkpointing={mode}: {first}" if first else ""
    dims, mesh = d.dims, cfg.mesh
    split = tuple(mesh.pp_layers_per_stage) if mesh.pp_layers_per_stage else None
    shape = Shape(
        dims.tp,
        dims.cp,
        dims.pp,
        dims.dp_replicate,
        dims.dp_shard,
        cfg.train.micro_batch,
        mesh.pp_schedule if dims.pp > 1 else "1f1b",
        d.stages_per_rank,
        split,
        mode,
    )
    return Candidate(shape, predicted(plan), own=True), note


# --------------------------------------------------------------------------------------------- output


def render_search(r: SearchResult, cfg: JobConfig, *, rows: int) -> str:
    """The ranked table (first `rows`), the config's own rank, and the rejections grouped by reason."""
    which = (
        "only the shapes jobs.train builds (plan.search_trainable_only=true; =false adds the planned-only ones)"
        if r.trainable_only
        else "the shapes jobs.train builds first"
    )
    L = [
        f"search: {r.enumerated} shapes for {r.world_size} ranks, {r.planned} planned (analytic, no fake backend), "
        f"{len(r.ranked)} feasible{' and trainable' if r.trainable_only else ''}, in {r.seconds:.1f} s",
        "  ranked by predicted tokens/s (the predicted step of jobs/planner/steptime.py: compute, exposed comm, bubble, tails), "
        f"{which}; in flight: layer-microbatches of activations held at the peak (torch's "
        "schedule warm-up), which chose the AC",
        "   #  shape                                              tokens/s     MFU   peak GiB  bubble  goodput  in flight",
    ]
    shown = [(i, c) for i, c in enumerate(r.ranked) if i < rows or c.own]
    for i, c in shown:
        n = c.numbers
        label = c.shape.label() + ("" if c.trainable else " ~")
        L.append(
            f"{i + 1:4d}  {label:48s}{' <' if c.own else '  '} {n['tokens_per_s'] / 1e6:8.3f} M"
            f"  {n['mfu']:6.1%}  {n['peak_bytes'] / GiB:8.1f}  {n['bubble']:6.1%}  {_goodput_cell(n['goodput'])}"
            f"  {n['in_flight']:9.0f}"
        )
    own = r.own_rank()
    built = [c for c in r.ranked if c.trainable]
    among = next((f"; {i + 1} of the {len(built)} that jobs.train builds" for i, c in enumerate(built) if c.own), "")
    L.append(
        f"  < this config: rank {own} of {len(r.ranked)}{among}" if own else f"  this config is not ranked: {r.own_why}"
    )
    if own and r.own_why:  # ranked with the AC it needs
        L.append(f"    {r.own_why}")
    L.append(
        "  v<n>*: 1-layer chunks, the first holding only the embedding, the last only the output layer"
        + (
            f'; planned-only shapes (the trainer\'s validation refuses them) are rejected as "{PLANNED_ONLY}"'
            if r.trainable_only
            else "; ~: planned only (the trainer's validation refuses the shape: e.g. ep beside pp or tp, MLA with tp or cp)"
        )
    )
    L.append("")
    L.append(f"rejected: {sum(len(v) for v in r.rejected.values())} shapes")
    for key, items in sorted(r.rejected.items(), key=lambda kv: -len(kv[1])):
        L.append(f"  {len(items):6d}  {key}")
        L.append(f"          e.g. {items[0][0]}: {items[0][1][:160]}")
    return "\n".join(L)


def write_top_k(r: SearchResult, cfg: JobConfig, *, k: int, out: str) -> list[str]:
    """Writes the top `k` as complete `# @package _global_` configs out/search/top<i>.yaml (run and plan
    left out) and returns the lines to print: each point's overrides and the `-m` sweep over all k."""
    import yaml

    root = Path(out).resolve()
    (root / "search").mkdir(parents=True, exist_ok=True)
    lines, names = [], []
    runnable = [c for c in r.ranked if c.trainable]
    if len(runnable) < len(r.ranked[:k]) or runnable[:k] != r.ranked[:k]:
        lines.append(f"# the top {k} that jobs.train builds (planned-only shapes skipped)")
    if not runnable:
        return lines + ["# none: jobs.train builds none of the ranked shapes"]
    for i, c in enumerate(runnable[:k], start=1):
        body = {key: val for key, val in asdict(c.shape.apply(cfg)).items() if key not in ("run", "plan")}
        text = (
            f"# @package _global_\n# jobs.plan search rank {r.ranked.index(c) + 1} of {len(r.ranked)}: {c.shape.label()}, "
            f"{c.numbers['tokens_per_s'] / 1e6:.3f} M tokens/s predicted\n" + yaml.safe_dump(body, sort_keys=False)
        )
        (root / "search" / f"top{i}.yaml").write_text(text)
        names.append(f"top{i}")
        lines.append(f"# top{i} (rank {r.ranked.index(c) + 1}): " + " ".join(c.shape.overrides()))
    lines.append(
        f"python -m jobs.train -m launcher={cfg.launcher.name} 'hydra.searchpath=[file://{root}]' "
        f"+search={','.join(names)}"
    )
    return lines
