"""The matmuls of one microbatch's forward + backward as GEMM shapes, and a per-call rate model fitted to timed
GEMMs: what `scripts/bench/calibration_held_out.py` fits on one model's shapes and checks on another's.

A single achieved rate (`cluster.matmul_tflops`, what `jobs.calibrate` measures on the model's own shapes) says a
GEMM takes flops / rate whatever its size. A GEMM call also has a fixed cost (the framework's dispatch, the
kernel's set-up, a small problem's poor blocking), so the same rate cannot hold for a model of another width or
micro-batch. The model here is the one the planner already uses for collectives, Hockney's
t = alpha + work / rate (R. Hockney, "The communication challenge for MPP", Parallel Computing 20, 1994; the
alpha-beta model of `jobs.planner.hardware.Link`), with work = FLOPs: two figures per dtype, fitted by least
squares on relative error, so that a GEMM of 0.1 ms counts as much as one of 10 ms.

Pure functions of plain numbers and `ModelConfig`; no torch, no Hydra, no I/O (the rules of `jobs.planner.arith`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from jobs.config import ModelConfig

__all__ = [
    "Gemm",
    "linear_counts",
    "model_gemms",
    "RateFit",
    "fit_rate",
    "fit_gemm_rate",
    "single_rate",
    "predict_seconds",
    "WAVE_TILE",
    "wave_efficiency",
    "rank_gemms",
    "gemms_wave_efficiency",
]

# NVIDIA, "Matrix Multiplication Background User's Guide" (docs.nvidia.com/deeplearning/performance/
# dl-performance-matrix-multiplication), "Dimension Quantization Effects": a GEMM computes its output in thread-block
# tiles; an A100 "has 108 SMs; in the particular case of 256x128 thread block tiles, it can execute one thread block
# per SM, leading to a wave size of 108 tiles". A dimension that is not a multiple of the tile pads its last tile (tile
# quantization), and tiles that do not fill the last wave leave SMs idle for it (wave quantization). The achieved
# rate of the best shape (the profile's matmul efficiency) fills every wave; another shape runs at its share of it.
WAVE_TILE = (256, 128)


@dataclass(frozen=True, slots=True)
class Gemm:
    """(m x k) @ (k x n), `count` times per microbatch."""

    m: int
    n: int
    k: int
    count: int = 1

    @property
    def flops(self) -> float:
        """FLOPs of one call: a multiply and an add per term."""
        return 2.0 * self.m * self.n * self.k

    def label(self) -> str:
        return f"{self.m}x{self.k}@{self.k}x{self.n}"


def _linears(m: ModelConfig, tp: int = 1) -> list[tuple[int, int]]:
    """(in, out) features of every nn.Linear of the dense GQA model (jobs/models/model.py), the head included, as one
    tensor-parallel rank of `tp` holds them (parallel/tp.py): wq, wk, wv, w1, w3 and the head column-wise (out / tp),
    wo and w2 row-wise (in / tp). The embedding is a lookup, not a GEMM."""
    if m.attention == "mla" or m.n_routed_experts > 0:
        raise ValueError(
            f"model={m.name}: GEMM shapes are listed for the dense GQA model only (model.attention=gqa, "
            "model.n_routed_experts=0)"
        )
    hd = m.dim // m.n_heads
    q, kv = m.n_heads * hd, m.n_kv_heads * hd
    if any(x % tp for x in (q, kv, m.ffn_dim, m.vocab_size)):
        raise ValueError(
            f"model={m.name}: tp={tp} does not divide the heads ({m.n_heads}, {m.n_kv_heads} kv), "
            f"model.ffn_dim ({m.ffn_dim}) and model.vocab_size ({m.vocab_size})"
        )
    block = [
        (m.dim, q // tp),
        (m.dim, kv // tp),
        (m.dim, kv // tp),
        (q // tp, m.dim),
        (m.dim, m.ffn_dim // tp),
        (m.ffn_dim // tp, m.dim),
        (m.dim, m.ffn_dim // tp),
    ]
    return block * m.n_layers + [(m.dim, m.vocab_size // tp)]


def linear_counts(m: ModelConfig, *, tp: int = 1) -> list[tuple[int, int, int]]:
    """(in, out, count) of the model's distinct nn.Linear shapes on one tp rank, `count` of each in the model."""
    return [(i, o, n) for (i, o), n in sorted(Counter(_linears(m, tp)).items())]


def model_gemms(m: ModelConfig, *, tokens: int, tp: int = 1) -> list[Gemm]:
    """The GEMMs of one microbatch of `tokens` tokens (micro_batch x seq_len) through the model on one tp rank
    (tp=1: unsharded), forward and backward: per linear (in -> out) the forward (tokens x in) @ (in x out), the
    input gradient (tokens x out) @ (out x in) and the weight gradient (out x tokens) @ (tokens x in). Equal shapes
    are merged (`count`). Their FLOPs are 3 x 2 x tokens x the rank's matmul parameters (`steptime.stage_flops`
    without attention)."""
    return _gemms(_linears(m, tp), tokens)


def _gemms(linears: list[tuple[int, int]], tokens: int) -> list[Gemm]:
    shapes: Counter[tuple[int, int, int]] = Counter()
    for i, o in linears:
        shapes[(tokens, o, i)] += 1  # forward: m=tokens, n=out, k=in
        shapes[(tokens, i, o)] += 1  # input gradient
        shapes[(o, i, tokens)] += 1  # weight gradient
    return [Gemm(a, b, c, n) for (a, b, c), n in sorted(shapes.items())]


@dataclass(frozen=True, slots=True)
class RateFit:
    """t = calls * alpha_s + flops / (tflops * 1e12)."""

    alpha_s: float
    tflops: float

    def seconds(self, flops: float, *, calls: int = 1) -> float:
        return calls * self.alpha_s + flops / (self.tflops * 1e12)


def fit_rate(points: list[tuple[float, float]]) -> RateFit:
    """Least squares on relative error of t = alpha + flops / rate over (flops, seconds) points of one call each:
    each equation divided by its t, so every point weighs the same. alpha is kept >= 0 (a negative fixed cost
    would mean a small call takes no time): when the free fit gives one below 0, the rate alone is fitted."""
    if len({f for f, _ in points}) < 2:
        raise ValueError(f"fit_rate needs timings at 2 or more sizes, got {len(points)} point(s)")
    # minimise sum ((alpha + f * b) / t - 1)^2 over alpha, b = 1 / rate: the 2x2 normal equations
    a11 = sum(1 / t**2 for _, t in points)
    a12 = sum(f / t**2 for f, t in points)
    a22 = sum(f**2 / t**2 for f, t in points)
    r1 = sum(1 / t for _, t in points)
    r2 = sum(f / t for f, t in points)
    det = a11 * a22 - a12 * a12
    alpha, b = (a22 * r1 - a12 * r2) / det, (a11 * r2 - a12 * r1) / det
    if alpha < 0 or b <= 0:
        alpha, b = 0.0, r2 / a22  # through the origin: the single rate that fits relative error best
    return RateFit(alpha_s=alpha, tflops=1.0 / b / 1e12)


def fit_gemm_rate(points: list[tuple[Gemm, float]]) -> RateFit:
    """`fit_rate` over timed GEMMs: (GEMM, seconds of one call)."""
    return fit_rate([(g.flops, t) for g, t in points])


def single_rate(points: list[tuple[Gemm, float]]) -> RateFit:
    """What one achieved rate says: total FLOPs over total seconds of the calibration's GEMMs (counted as the
    microbatch runs them), no fixed cost."""
    flops = sum(g.count * g.flops for g, _ in points)
    secs = sum(g.count * t for g, t in points)
    return RateFit(alpha_s=0.0, tflops=flops / secs / 1e12)


def wave_efficiency(g: Gemm, sms: int, tile: tuple[int, int] = WAVE_TILE) -> float:
    """The share of `sms` SMs' tile slots that hold useful output elements over the waves `g` needs: m x n over
    waves x sms x the tile's area, for the tile's better orientation (256x128 or 128x256). 1.0 when `sms` is 0."""
    if sms <= 0:
        return 1.0
    best = 0.0
    for a, b in (tile, tile[::-1]):
        tiles = -(-g.m // a) * -(-g.n // b)
        waves = -(-tiles // sms)
        best = max(best, g.m * g.n / (waves * sms * a * b))
    return best


def rank_gemms(m: ModelConfig, *, tokens: int, tp: int, blocks: int, head: bool) -> list[Gemm]:
    """The GEMMs of one microbatch on a rank holding `blocks` of the model's blocks (and the output head when
    `head`), forward and backward, as `model_gemms` lists them: every dense block has the same shapes."""
    linears = _linears(m, tp)
    per_block = len(linears[:-1]) // max(m.n_layers, 1)
    return _gemms(linears[:per_block] * blocks + (linears[-1:] if head else []), tokens)


def gemms_wave_efficiency(gemms: list[Gemm], sms: int) -> float:
    """The FLOP-weighted efficiency of `gemms` (each at `wave_efficiency`): total FLOPs over the FLOPs their waves
    could have done, so that the GEMMs' time at the best shape's rate is divided by it."""
    flops = sum(g.count * g.flops for g in gemms)
    padded = sum(g.count * g.flops / wave_efficiency(g, sms) for g in gemms)
    return flops / padded if padded else 1.0


def predict_seconds(fit: RateFit, gemms: list[Gemm]) -> float:
    """Seconds of all of `gemms` (each `count` calls) under `fit`."""
    return sum(fit.seconds(g.count * g.flops, calls=g.count) for g in gemms)
