"""The published MoE presets and MLA: the model the trainer builds has the planner's parameter count (mixtral_8x22b,
deepseek_v3, tiny_mla_moe), Mixtral's count is the published 141B / 39B, MLA is causal and trains on CPU, and
MLA's tp/cp are refused for training but still planned."""

from __future__ import annotations

import pytest
import torch

from jobs.config import compose
from jobs.models.model import Transformer, init_weights
from jobs.planner.gate import build_plan
from jobs.planner.params import count_params
from jobs.trainer import cross_entropy
from jobs.validate import validate


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", ["tiny_mla_moe", "deepseek_v3", "mixtral_8x22b"])
def test_the_trained_model_has_the_planners_parameter_count(name: str) -> None:
    m = compose([f"model={name}"]).model
    with torch.device("meta"):
        model = Transformer(m)
    assert _numel(model) == count_params(m).total
    attn = sum(p.numel() for p in model.layers["0"].attention.parameters())
    b = count_params(m).blocks[0]
    assert attn == b.attention + b.norms - 2 * m.dim  # the block's two RMSNorms sit outside attention


def test_mla_without_query_compression_has_the_planners_parameter_count() -> None:
    m = compose(["model=tiny_mla_moe", "model.q_lora_rank=0"]).model
    model = Transformer(m)
    assert hasattr(model.layers["0"].attention, "wq") and _numel(model) == count_params(m).total


def test_mixtral_8x22b_has_the_published_141b_total_and_39b_active_parameters() -> None:
    # mistral.ai/news/mixtral-8x22b: "39B active parameters out of 141B"; config.json shapes in the preset.
    pc = count_params(compose(["model=mixtral_8x22b"]).model)
    assert pc.total == pytest.approx(141e9, rel=0.01)
    assert pc.active == pytest.approx(39e9, rel=0.01)


def test_mixtral_8x22b_plans_on_an_ep8_pipeline_mesh() -> None:
    cfg = compose(
        [
            "model=mixtral_8x22b",
            "cluster=h100_ib",
            "launcher.nodes=16",
            "launcher.tasks_per_node=8",
            "mesh.pp=8",
            "mesh.tp=1",
            "mesh.ep=8",
            "mesh.dp_shard=-1",
            "train.seq_len=4096",
            "train.micro_batch=1",
            "train.global_batch=256",
            "train.activation_checkpointing=full",
        ]
    )
    plan = build_plan(cfg, measure=False)
    assert plan.mesh == "pp8 * dp_shard16 * ep8" and plan.params_total == count_params(cfg.model).total
    assert any(c["collective"] == "all_to_all" and c["axis"] == "ep" for c in plan.comm)
    assert next(c for c in plan.checks if c.name == "memory").ok


def test_mla_is_causal_and_its_rope_sees_relative_positions() -> None:
    m = compose(["model=tiny_mla_moe"]).model
    model = Transformer(m)
    init_weights(model, seed=0)
    attn, rope = model.layers["0"].attention, model.rope
    x = torch.randn(1, 12, m.dim, generator=torch.Generator().manual_seed(1))
    y = attn(x, rope)
    x2 = x.clone()
    x2[:, 8:] += 1.0
    torch.testing.assert_close(attn(x2, rope)[:, :8], y[:, :8])  # the first 8 positions never see later ones
    assert not torch.allclose(attn(x2, rope)[:, 8:], y[:, 8:])
    # RoPE on queries and the shared key part: scores depend on relative positions only (a shift changes
    # nothing), and on those (no rotation at all changes the output).
    torch.testing.assert_close(attn(x, rope[3:]), y, rtol=1e-4, atol=1e-6)
    half = rope.shape[1] // 2
    identity = torch.cat([torch.ones_like(rope[:, :half]), torch.zeros_like(rope[:, half:])], dim=1)
    assert not torch.allclose(attn(x, identity), y, rtol=1e-3, atol=1e-5)


def test_tiny_mla_moe_trains_on_cpu() -> None:
    m = compose(["model=tiny_mla_moe"]).model
    model = Transformer(m)
    init_weights(model, seed=0)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, m.vocab_size, (4, 33), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        opt.zero_grad()
        loss = cross_entropy(model(toks[:, :-1]), toks[:, 1:])
        loss.backward()
        if not losses:
            assert all(
                p.grad is not None and p.grad.abs().sum() > 0
                for n, p in model.named_parameters()
                if "experts" not in n or "shared" in n
            )
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("axis", ["tp", "cp"])
def test_mla_with_tp_or_cp_is_refused_for_training_and_still_planned(axis: str) -> None:
    cfg = compose(["model=tiny_mla_moe", "mesh=single", f"mesh.{axis}=2", "launcher.tasks_per_node=2"])
    with pytest.raises(ValueError, match=rf"mesh\.{axis}\(2\) > 1 with model\.attention=mla"):
        validate(cfg)
    assert build_plan(cfg, measure=False).mesh == f"{axis}2"


def test_mla_without_its_head_dims_is_refused_naming_them() -> None:
    cfg = compose(["model=tiny", "model.attention=mla", "mesh=single", "launcher.tasks_per_node=1"])
    with pytest.raises(ValueError, match=r"model\.attention=mla needs model\.qk_nope_head_dim\(0\)"):
        validate(cfg)
