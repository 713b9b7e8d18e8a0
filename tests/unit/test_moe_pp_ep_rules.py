"""Expert parallelism beside pipeline parallelism, in one process: the trainer's validation accepts pp * ep (and
dp_replicate * ep; MLA with tp stays refused), the planner's ep note is that same validation's verdict, and an ep rank
whose experts get no rows keeps the dispatched rows in its autograd graph (so it runs the dispatch all-to-all's
backward like its peers)."""

from __future__ import annotations

import pytest
import torch

from jobs.config import compose
from jobs.models.moe import grouped_mm_available, grouped_swiglu
from jobs.planner.gate import validate_for_planning
from jobs.validate import validate

PP_EP = ["model=tiny_mla_moe", "mesh=single", "mesh.pp=2", "mesh.dp_shard=2", "mesh.ep=2", "launcher.tasks_per_node=4"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["padded", "grouped_mm"])
def test_experts_that_get_no_rows_still_pass_a_gradient_to_the_dispatched_rows(dtype: torch.dtype) -> None:
    x = torch.zeros(0, 8, dtype=dtype, requires_grad=True)  # what the dispatch all-to-all brought this rank: nothing
    w1, w3 = (torch.randn(2, 8, 8).to(dtype).requires_grad_() for _ in range(2))
    w2 = torch.randn(2, 8, 8).to(dtype).requires_grad_()
    assert grouped_mm_available(x, w1, w2, w3) is (dtype == torch.bfloat16)
    out = grouped_swiglu(x, torch.zeros(2, dtype=torch.int64), w1, w2, w3)
    assert out.shape == (0, 8)
    out.sum().backward()
    assert x.grad is not None and x.grad.shape == (0, 8)  # the autograd path to the dispatch's backward exists
    assert all(w.grad is not None and not w.grad.any() for w in (w1, w2, w3))


def test_the_deepseek_v3_shaped_model_validates_with_pp_and_ep() -> None:
    d = validate(compose(PP_EP))
    assert (d.dims.pp, d.dims.dp_shard, d.dims.ep, d.num_stages) == (2, 2, 2, 2)
    assert d.dims.describe_meshes() == "attention pp2 * dp_shard2 | MoE pp2 * edp1 * ep2 (folded over the same 4 ranks)"


def test_the_planners_ep_note_is_the_trainers_validation() -> None:
    _, notes = validate_for_planning(compose(PP_EP))
    assert any(n.startswith("ep2: planned analytically, training built (parallel/ep.py)") for n in notes), notes
    cfg = compose(
        ["model=tiny_mla_moe", "mesh=single", "mesh.tp=2", "mesh.dp_shard=2", "mesh.ep=2", "launcher.tasks_per_node=4"]
    )  # planned (MLA with tp: jobs.plan), not trained
    _, notes = validate_for_planning(cfg)
    assert any(
        "training refused: mesh.tp(2) > 1 with model.attention=mla: tp of latent attention is not built yet" in n
        for n in notes
    ), notes


def test_ep_validates_beside_dp_replicate() -> None:
    d = validate(
        compose(
            [
                "model=tiny_moe",
                "mesh=single",
                "mesh.dp_replicate=2",
                "mesh.dp_shard=2",
                "mesh.ep=2",
                "launcher.tasks_per_node=4",
            ]
        )
    )
    assert (d.dims.dp_replicate, d.dims.dp_shard, d.dims.ep) == (2, 2, 2)
    assert d.dims.describe_meshes() == (
        "attention dp_replicate2 * dp_shard2 | MoE dp_replicate2 * edp1 * ep2 (folded over the same 4 ranks)"
    )
