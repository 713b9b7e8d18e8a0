"""scripts/gpu_check's pieces that decide what it reports: the torch API gaps and the figures read from a run dir."""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import importlib.util
import json
import re
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO


@pytest.fixture(scope="module")
def gpu_check():
    loader = importlib.machinery.SourceFileLoader("gpu_check", str(REPO / "scripts" / "gpu_check"))
    spec = importlib.util.spec_from_loader("gpu_check", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_this_torch_has_every_api_the_project_uses(gpu_check) -> None:
    assert gpu_check.torch_api_gaps() == []


def test_an_api_missing_from_torch_is_named_with_where_the_project_uses_it(gpu_check, monkeypatch) -> None:
    monkeypatch.delattr(torch.nn.utils, "get_total_norm")  # added in torch 2.6: what an older torch lacks
    monkeypatch.delattr(torch.distributed.fsdp, "MixedPrecisionPolicy")
    gaps = gpu_check.torch_api_gaps()
    assert [g.split(" ")[0] for g in gaps] == [
        "torch.distributed.fsdp.MixedPrecisionPolicy",
        "torch.nn.utils.get_total_norm",
    ]
    assert re.match(r"torch\.nn\.utils\.get_total_norm \(jobs/[\w/]+\.py:\d+\)", gaps[1]), gaps[1]  # its first use


def test_figures_take_the_median_after_the_first_step_and_say_none_for_absent_fields(gpu_check, tmp_path: Path) -> None:
    rows = [
        {"step": s, "loss": 5.0 - s, "step_time_s": t, "tokens_per_s": 1000 / t}
        for s, t in [(1, 9.0), (2, 1.0), (3, 2.0), (4, 3.0)]
    ]
    rows[3]["peak_mem_bytes"] = 123
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "checkpoint_loaded", "step": 2, "load_s": 0.5}) + "\n")
    got = gpu_check.figures(tmp_path)
    assert got["step_time_s"] == 2.0 and got["tokens_per_s"] == 500.0  # step 1 (warm-up) left out
    assert got["mfu"] is None and got["tflops_per_rank"] is None and got["peak_mem_bytes"] == 123
    assert got["load"] == {"step": 2, "load_s": 0.5} and got["losses"][4] == 1.0


# ---------------------------------------------------------------- ready for the first GPU


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),  # H100 SXM: 1,979 with sparsity (nvidia.com/en-us/data-center/h100)
        ("NVIDIA H100 NVL", 835.0),  # 1,671 with sparsity, same page; torchtitan get_peak_flops: 835e12
        ("NVIDIA H100 PCIe", 756.0),  # 1,513 with sparsity, same page
        ("NVIDIA H200", 989.0),  # H200 SXM: 1,979 with sparsity (nvidia.com/en-us/data-center/h200)
        ("NVIDIA H200 NVL", 835.0),  # 1,671 with sparsity, same page
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA B200", 2250.0),  # Blackwell datasheet, 2.25 PFLOPS dense; torchtitan 2.25e15
        ("NVIDIA A100-SXM4-80GB", 312.0),  # nvidia.com/en-us/data-center/a100
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("Tesla V100-SXM2-32GB", 0.0),  # not in the table: no MFU rather than a guess
    ],
)
def test_the_dense_bf16_peak_is_the_datasheet_figure_halved_for_each_gpu_model(
    gpu_check, name: str, peak: float
) -> None:
    from jobs.planner.hardware import peak_bf16_tflops

    assert peak_bf16_tflops(name) == peak


def test_the_check_reports_mfu_in_our_attention_convention_and_in_torchtitans() -> None:
    from jobs.config import compose
    from jobs.planner.arith import count_params
    from jobs.telemetry.flops import mfu_text, model_flops_per_token

    m = compose(["model=tiny"]).model
    pc = count_params(m)
    n = pc.active - pc.embedding - sum(b.norms for b in pc.blocks) - pc.final_norm
    head = m.dim // m.n_heads
    # torchtitan (models/utils.py get_dense_model_nparams_and_flops): 6N + 12·L·H·Q·T, the causal mask not counted
    assert model_flops_per_token(m, seq_len=32, causal_halved=False) == 6 * n + 12 * m.n_layers * m.n_heads * head * 32
    assert model_flops_per_token(m, seq_len=32) == 6 * n + 6 * m.n_layers * m.n_heads * head * 32  # ours: halved
    assert mfu_text(0.412) == "MFU 41.2% (causal attention halved)"


def test_a_leg_is_compared_with_the_planners_figures_in_both_conventions(gpu_check) -> None:
    leg = {"step_time_s": 0.5, "peak_mem_bytes": 30, "mfu": 0.4, "tflops_per_rank": 400.0}
    out = gpu_check.compare(leg, {"step_s": 0.25, "peak_mem_bytes": 20}, whole_over_ours=1.25)
    assert out["mfu_attention_whole"] == 0.5 and out["tflops_per_rank_attention_whole"] == 500.0
    assert out["step_time_s_measured_over_predicted"] == 2.0 and out["peak_mem_bytes_measured_over_predicted"] == 1.5
    assert out["mfu_convention"] == "causal attention halved"


def test_on_a_gpu_the_planner_predicts_with_a_gpu_profile_and_the_legs_train_with_the_local_one(
    gpu_check, tmp_path
) -> None:
    """cluster=local has no GPU figures (the step time was n/a); h100_ib's env (NCCL_SOCKET_IFNAME=ib0) must not
    reach the one-GPU legs."""
    facts = {"name": "NVIDIA H200", "mem_gib": 139.8, "peak_bf16_tflops": 989.0}
    args = gpu_check.parse(["--device", "cuda"])
    base = gpu_check.base_overrides(args, facts, tmp_path / "tokens.h5")
    assert not any(o.startswith("cluster=") for o in base)
    pred = gpu_check.predict([*base, *gpu_check.plan_profile(facts)], ac="none")
    assert pred["cluster"] == "h100_ib" and pred["step_s"] > 0 and pred["tokens_per_s"] > 0 and 0 < pred["mfu"] < 1
    assert gpu_check.predict(base, ac="none")["step_s"] is None  # what the check printed before: n/a
    assert (
        gpu_check.plan_profile({"name": "NVIDIA A100-SXM4-80GB", "mem_gib": 80.0, "peak_bf16_tflops": 312.0})[0]
        == "cluster=a100_ib"
    )
    # the profiles' attention rate is FlashAttention-2's on the H100/A100 they cite: another peak keeps it off
    assert "cluster.gpu_attention_tflops=0" not in gpu_check.plan_profile(facts)
    b200 = gpu_check.plan_profile({"name": "NVIDIA B200", "mem_gib": 179.0, "peak_bf16_tflops": 2250.0})
    assert b200[0] == "cluster=h100_ib" and "cluster.gpu_attention_tflops=0" in b200


def test_legs_share_the_time_left_and_each_prints_its_json_line_when_it_ends(gpu_check, monkeypatch, capsys) -> None:
    timeouts: dict[str, float] = {}

    def fake_leg(name, overrides, run_dir, *, timeout):
        timeouts[name] = timeout
        return {"leg": name, "rc": 0, "losses": {1: 1.0}}

    monkeypatch.setattr(gpu_check, "run_leg", fake_leg)
    legs = gpu_check.Legs(deadline_s=430.0, names=list(gpu_check.LEG_WEIGHTS), preds={}, whole_over_ours=1.0)
    legs.run("bf16", [], Path("x"))
    line = capsys.readouterr().out.strip()
    assert json.loads(line)["leg"] == "bf16" and "losses" not in line  # printed the moment the leg ended
    assert 420 / 4.2 - 1 < timeouts["bf16"] <= 420 / 4.2  # (430 - 10 s for the report) * 1.0 / (1 + 1 + 1.3 + 0.9)
    legs.end = time.monotonic() + 20.0  # most of the time went on the first legs
    legs.run("bf16_ac_full", [], Path("x"))
    skipped = json.loads(capsys.readouterr().out.strip())
    assert (
        skipped["leg"] == "bf16_ac_full"
        and skipped["skipped"].startswith("--deadline: 6 s left")
        and skipped["rc"] == 124
    )
    assert legs.todo == ["checkpoint_save", "checkpoint_resume"]


def test_bootstrap_without_wheels_or_with_only_antlr4s_sdist_says_how_to_build_the_wheels(
    gpu_check, monkeypatch, tmp_path
) -> None:
    monkeypatch.setattr(gpu_check, "missing_modules", lambda: ["hydra-core (No module named 'hydra')"])
    monkeypatch.delenv(gpu_check.SITE_ENV, raising=False)
    with pytest.raises(gpu_check.BootstrapError, match=r"lacks hydra-core .*pip wheel -w DIR hydra-core==1\.3\.8"):
        gpu_check.bootstrap(gpu_check.parse([]))
    (tmp_path / "antlr4-python3-runtime-4.9.3.tar.gz").write_bytes(b"")
    monkeypatch.setattr(gpu_check.importlib.metadata, "distribution", _no_distribution)
    with pytest.raises(
        gpu_check.BootstrapError,
        match=r"no antlr4-python3-runtime wheel .*only as an sdist: antlr4-python3-"
        r"runtime-4\.9\.3\.tar\.gz is here\); build its wheel: pip wheel --no-deps",
    ):
        gpu_check.wheels_to_install(tmp_path)
    assert gpu_check.main(["--wheels", str(tmp_path)]) == 2


def _no_distribution(name: str):
    raise importlib.metadata.PackageNotFoundError(name)


def test_the_wheels_folder_may_carry_binary_wheels_for_other_pythons_and_what_this_one_has(gpu_check, tmp_path) -> None:
    import sys

    here = f"cp{sys.version_info.major}{sys.version_info.minor}"
    other = "cp39" if here != "cp39" else "cp310"
    for name in (
        f"PyYAML-6.0.2-{other}-{other}-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "hydra_core-1.3.8-py3-none-any.whl",
        "antlr4_python3_runtime-4.9.3-py3-none-any.whl",
        f"totally_absent_dist-1.0-{here}-{here}-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "totally_absent_dist-1.0-py3-none-any.whl",
    ):
        (tmp_path / name).write_bytes(b"")
    chosen = [w.name for w in gpu_check.wheels_to_install(tmp_path)]
    # hydra-core and antlr4 are installed in this venv (kept), the cp39 PyYAML cannot install here, one wheel per dist
    assert chosen == [f"totally_absent_dist-1.0-{here}-{here}-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"]
