"""`python -m jobs.train model=tiny_moe mesh.ep=2` trains, and a run stopped at a checkpoint resumes bit for bit
(experts sharded over ep, the router biases in the checkpoint), and resharded onto ep4 within fp32 tolerance."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from checkpoint.convert import convert
from jobs.events import read_events
from tests.conftest import assert_states_bitwise, run_train

RUN_S = 240  # one 6-step run of 2 ranks: ~15 s on the loaded 2-core box (3 steps of 4 ranks: about the same)
pytestmark = [pytest.mark.multiproc, pytest.mark.slow, pytest.mark.timeout(3 * RUN_S + 60)]

# min_lr_ratio=1: a constant LR after warmup, so a 3-step run continued to 6 steps trains as one 6-step run.
EP2 = [
    "model=tiny_moe",
    "mesh=single",
    "mesh.dp_shard=2",
    "mesh.ep=2",
    "launcher.tasks_per_node=2",
    "optim.min_lr_ratio=1.0",
    "checkpoint.every_steps=3",
    "model.moe_bias_rate=0.01",
]


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _final(run_dir: Path, tmp: Path) -> dict:
    out = tmp / f"{run_dir.name}-final.pt"
    convert(run_dir / "checkpoints/step_6", out)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def ep2_reference(tmp_path_factory, data_path: str) -> Path:
    """The uninterrupted 6-step ep2 run (checkpoints at steps 3 and 6), shared by both tests."""
    ref_dir = tmp_path_factory.mktemp("moe") / "ref"
    ref = run_train([*EP2, "train.steps=6", f"data.path={data_path}"], ref_dir, timeout=RUN_S)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "(ep2 within dp_shard)" in ref.stdout + ref.stderr
    return ref_dir


def test_ep2_run_resumed_from_step_3_equals_the_uninterrupted_run_bitwise(
    ep2_reference: Path, tmp_path: Path, data_path: str
) -> None:
    ref_losses = _losses(ep2_reference)
    assert ref_losses[6] < ref_losses[1]

    run_dir = tmp_path / "run"
    first = run_train([*EP2, "train.steps=3", f"data.path={data_path}"], run_dir, timeout=RUN_S)
    assert first.returncode == 0, first.stderr[-3000:]
    again = run_train([*EP2, "train.steps=6", f"data.path={data_path}"], run_dir, timeout=RUN_S)
    assert again.returncode == 0, again.stderr[-3000:]
    loaded = read_events(run_dir / "events.jsonl", "checkpoint_loaded")
    assert [e["step"] for e in loaded] == [3] and loaded[0]["resharded"] is False
    losses = _losses(run_dir)
    assert [losses[s] for s in range(1, 7)] == [ref_losses[s] for s in range(1, 7)]

    final, ref_final = _final(run_dir, tmp_path), _final(ep2_reference, tmp_path)
    assert_states_bitwise(final, ref_final)
    bias = final["model"]["layers.1.feed_forward.router.expert_bias"]
    assert bias.abs().sum() > 0  # the balancing moved it, and the resumed run carried it on exactly
    assert final["model"]["layers.1.feed_forward.experts.w1"].shape == (8, 64, 32)  # every expert, from both ep ranks


def test_ep2_checkpoint_resumes_resharded_onto_ep4_within_fp32_tolerance(
    ep2_reference: Path, tmp_path: Path, data_path: str
) -> None:
    """Step 3 of the ep2 run (4 experts per rank) loaded on 4 ranks with 2 experts each: the experts, their
    AdamW moments and the router biases land on the new owners; steps 4-6 follow the ep2 run."""
    run_dir = tmp_path / "ep4"
    shutil.copytree(ep2_reference / "checkpoints/step_3", run_dir / "checkpoints/step_3")
    ep4 = [*EP2, "mesh.dp_shard=4", "mesh.ep=4", "launcher.tasks_per_node=4", "train.steps=6", f"data.path={data_path}"]
    r = run_train(ep4, run_dir, timeout=RUN_S)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "meshes: attention dp_shard4 | MoE edp1 * ep4 (folded over the same 4 ranks)" in r.stdout + r.stderr
    loaded = read_events(run_dir / "events.jsonl", "checkpoint_loaded")
    assert [e["step"] for e in loaded] == [3] and loaded[0]["resharded"] is True
    losses, ref_losses = _losses(run_dir), _losses(ep2_reference)
    assert sorted(losses) == [4, 5, 6]
    torch.testing.assert_close(
        torch.tensor([losses[s] for s in (4, 5, 6)]),
        torch.tensor([ref_losses[s] for s in (4, 5, 6)]),
        rtol=1e-5,
        atol=1e-5,
    )
    final, ref_final = _final(run_dir, tmp_path), _final(ep2_reference, tmp_path)
    assert final["model"].keys() == ref_final["model"].keys()
    for k, v in final["model"].items():
        torch.testing.assert_close(v, ref_final["model"][k], rtol=1e-4, atol=1e-5, msg=k)
    bias = "layers.1.feed_forward.router.expert_bias"
    assert final["model"][bias].abs().sum() > 0
