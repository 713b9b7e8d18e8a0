"""Resume through CheckpointManager on the FSDP2+TP+PP harness: bitwise after SIGKILL, resharded within fp32 tolerance."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobs.events import read_events
from tests.multiproc._harness import Net, mesh_ckpt, train
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.multiproc

STEPS = 12
PP2_DP2_TP2 = {"pp": 2, "dp_shard": 2, "tp": 2}


def _merged(res) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """Rank 0's losses (identical on all ranks) and the union of every rank's full parameters."""
    params: dict[str, torch.Tensor] = {}
    for r in sorted(res.results):
        params.update(res.results[r]["params"])
    return res.results[0]["losses"], params


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """12 uninterrupted steps on pp2*dp_shard2*tp2, saving at steps 6 and 12 (thread async)."""
    run = tmp_path_factory.mktemp("ref")
    res = run_ranks(train, 8, run_dir=str(run), mesh=PP2_DP2_TP2, steps=STEPS, ckpt=mesh_ckpt(every_steps=6))
    losses, params = _merged(res)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return run, losses, params


def test_resume_after_sigkill_matches_uninterrupted_run_bitwise(reference, tmp_path):
    _, ref_losses, ref_params = reference
    killed = run_ranks(
        train,
        8,
        run_dir=str(tmp_path),
        mesh=PP2_DP2_TP2,
        steps=STEPS,
        ckpt=mesh_ckpt(every_steps=6),
        kill_at_step=8,
        allow_kill=True,
    )
    assert killed.killed and all(c == -9 for c in killed.exitcodes.values()), killed.exitcodes
    assert (tmp_path / "checkpoints/step_6/manifest.json").exists()

    resumed = run_ranks(train, 8, run_dir=str(tmp_path), mesh=PP2_DP2_TP2, steps=STEPS, ckpt=mesh_ckpt(every_steps=6))
    losses, params = _merged(resumed)
    assert resumed.results[0]["start"] == 6
    assert sorted(losses) == list(range(7, STEPS + 1))
    for step in range(7, STEPS + 1):
        assert losses[step] == ref_losses[step], (step, losses[step], ref_losses[step])  # bitwise
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        assert torch.equal(p, ref_params[name]), name
    loaded = read_events(tmp_path / "events.jsonl", "checkpoint_loaded")
    assert loaded[-1]["step"] == 6 and loaded[-1]["resharded"] is False
    assert set(loaded[-1]["rng_restored"]) == {"python", "torch", "numpy"}
    state = resumed.results[0]["state"]
    assert state["step"] == STEPS and state["tokens_seen"] == 12 * 8 * 16


def _resume_resharded(reference, tmp_path: Path, mesh: dict[str, int], world: int):
    ref_run, ref_losses, ref_params = reference
    shutil.copytree(ref_run / "checkpoints/step_6", tmp_path / "checkpoints/step_6")
    res = run_ranks(
        train, world, run_dir=str(tmp_path), mesh=mesh, steps=STEPS, ckpt=mesh_ckpt(every_steps=6), init_pg=world > 1
    )
    losses, params = _merged(res)
    assert res.results[0]["start"] == 6
    got = torch.tensor([losses[s] for s in range(7, STEPS + 1)])
    want = torch.tensor([ref_losses[s] for s in range(7, STEPS + 1)])
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    assert params.keys() == ref_params.keys()
    for name, p in params.items():
        torch.testing.assert_close(p, ref_params[name], rtol=1e-4, atol=2e-5, msg=name)
    loaded = read_events(tmp_path / "events.jsonl", "checkpoint_loaded")[-1]
    assert loaded["resharded"] is True and loaded["saved_world_size"] == 8 and loaded["rng_restored"] == []


def test_resume_resharded_onto_dp_shard4_tp2_stays_within_fp32_tolerance(reference, tmp_path):
    _resume_resharded(reference, tmp_path, {"pp": 1, "dp_shard": 4, "tp": 2}, 8)


def test_resume_resharded_onto_one_process_stays_within_fp32_tolerance(reference, tmp_path):
    _resume_resharded(reference, tmp_path, {"pp": 1, "dp_shard": 1, "tp": 1}, 1)


def test_convert_writes_one_torch_save_file_that_loads_into_the_plain_model(reference, tmp_path, capsys):
    from checkpoint.convert import main as convert_main

    run, _, ref_params = reference
    out = tmp_path / "full.pt"
    repo = Path(__file__).resolve().parents[2]
    p = subprocess.run(
        [sys.executable, "-m", "checkpoint.convert", str(run / "checkpoints/step_12"), str(out)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    sd = torch.load(out, weights_only=False)
    assert sd["step"] == 12 and sd["train_state"]["step"] == 12
    model = Net()
    model.load_state_dict(sd["model"])  # strict: every key matches
    for name, t in model.named_parameters():
        assert torch.equal(t.detach(), ref_params[name]), name
    assert any(k.endswith(".exp_avg") for k in sd["optim"])
    # The command line's other two cases through its main() in this process (the `python -m` start above is the
    # same main; two interpreters less, each ~4 s of torch import on the loaded box)
    model_only = tmp_path / "model.pt"
    assert convert_main(["--model-only", str(run / "checkpoints/step_12"), str(model_only)]) == 0
    assert torch.load(model_only).keys() == sd["model"].keys()
    broken = tmp_path / "broken"
    shutil.copytree(run / "checkpoints/step_12", broken)
    (broken / "manifest.json").unlink()
    capsys.readouterr()
    assert convert_main([str(broken), str(tmp_path / "x.pt")]) == 2
    assert "not a committed checkpoint" in capsys.readouterr().err
