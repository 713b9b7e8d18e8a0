"""The planner prices the attention and norm kernels a run picks as torch runs them: `model.sdpa_backend=math` (torch's
math backend: the scores materialised) and `model.norm_kernel=fused` (torch's fused RMSNorm on CUDA)."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from jobs.config import compose
from jobs.models.sdpa import causal_sdpa
from jobs.planner import traffic as T
from jobs.planner.gate import build_plan
from jobs.planner.render import render

B, H, S, D = 2, 4, 64, 16
SCORES = B * H * S * S
VIEWS = {"view", "_unsafe_view", "expand", "transpose", "detach", "alias", "t"}


class _ScoreBytes(TorchDispatchMode):
    """Bytes of (B, H, S, S)-sized tensors each op reads and writes, views left out (they move nothing)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            read = sum(t.numel() * t.element_size() for t in ins if t.numel() == SCORES)
            written = sum(t.numel() * t.element_size() for t in outs if t.numel() == SCORES)
            if read or written:
                self.ops.append((name, read, written))
        return out


def test_the_score_bytes_are_what_torchs_math_backend_reads_and_writes():
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fwd, bwd = _ScoreBytes(), _ScoreBytes()
    with fwd:
        out = causal_sdpa(q, k, v, backend="math")  # the model's path: math, the scores kept in bf16
    with bwd:
        out.backward(torch.ones_like(out))
    assert [name for name, _, _ in fwd.ops] == ["bmm", "add", "_safe_softmax", "bmm"]
    assert [name for name, _, _ in bwd.ops] == ["bmm", "bmm", "_softmax_backward_data", "bmm", "bmm"]
    # _safe_softmax is one op at the dispatcher; inside it torch runs softmax, isneginf, all and where
    # (aten/src/ATen/native/transformers/attention.cpp), which the profiler sees
    with profile(record_shapes=True) as prof:
        causal_sdpa(q.detach(), k.detach(), v.detach(), backend="math")
    inner = next(e for e in prof.events() if e.name == "aten::_safe_softmax").cpu_children
    assert [e.name for e in inner] == [
        "aten::softmax",
        "aten::isneginf",
        "aten::all",
        "aten::scalar_tensor",
        "aten::where",
    ]
    # beyond the softmax the dispatcher saw (read 2, write 2): isneginf reads 2 and writes a bool, all reads it,
    # where reads 2 and writes 2 bytes a score
    inside = (2 + 1) + 1 + (2 + 2)
    seen_fwd = sum(r + w for _, r, w in fwd.ops) / SCORES
    seen_bwd = sum(r + w for _, r, w in bwd.ops) / SCORES
    m = compose(["model=tiny", "model.sdpa_backend=math", f"model.n_heads={H}"]).model
    planned = T.score_bytes_per_token(m, seq_len=S, tp=1, compute_bytes=2)
    assert (seen_fwd + inside, seen_bwd) == (20, 14)
    assert planned == (H * S * 20, H * S * 14)  # per token: its S scores in each of the H heads
    assert T.score_bytes_per_token(m, seq_len=S, tp=2) == (H * S * 10, H * S * 7)  # half the heads on a tp rank
    auto = compose(["model=tiny"]).model
    assert T.score_bytes_per_token(auto, seq_len=S, tp=1) == (0.0, 0.0)  # flash: no scores in HBM


def _korthikanti_22b(*overrides: str):
    """Korthikanti et al. 2022's 22B model (t8, one microbatch of 4 x 2048, no SP) on A100s."""
    from tests.unit.test_planner_held_out import GPT_22B, _megatron

    run = _megatron(**GPT_22B, pp=1, dp=1, batch=4, micro_batch=4, ac="none")
    rows = [o for o in run if not o.startswith(("model.sdpa_backend", "model.norm_kernel"))]
    return build_plan(compose([*rows, *overrides]), measure=False)


def test_math_attention_runs_every_score_at_the_gemm_rate_and_moves_them_through_hbm():
    flash, math = _korthikanti_22b(), _korthikanti_22b("model.sdpa_backend=math")
    f, m = flash.step, math.step
    # Causal attention FLOPs a rank and step, forward + backward: 3 x 48 blocks x 2 x 8192 tokens x 2048 x 2 x 6144 / 2
    # / 8. Flash runs them at FlashAttention-2's rate; math runs twice as many (the masked half too) as GEMMs.
    att = 3 * 48 * 2.0 * 8192 * 2048 * 2 * 6144 / 2 / 8
    gemm_rate = f["matmul_tflops"] * 1e12 * f["gemm_efficiency"]
    extra = 2 * att / gemm_rate - att / (f["attention_tflops"] * 1e12)
    assert m["compute_s"] - f["compute_s"] == pytest.approx(extra, rel=1e-6)
    # the scores: 8 heads x 2048 keys a token, 8192 tokens, 48 blocks, 20 + 14 bytes each at the HBM rate
    scores = 48 * 8192 * 8 * 2048 * (20 + 14) / (f["hbm_GBps"] * 1e9)
    assert m["memory_bound_s"] - f["memory_bound_s"] == pytest.approx(scores, rel=1e-6)
    assert 2.2 < scores / 48 * 1e3 < 2.3  # ms a layer (2,039 GB/s)
    # and its memory: every block keeps the probabilities of its 8 heads (2 bytes a score) and no logsumexp (fp32,
    # one a query and head)
    peak = math.roles[0]["peak_bytes"] - flash.roles[0]["peak_bytes"]
    assert peak == 48 * (4 * 8 * 2048 * 2048 * 2 - 4 * 4 * 2048 * 8)


def test_the_plan_says_which_attention_it_priced():
    flash, math = render(_korthikanti_22b()), render(_korthikanti_22b("model.sdpa_backend=math"))
    assert "FlashAttention-2" in flash and "math backend" not in flash
    assert "FlashAttention-2" not in math and "attention on torch's math backend (model.sdpa_backend=math)" in math


def test_fused_norms_move_2_plus_5_elements_and_keep_their_input_and_rstd():
    eager, fused = _korthikanti_22b(), _korthikanti_22b("model.norm_kernel=fused")
    e, f = eager.step, fused.step
    # two norms a block over the whole sequence (no SP): eager 36 bytes an element forward, 3x that a step; fused
    # 2 x 2 bytes forward and 5 x 2 backward (aten/src/ATen/native/cuda/layer_norm_kernel.cu)
    elements = 48 * 8192 * 2 * 6144
    assert e["memory_bound_s"] - f["memory_bound_s"] == pytest.approx(
        elements * (3 * 36 - (2 + 5) * 2) / (e["hbm_GBps"] * 1e9), rel=1e-6
    )
    # memory: eager keeps each norm's fp32 input and bf16 output (6 bytes an element), fused its bf16 input and one
    # fp32 rstd a row (torch's generated FusedRmsNormBackward0 saves input, weight and result1)
    rows = 48 * 8192 * 2
    assert eager.roles[0]["peak_bytes"] - fused.roles[0]["peak_bytes"] == elements * (6 - 2) - rows * 4
    assert "norms fused (model.norm_kernel=fused)" in render(fused) and "norms fused" not in render(eager)
