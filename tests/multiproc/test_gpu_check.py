"""`scripts/gpu_check --device cpu --tiny` runs its whole path on a CPU and ends with one JSON line of figures;
its `--wheels` bootstrap works from inside a venv, and `--preflight` runs on a CPU."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONHOME",)}


def test_gpu_check_on_cpu_trains_saves_resumes_bitwise_and_prints_its_json_line(tmp_path) -> None:
    p = subprocess.run(
        [sys.executable, "scripts/gpu_check", "--device", "cpu", "--tiny", "--out", str(tmp_path / "w")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["gpu_check"] == "ok" and out["torch_api_gaps"] == [] and out["params"] == 229952
    legs = {leg["leg"]: leg for leg in out["legs"]}
    assert legs["bf16"]["rc"] == 0 and legs["bf16"]["steps"] == 6 and legs["bf16"]["step_time_s"] > 0
    assert legs["bf16"]["predicted"]["peak_mem_bytes"] > 0
    assert legs["checkpoint_save"]["save"]["step"] == 6 and legs["checkpoint_resume"]["load"]["step"] == 3
    assert out["resume"] == {"from_step": 3, "steps_compared": 3, "bitwise": True, "max_abs_loss_diff": 0.0}
    assert "bf16_ac_full" in legs  # run, or skipped with the reason, depending on the branch
    assert (tmp_path / "w" / "ckpt" / "checkpoints" / "step_6" / "manifest.json").exists()  # --out is kept


# ------------------------------------------------ the --wheels bootstrap and --preflight


_HIDDEN = (
    "hydra",
    "omegaconf",
    "antlr4",
    "submitit",
    "meshjob",
    "__editable__",
    "_meshjob",
    "hydra_core",
    "antlr4_python3_runtime",
)


def _venv_whose_torch_lives_only_in_it(root: Path) -> Path:
    """A venv like the lent GPU machine's python3: torch and the rest installed in the venv itself (here: a .pth
    onto links to this venv's packages), hydra-core, omegaconf, antlr4 and submitit missing."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "outer")], check=True, timeout=120)
    site = Path(sysconfig.get_paths()["purelib"])
    own = root / "outer-packages"
    own.mkdir()
    for entry in site.iterdir():
        if not entry.name.lower().startswith(_HIDDEN) and entry.suffix != ".pth":
            (own / entry.name).symlink_to(entry)
    outer_site = next((root / "outer" / "lib").glob("python3*/site-packages"))
    (outer_site / "own.pth").write_text(f"{own}\n")
    return root / "outer" / "bin" / "python"


def _wheel_of_installed(dist_name: str, out: Path) -> Path:
    """A wheel rebuilt from an installed distribution's files (its dist-info has WHEEL and RECORD): offline."""
    dist = importlib.metadata.distribution(dist_name)
    name = dist.metadata["Name"].replace("-", "_")
    whl = out / f"{name}-{dist.version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for f in dist.files:
            if "__pycache__" not in f.parts and f.parts[0] != ".." and Path(dist.locate_file(f)).is_file():
                z.write(dist.locate_file(f), str(f))
    return whl


def test_wheels_bootstrap_from_inside_a_venv_whose_torch_lives_only_there_uses_that_torch_and_leaves_nothing(
    tmp_path,
) -> None:
    py = _venv_whose_torch_lives_only_in_it(tmp_path)

    def run(*a, **kw):
        return subprocess.run(
            [str(py), *a],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
            env={**ENV, "TMPDIR": str(tmp_path / "tmp")},
            **kw,
        )

    (tmp_path / "tmp").mkdir()
    assert run("-c", "import torch").returncode == 0 and run("-c", "import hydra").returncode != 0
    # Why the old bootstrap failed: a --system-site-packages venv made from inside this one does not see its torch.
    assert run("-m", "venv", "--without-pip", "--system-site-packages", str(tmp_path / "nested")).returncode == 0
    assert (
        subprocess.run([str(tmp_path / "nested/bin/python"), "-c", "import torch"], capture_output=True).returncode != 0
    )
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for dist in ("hydra-core", "omegaconf", "antlr4-python3-runtime", "submitit"):
        _wheel_of_installed(dist, wheels)
    p = run("scripts/gpu_check", "--wheels", str(wheels), "--check-bootstrap")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    site = got["site"]
    assert Path(site).parent == tmp_path / "tmp" and Path(site).name.startswith("meshjob-gpu-check-site-")
    assert all(path.startswith(site) for path in got["modules"].values()), got["modules"]
    assert got["torch"].startswith(str(tmp_path / "outer-packages"))  # the venv's own torch, not a copy
    assert list((tmp_path / "tmp").iterdir()) == []  # the wheels' folder is removed
    # A folder without the wheels: exit 2, the fix named, nothing left behind.
    (tmp_path / "empty").mkdir()
    p = run("scripts/gpu_check", "--wheels", str(tmp_path / "empty"), "--check-bootstrap")
    assert p.returncode == 2 and "could not start" in p.stderr and "pip wheel -w DIR hydra-core" in p.stderr, p.stderr
    assert list((tmp_path / "tmp").iterdir()) == []


def test_preflight_on_cpu_prints_one_json_line_per_check_and_every_check_passes(tmp_path) -> None:
    p = subprocess.run(
        [sys.executable, "scripts/gpu_check", "--preflight", "--device", "cpu", "--out", str(tmp_path / "w")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        env=ENV,
    )
    lines = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert [ln.get("check") for ln in lines[:-1]] == [
        "torch",
        "disk",
        "kernels",
        "world",
        "stragglers",
        "cp_ring",
        "gemms",
        "norm_kernel",
        "trainer",
    ], p.stdout[-3000:]
    assert p.returncode == 0 and lines[-1]["gpu_check"] == "preflight ok", p.stdout[-3000:] + p.stderr[-2000:]
    checks = {ln["check"]: ln for ln in lines[:-1]}
    assert checks["kernels"]["bitwise"] and checks["trainer"]["bitwise"]
    assert checks["world"]["mesh"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 1}
    assert checks["world"]["flight_recorder_entries"] >= 2  # the float64 and the CPU all-reduce
    assert checks["disk"]["write_GBps"] > 0
    assert "no kernels on CPU" in checks["stragglers"]["skipped"]  # the GPU straggler clock: CUDA only
    assert "CUDA kernels only" in checks["cp_ring"]["skipped"]  # the ring's flash / memory-efficient CUDA kernels
    norm = checks["norm_kernel"]  # on CPU F.rms_norm decomposes into eager's ops: the same loss, bitwise
    assert norm["losses"]["fused"] == norm["losses"]["eager"]
    assert "aten::_fused_rms_norm" in norm["fused"]["forward"]["ops"]
    gemms = checks["gemms"]  # on CPU the tiny model at tp 2: the mechanics; on a GPU Llama 3 405B's tp8 shards
    assert (gemms["model"], gemms["tp"]) == ("tiny", 2) and sum(r["count"] for r in gemms["linears"]) == 7 * 4 + 1
    rates = [r["tflops"] for r in gemms["linears"]] + [gemms["attention_tflops"]]
    assert min(rates) > 0 and min(rates) <= gemms["block_tflops"] <= max(rates)  # a FLOP-weighted harmonic mean
    assert gemms["stream_GBps"] > 0  # an element-wise op's bytes per second: the memory-bound ops' rate
