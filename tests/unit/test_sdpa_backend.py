"""`model.sdpa_backend`: math runs torch's math backend (the scores materialised, in the compute dtype) with the
same numbers as auto, leaves torch's global reduction flag as it found it, and is refused where it cannot run."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from jobs.config import compose
from jobs.models.model import Transformer, init_weights
from jobs.models.sdpa import causal_sdpa
from jobs.validate import validate
from parallel.ac import apply_ac
from parallel.precision import apply_autocast

SEQ, BATCH = 24, 2  # a length no other dim of the tiny models has, so (SEQ, SEQ) can only be attention scores
FLASH = "aten._scaled_dot_product_flash_attention_for_cpu.default"
MODELS = [["model=tiny"], ["model=tiny_mla_moe"]]  # grouped-query and latent attention


class _OpLog(TorchDispatchMode):
    """Every aten op that runs, with the shape and dtype of each tensor it returns."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple[int, ...], torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.ops.append((str(func), tuple(t.shape), t.dtype))
        return out

    def scores(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """The ops that returned a floating (.., SEQ, SEQ) tensor (the causal mask is bool)."""
        return [o for o in self.ops if o[1][-2:] == (SEQ, SEQ) and o[2].is_floating_point]


def _model(overrides: list[str], backend: str) -> Transformer:
    model = Transformer(compose([*overrides, f"model.sdpa_backend={backend}"]).model)
    init_weights(model, seed=0)
    return model


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens = _tokens(model.cfg.vocab_size)
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_math_gives_the_loss_and_every_gradient_of_auto_in_fp32() -> None:
    loss_auto, grads_auto = _loss_and_grads(_model(["model=tiny"], "auto"))
    loss_math, grads_math = _loss_and_grads(_model(["model=tiny"], "math"))
    assert loss_math.item() == pytest.approx(loss_auto.item(), rel=1e-6, abs=0)
    assert grads_math.keys() == grads_auto.keys() and len(grads_auto) > 10
    for name, g in grads_auto.items():
        torch.testing.assert_close(grads_math[name], g, rtol=1e-4, atol=1e-6, msg=name)


def _attention_ops(overrides: list[str], backend: str, *, bf16: bool = False) -> _OpLog:
    """The ops of one attention block's forward and backward (block 0), fp32 or under bf16 autocast."""
    model = _model(overrides, backend)
    attention = model.layers["0"].attention
    if bf16:
        apply_autocast(attention, device_type="cpu")
    x = torch.randn(BATCH, SEQ, model.cfg.dim, generator=torch.Generator().manual_seed(2), requires_grad=True)
    with _OpLog() as log:
        attention(x, model.rope).float().square().sum().backward()
    return log


def test_math_materialises_the_scores_and_runs_no_fused_kernel() -> None:
    heads = compose(["model=tiny"]).model.n_heads
    log = _attention_ops(["model=tiny"], "math")
    names = {op for op, _, _ in log.ops}
    assert "aten._safe_softmax.default" in names and "aten._softmax_backward_data.default" in names
    assert ("aten.bmm.default", (BATCH * heads, SEQ, SEQ), torch.float32) in log.ops  # QK^T
    assert not any("scaled_dot_product" in op for op in names)


def test_auto_runs_the_flash_kernel_without_materialising_the_scores() -> None:
    log = _attention_ops(["model=tiny"], "auto")
    assert FLASH in {op for op, _, _ in log.ops}
    assert log.scores() == []


def test_mla_under_auto_on_cpu_falls_back_to_the_math_kernel() -> None:
    """torch's CPU flash kernel needs one head dim for q, k and v; MLA's values have v_head_dim(16), its queries and
    keys qk_nope_head_dim + qk_rope_head_dim (24), so auto already materialises MLA's scores on CPU (in fp32 under
    bf16: only the bf16 test below tells MLA's math from its auto)."""
    log = _attention_ops(["model=tiny_mla_moe"], "auto")
    assert FLASH not in {op for op, _, _ in log.ops}
    assert "aten._safe_softmax.default" in {op for op, _, _ in log.scores()}


@pytest.mark.parametrize("prior", [False, True])
@pytest.mark.parametrize("overrides", MODELS, ids=lambda o: o[0])
def test_math_in_bf16_keeps_every_score_in_bf16_and_restores_the_global_flag(overrides: list[str], prior: bool) -> None:
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(prior)
    try:
        scores = _attention_ops(overrides, "math", bf16=True).scores()
        assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed() is prior
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)
    kinds = {op for op, _, _ in scores}
    assert {"aten.bmm.default", "aten._safe_softmax.default", "aten._softmax_backward_data.default"} <= kinds
    assert {dtype for _, _, dtype in scores} == {torch.bfloat16}, [s for s in scores if s[2] != torch.bfloat16]


def test_the_math_backend_alone_upcasts_bf16_scores_to_fp32() -> None:
    """Why the flag is set: torch's math backend without it computes bf16 inputs' scores in fp32."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(BATCH, 4, SEQ, 8, dtype=torch.bfloat16)
    with _OpLog() as log, sdpa_kernel(SDPBackend.MATH):
        torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.float32 in {dtype for _, _, dtype in log.scores()}


def test_the_global_flag_is_restored_when_the_attention_raises() -> None:
    q, k = torch.randn(1, 2, SEQ, 8), torch.randn(1, 2, SEQ, 4)  # head dims that do not match
    with pytest.raises(RuntimeError):
        causal_sdpa(q, k, k, backend="math")
    assert torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed() is False


def test_math_under_bf16_activation_checkpointing_recomputes_the_same_gradients() -> None:
    """The flag is set inside the block, so the recomputation in backward also runs in bf16."""
    grads = []
    for mode in ("none", "full"):
        model = _model(["model=tiny"], "math")
        apply_ac(model, mode=mode, every=1)
        apply_autocast(model, device_type="cpu")
        grads.append(_loss_and_grads(model)[1])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=0, atol=0, msg=name)


def test_an_unknown_sdpa_backend_is_refused_naming_the_key_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"model\.sdpa_backend='flash' is not one of auto, math: set model\.sdpa"):
        validate(compose(["model.sdpa_backend=flash"]))
    with pytest.raises(ValueError, match=r"model\.sdpa_backend='flash' is not one of auto, math"):
        causal_sdpa(*torch.randn(3, 1, 2, SEQ, 8), backend="flash")


def test_math_with_context_parallel_is_refused_and_auto_is_not() -> None:
    cp2 = ["mesh.cp=2", "mesh.tp=1", "mesh.dp_shard=2"]  # pp2 * dp_shard2 * cp2 = the 8 local ranks
    with pytest.raises(ValueError, match=r"model\.sdpa_backend=math with mesh\.cp\(2\) > 1: .* set model\.sdpa"):
        validate(compose([*cp2, "model.sdpa_backend=math"]))
    assert validate(compose([*cp2, "model.sdpa_backend=auto"])).dims.cp == 2
    assert validate(compose(["model.sdpa_backend=math"])).dims.cp == 1
