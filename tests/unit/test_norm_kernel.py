"""`model.norm_kernel`: fused runs F.rms_norm in every RMSNorm the model builds (MLA's latent norms included) with
eager's numbers, eager stays the elementwise computation it was, a checkpoint loads under either, a typo is refused."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from jobs.config import compose
from jobs.models.model import RMSNorm, Transformer, init_weights
from jobs.validate import validate
from parallel.precision import apply_autocast

SEQ, BATCH = 24, 2
# RMSNorms per model: two a block and the final one; MLA adds q_norm and kv_norm to each of its 4 blocks
MODELS = {"tiny": 2 * 4 + 1, "tiny_mla_moe": 2 * 4 + 1 + 2 * 4}
FALLBACK = "Cannot dispatch to fused implementation"  # torch's warning when input and weight dtypes differ


def _model(name: str, kernel: str, *, bf16: bool = False) -> Transformer:
    model = Transformer(compose([f"model={name}", f"model.norm_kernel={kernel}"]).model)
    init_weights(model, seed=0)
    if bf16:
        apply_autocast(model, device_type="cpu")
    return model


def _tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _loss_and_grads(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    tokens = _tokens(model.cfg.vocab_size)
    loss = F.cross_entropy(model(tokens[:, :-1]).float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MODELS)
def test_fused_gives_the_loss_and_every_gradient_of_eager_in_fp32(name: str) -> None:
    """Bitwise on CPU (measured: F.rms_norm decomposes into eager's ops there); on CUDA the fused kernel's
    reduction order differs, which these CPU tests do not see (scripts/gpu_preflight.py `norm_kernel` does)."""
    loss_e, grads_e = _loss_and_grads(_model(name, "eager"))
    loss_f, grads_f = _loss_and_grads(_model(name, "fused"))
    assert loss_f.item() == loss_e.item()
    assert grads_f.keys() == grads_e.keys() and len(grads_e) > 10
    for n, g in grads_e.items():
        torch.testing.assert_close(grads_f[n], g, rtol=0, atol=0, msg=n)


@pytest.mark.parametrize("name", MODELS)
def test_fused_under_bf16_autocast_is_within_bf16_tolerance_of_eager(name: str) -> None:
    """Block norms see the fp32 residual stream (bitwise as in fp32); MLA's latent norms see bf16 linear outputs
    and fused takes their weight in bf16 (measured: largest gradient difference 8.7e-7, 0.27% of that tensor's
    largest entry; loss equal)."""
    loss_e, grads_e = _loss_and_grads(_model(name, "eager", bf16=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_f, grads_f = _loss_and_grads(_model(name, "fused", bf16=True))
    assert not [w for w in caught if FALLBACK in str(w.message)]
    assert loss_f.item() == pytest.approx(loss_e.item(), rel=1e-3, abs=0)
    for n, g in grads_e.items():
        torch.testing.assert_close(grads_f[n], g, rtol=1.6e-2, atol=1e-5, msg=n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_default_is_eager_and_bitwise_the_elementwise_computation(dtype: torch.dtype) -> None:
    model = _model("tiny", compose([]).model.norm_kernel)
    norm = model.layers["0"].attention_norm
    assert norm.kernel == "eager"
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, norm.weight.numel()))
    x = torch.randn(BATCH, SEQ, model.cfg.dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    xf = x.float()
    expected = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)).type_as(x) * norm.weight
    got = norm(x)
    assert got.dtype == expected.dtype == torch.float32  # type_as(x) * the fp32 weight promotes
    assert torch.equal(got, expected)


def _norm_ops(name: str, kernel: str, *, bf16: bool) -> list[str]:
    """The profiler's event names of one forward."""
    model = _model(name, kernel, bf16=bf16)
    with torch.autograd.profiler.profile() as prof:
        model(_tokens(model.cfg.vocab_size))
    return [e.name for e in prof.function_events]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", MODELS)
def test_every_norm_calls_the_fused_op_under_fused_and_none_does_under_eager(name: str, bf16: bool) -> None:
    """Under bf16 autocast MLA's latent norms get bf16 inputs and fp32 weights; given as they are, torch skips
    `_fused_rms_norm` for those (CUDA's kernel too), so fused hands over the weight in the input's dtype."""
    assert sum(isinstance(m, RMSNorm) for m in _model(name, "eager").modules()) == MODELS[name]
    fused = _norm_ops(name, "fused", bf16=bf16)
    assert fused.count("aten::rms_norm") == fused.count("aten::_fused_rms_norm") == MODELS[name]
    eager = _norm_ops(name, "eager", bf16=bf16)
    assert "aten::rms_norm" not in eager and "aten::_fused_rms_norm" not in eager


@pytest.mark.parametrize("saved, loaded", [("eager", "fused"), ("fused", "eager")])
def test_a_state_dict_saved_under_one_kernel_loads_strictly_under_the_other(saved: str, loaded: str) -> None:
    source = _model("tiny_mla_moe", saved)
    with torch.no_grad():
        for n, p in source.named_parameters():
            if n.endswith("norm.weight"):
                p.mul_(1.25)  # norm weights other than the init's ones
    target = Transformer(compose(["model=tiny_mla_moe", f"model.norm_kernel={loaded}"]).model)
    target.load_state_dict(source.state_dict(), strict=True)
    tokens = _tokens(source.cfg.vocab_size)
    with torch.no_grad():
        assert torch.equal(target(tokens), source(tokens))


def test_an_unknown_norm_kernel_is_refused_naming_the_key_the_choices_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"model\.norm_kernel='apex' is not one of eager, fused: set model\.norm_k"):
        validate(compose(["model.norm_kernel=apex"]))
    with pytest.raises(ValueError, match=r"model\.norm_kernel='apex' is not one of eager, fused"):
        RMSNorm(8, 1e-5, kernel="apex")
    assert validate(compose(["model.norm_kernel=fused"])).dims.tp == compose([]).mesh.tp
