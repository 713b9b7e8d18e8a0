"""Every mesh trains exactly like one process: same model, data and seed give the same losses (fp32)."""

from __future__ import annotations

import pytest

from tests.conftest import run_train

pytestmark = pytest.mark.multiproc

STEPS = 8
COMMON = [f"train.steps={STEPS}", "checkpoint.enabled=false"]

MESHES = {
    "pp2_dp_shard2_tp2": (8, ["mesh.pp=2", "mesh.dp_shard=2", "mesh.tp=2"], []),
    "dp_replicate2_dp_shard2": (4, ["mesh.pp=1", "mesh.dp_replicate=2", "mesh.dp_shard=2", "mesh.tp=1"], []),
    "tp4": (4, ["mesh.pp=1", "mesh.dp_shard=1", "mesh.tp=4"], []),
    "pp4_interleaved_1f1b": (4, ["mesh.pp=4", "mesh.dp_shard=1", "mesh.tp=1", "mesh.pp_schedule=interleaved_1f1b"],
                             ["model.n_layers=8"]),
    "pp2_tp2": (4, ["mesh.pp=2", "mesh.dp_shard=1", "mesh.tp=2"], []),
}

_refs: dict[tuple[str, ...], list[float]] = {}


def _reference(model: list[str], data_path: str, tmp_path_factory) -> list[float]:
    key = tuple(model)
    if key not in _refs:
        run = run_train([*COMMON, *model, f"data.path={data_path}", "mesh=single", "launcher.tasks_per_node=1"],
                        tmp_path_factory.mktemp("ref"))
        assert run.returncode == 0, run.stderr[-3000:]
        _refs[key] = run.losses()
    return _refs[key]


@pytest.mark.parametrize("name", list(MESHES))
def test_losses_equal_the_single_process_run(name: str, data_path: str, tmp_path_factory) -> None:
    world, mesh, model = MESHES[name]
    ref = _reference(model, data_path, tmp_path_factory)
    run = run_train([*COMMON, *model, *mesh, f"data.path={data_path}", f"launcher.tasks_per_node={world}"],
                    tmp_path_factory.mktemp(name))
    assert run.returncode == 0, run.stderr[-3000:]
    got = run.losses()
    assert len(got) == len(ref) == STEPS
    for step, (a, b) in enumerate(zip(got, ref), start=1):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: {name} loss {a} vs single-process {b}"
    assert got[-1] < got[0]  # and it learns


def test_default_run_learns_and_writes_its_run_dir(data_path: str, tmp_path) -> None:
    run = run_train(["train.steps=30", f"data.path={data_path}", "checkpoint.enabled=false"], tmp_path / "run")
    assert run.returncode == 0, run.stderr[-3000:]
    m = run.metrics()
    assert [r["step"] for r in m] == list(range(1, 31))
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "eta_s"} <= set(m[0])
    first, last = sum(r["loss"] for r in m[:3]) / 3, sum(r["loss"] for r in m[-3:]) / 3
    assert last < first - 1.0, (first, last)  # the loss visibly falls
    assert (tmp_path / "run" / "config.yaml").read_text().count("pp_schedule: 1f1b") == 1
    assert "step 30/30 | loss" in run.stdout
