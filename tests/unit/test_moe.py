"""The MoE model (jobs/models/moe.py): one definition with the planner, grouped experts, node limit, bias balancing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jobs.config import compose
from jobs.models.model import Transformer, init_weights
from jobs.models.moe import (
    BALANCE_FIELDS,
    MoE,
    Router,
    grouped_mm_available,
    grouped_swiglu,
    padded_swiglu,
    update_expert_bias,
)
from jobs.planner.params import count_params
from jobs.validate import validate


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["model.n_shared_experts=2", "model.n_dense_layers=2"],
        ["model.n_shared_experts=0", "model.n_routed_experts=16", "model.moe_groups=8"],
    ],
)
def test_trainer_parameter_count_equals_the_planners_for_tiny_moe(overrides: list[str]) -> None:
    m = compose(["model=tiny_moe", *overrides]).model
    with torch.device("meta"):
        model = Transformer(m)
    assert sum(p.numel() for p in model.parameters()) == count_params(m).total
    assert sum(isinstance(mod, MoE) for mod in model.modules()) == m.n_layers - m.n_dense_layers


def _loop(x: torch.Tensor, counts: list[int], w1, w2, w3) -> torch.Tensor:
    """One SwiGLU per expert over its rows, in a Python loop."""
    starts = [sum(counts[:e]) for e in range(len(counts))]
    return torch.cat(
        [
            (F.silu(x[s : s + c] @ w1[e]) * (x[s : s + c] @ w3[e])) @ w2[e]
            for e, (s, c) in enumerate(zip(starts, counts))
        ]
    )


@pytest.mark.parametrize("path", ["grouped_mm", "padded"])
def test_grouped_experts_equal_one_swiglu_per_expert(path: str) -> None:
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1]
    dtype = torch.bfloat16 if path == "grouped_mm" else torch.float32  # the grouped GEMM's one dtype
    x = torch.randn(sum(counts), 8, generator=g).to(dtype)
    w1, w3 = torch.randn(4, 8, 8, generator=g).to(dtype), torch.randn(4, 8, 8, generator=g).to(dtype)
    w2 = torch.randn(4, 8, 8, generator=g).to(dtype)
    loop = _loop(x, counts, w1, w2, w3)
    assert grouped_mm_available(x, w1, w2, w3) is (path == "grouped_mm")  # torch 2.13's CPU kernel: bf16 rows of 16 B
    c = torch.tensor(counts)
    out = grouped_swiglu(x, c, w1, w2, w3) if path == "grouped_mm" else padded_swiglu(x, c, counts, w1, w2, w3)
    torch.testing.assert_close(
        out, loop, rtol=2e-2 if dtype == torch.bfloat16 else 1.3e-6, atol=2e-2 if dtype == torch.bfloat16 else 1e-5
    )
    x.requires_grad_()
    out = grouped_swiglu(x, c, w1, w2, w3) if path == "grouped_mm" else padded_swiglu(x, c, counts, w1, w2, w3)
    out.sum().backward()  # an expanded (stride-0) gradient, which the grouped GEMM's backward refuses as it comes
    ref = torch.func.grad(lambda t: _loop(t, counts, *(w.float() for w in (w1, w2, w3))).sum())(x.detach().float())
    bf16 = dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), ref, rtol=5e-2 if bf16 else 1e-5, atol=1e-1 if bf16 else 1e-5)


def _skewed_router(overrides: list[str]) -> tuple[Router, torch.Tensor]:
    """A router whose gate prefers experts 0 and 1 for every token (they point along a direction all tokens share)."""
    m = compose(["model=tiny_moe", *overrides]).model
    router = Router(m)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        router.gate.weight.copy_(0.02 * torch.randn(router.gate.weight.shape, generator=g))
        router.gate.weight[:2] += 0.5
    router.reset_buffers()
    x = torch.randn(512, m.dim, generator=g) * 0.5 + 1.0
    return router, x


def _imbalance(router: Router, x: torch.Tensor) -> float:
    """max load / mean load of one routing of x (1.0 = perfectly even)."""
    router.tokens_per_expert.zero_()
    router(x)
    load = router.tokens_per_expert.clone()
    router.tokens_per_expert.zero_()
    return float(load.max() / load.mean())


def test_bias_balancing_evens_a_skewed_router_below_1_25() -> None:
    router, x = _skewed_router(["model.moe_max_nodes=0"])
    before = _imbalance(router, x)
    layer = MoE.__new__(MoE)  # update_expert_bias only reads .router and the balance loss's sum
    torch.nn.Module.__init__(layer)
    layer.router = router
    layer.register_buffer("aux_loss_sum", torch.zeros(()))
    for _ in range(300):
        router(x)
        update_expert_bias([layer], rate=1e-3)
    after = _imbalance(router, x)
    assert before >= 3.0, before  # experts 0 and 1 take (nearly) every token: 4x the mean
    assert after < 1.25, (before, after)
    assert router.expert_bias[:2].max() < router.expert_bias[2:].min()  # the favoured experts were pushed down


def test_node_limited_routing_never_uses_more_groups_than_moe_max_nodes() -> None:
    # 16 experts in 8 groups ("nodes"), top-6: unlimited routing spreads a token over up to 6 groups.
    over = ["model.n_routed_experts=16", "model.moe_groups=8", "model.experts_per_token=6"]
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2048, 64, generator=g)
    for limit, most in ((0, 6), (4, 4), (3, 3)):  # 3 groups of 2 = exactly the 6 experts
        router = Router(compose(["model=tiny_moe", *over, f"model.moe_max_nodes={limit}"]).model)
        with torch.no_grad():
            router.gate.weight.normal_(0, 1, generator=g)
        router.reset_buffers()
        _, ids, _ = router(x)
        nodes = torch.stack([torch.unique(row // 2).numel() * torch.ones(()) for row in ids]).long()
        assert int(nodes.max()) == most, (limit, nodes.bincount())
        assert ids.unique(dim=1).shape == ids.shape  # k distinct experts per token


def test_router_weights_are_normalised_for_sigmoid_and_plain_softmax_for_softmax() -> None:
    x = torch.randn(32, 64)
    sig = Router(compose(["model=tiny_moe", "model.moe_route_scale=2.5"]).model)
    soft = Router(compose(["model=tiny_moe", "model.moe_score_func=softmax", "model.moe_route_norm=false"]).model)
    for r in (sig, soft):
        torch.nn.init.normal_(r.gate.weight, 0, 0.5)
        r.reset_buffers()
    w, _, _ = sig(x)
    torch.testing.assert_close(w.sum(-1), torch.full((32,), 2.5))
    w, ids, scores = soft(x)
    torch.testing.assert_close(w, scores.gather(-1, ids))
    assert float(w.sum(-1).max()) < 1.0


def test_aux_loss_trains_the_router_without_changing_the_loss() -> None:
    torch.manual_seed(0)
    x = torch.randint(0, 256, (2, 16))
    out = {}
    for coef in (0.0, 0.1):
        model = Transformer(compose(["model=tiny_moe", f"model.moe_aux_loss_coef={coef}"]).model)
        init_weights(model, seed=0)
        loss = model(x).float().logsumexp(-1).mean()
        loss.backward()
        out[coef] = (float(loss), model.layers["1"].feed_forward.router.gate.weight.grad.clone())
    assert out[0.0][0] == out[0.1][0]
    assert not torch.allclose(out[0.0][1], out[0.1][1])


def test_router_counts_training_forwards_only() -> None:
    router = Router(compose(["model=tiny_moe"]).model)
    torch.nn.init.normal_(router.gate.weight, 0, 0.02)
    router.reset_buffers()
    x = torch.randn(32, 64)
    with torch.no_grad():  # held-out evaluation (jobs/evaluate.py)
        router(x)
    assert float(router.tokens_per_expert.sum()) == 0
    router(x)
    assert float(router.tokens_per_expert.sum()) == 32 * 2


def test_expert_bias_is_checkpointed_model_state() -> None:
    model = Transformer(compose(["model=tiny_moe"]).model)
    keys = model.state_dict().keys()
    assert "layers.1.feed_forward.router.expert_bias" in keys
    assert not any("tokens_per_expert" in k for k in keys)


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (
            ["mesh=single", "mesh.dp_shard=-1", "launcher.tasks_per_node=2", "mesh.ep=2"],
            "mesh.ep(2) > 1 but model.n_routed_experts(0)",
        ),
        (["model=tiny_moe", "mesh=single", "mesh.dp_shard=-1", "launcher.tasks_per_node=3", "mesh.ep=3"], "mesh.ep(3)"),
        (
            ["model=tiny_moe", "mesh=single", "mesh.tp=2", "model.moe_ffn_dim=33", "launcher.tasks_per_node=2"],
            "model.moe_ffn_dim(33) % mesh.tp(2) != 0: the experts' hidden dim is split over the tp ranks (etp = tp)",
        ),
        (
            [
                "model=tiny_moe",
                "mesh=single",
                "mesh.tp=2",
                "mesh.sequence_parallel=false",
                "train.seq_len=15",
                "launcher.tasks_per_node=2",
            ],
            "train.seq_len(15) / mesh.cp(1) = 15 is not divisible by mesh.tp(2): each tp rank routes and dispatches",
        ),
        (
            [
                "model=tiny_mla_moe",
                "mesh=single",
                "mesh.dp_shard=2",
                "mesh.tp=2",
                "mesh.ep=2",
                "launcher.tasks_per_node=4",
            ],
            "mesh.tp(2) > 1 with model.attention=mla: tp of latent attention is not built yet",
        ),
        (["model=tiny_moe", "model.moe_score_func=relu"], "model.moe_score_func='relu'"),
        (["model=tiny_moe", "model.moe_groups=3"], "model.moe_groups(3)"),
        (["model=tiny_moe", "model.moe_max_nodes=1", "model.experts_per_token=3"], "model.experts_per_token(3)"),
    ],
)
def test_moe_config_errors_name_the_override(overrides: list[str], needle: str) -> None:
    with pytest.raises(ValueError) as e:
        validate(compose(overrides))
    assert needle in str(e.value)


def test_tiny_moe_with_ep2_validates() -> None:
    d = validate(
        compose(["model=tiny_moe", "mesh=single", "mesh.dp_shard=-1", "launcher.tasks_per_node=4", "mesh.ep=2"])
    )
    assert (d.dims.dp_shard, d.dims.ep) == (4, 2)
    assert d.dims.describe() == "dp_shard4 (ep2 within dp_shard)"


def test_balance_loss_counts_the_plain_top_k_of_the_affinities_not_the_biased_choices() -> None:
    """DeepSeek-V3 eq. 17-20: f_i = N / (K T) * #tokens whose top-K affinities hold i, P_i = mean normalised affinity;
    the biases (which steer the routing to experts 0 and 1 here) and the node limit do not enter it."""
    cfg = compose(["model=tiny_moe", "model.moe_aux_loss_coef=0.5"]).model
    model = Transformer(cfg)
    init_weights(model, seed=0)
    layer = model.layers["1"].feed_forward
    with torch.no_grad():
        layer.router.expert_bias[:2] = 1.0  # every token routed to experts 0 and 1
    x = torch.randn(2, 16, cfg.dim, generator=torch.Generator().manual_seed(3))
    layer(x)
    scores = layer.router.gate(x).float().sigmoid()  # (batch, seq, experts)
    n, k = cfg.n_routed_experts, cfg.experts_per_token
    f = torch.zeros_like(scores).scatter_(-1, scores.topk(k, dim=-1).indices, 1.0).mean(1) * n / k
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    expected = 0.5 * float((f * p).sum(-1).mean())
    assert float(layer.aux_loss_sum) == pytest.approx(expected, rel=1e-6)
    biased = torch.zeros(n).scatter_(0, torch.tensor([0, 1]), 1.0).expand(2, n) * n / k  # the biased choices' f
    assert abs(0.5 * float((biased * p).sum(-1).mean()) - expected) > 1e-3  # which the old definition counted


def test_bias_update_returns_each_layers_load_imbalance_bias_spread_and_balance_loss() -> None:
    model = Transformer(compose(["model=tiny_moe", "model.moe_aux_loss_coef=0.1", "model.moe_max_nodes=0"]).model)
    init_weights(model, seed=0)
    layers = [model.layers[str(i)].feed_forward for i in (1, 2, 3)]
    with torch.no_grad():
        layers[0].router.expert_bias[:2] = 1.0  # block 1: every token to experts 0 and 1 (4x the mean load)
    model(torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0)))
    aux = [float(m.aux_loss_sum) for m in layers]
    table = update_expert_bias(layers, rate=0.01)
    assert table.shape == (3, len(BALANCE_FIELDS))
    assert float(table[0, 0]) == 4.0  # 64 choices on 2 of 8 experts: max 32 / mean 8
    assert all(1.0 <= float(v) < 4.0 for v in table[1:, 0])
    assert float(table[0, 1]) == pytest.approx(1.0 - 0.02)  # (1 - rate) - (0 + rate): the favoured were pushed down
    assert table[:, 2].tolist() == pytest.approx(aux) and min(aux) > 0
    assert all(float(m.aux_loss_sum) == 0 and float(m.router.tokens_per_expert.sum()) == 0 for m in layers)
