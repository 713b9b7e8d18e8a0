"""Held-out evaluation on the training mesh: the same eval loss on every mesh, logged as its own record."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import run_train

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]  # three runs: 100 s on 2 busy cores (35 s CPU)

_ref: dict[str, torch.Tensor] = {}
COMMON = ["train.steps=2", "train.eval_every=1", "train.eval_batches=2", "checkpoint.enabled=false"]


def _evals(run) -> torch.Tensor:
    assert run.returncode == 0, run.stderr[-3000:]
    assert [m["step"] for m in run.metrics()] == [1, 2]  # the step lines, without the eval lines
    evals = run.evals()
    assert [e["step"] for e in evals] == [1, 2] and all(e["record"] == "eval" for e in evals)
    assert all(math.isclose(e["eval_ppl"], math.exp(e["eval_loss"])) for e in evals)
    assert "eval_loss" in run.stdout  # and on the progress line
    return torch.tensor([e["eval_loss"] for e in evals], dtype=torch.float64)


@pytest.mark.parametrize("ranks, mesh", [
    (4, ["mesh.pp=2", "mesh.dp_shard=2", "mesh.tp=1"]),  # through the pipeline's forward-only schedule, two dp slices
    (2, ["mesh.pp=1", "mesh.dp_shard=1", "mesh.tp=2"]),  # loss_parallel over a tp-sharded vocabulary
], ids=["pp2_dp_shard2", "tp2"])
def test_the_eval_loss_is_the_same_on_every_mesh(ranks: int, mesh: list[str], data_path: str, tmp_path,
                                                 tmp_path_factory) -> None:
    if "single" not in _ref:  # one single-process reference for both meshes
        _ref["single"] = _evals(run_train([*COMMON, f"data.path={data_path}", "mesh=single", "launcher.tasks_per_node=1"],
                                          tmp_path_factory.mktemp("single")))
    ref = _ref["single"]
    got = _evals(run_train([*COMMON, f"data.path={data_path}", "mesh=single", *mesh,
                            f"launcher.tasks_per_node={ranks}"], tmp_path / "mesh"))
    # fp32 on CPU: the meshes differ only in reduction order (training parity holds to ~1e-6 relative)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert got[0] != got[1]  # each evaluation sees the model as trained so far
