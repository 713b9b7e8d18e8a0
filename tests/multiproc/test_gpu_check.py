"""`scripts/gpu_check --device cpu --tiny` runs its whole path on a CPU and ends with one JSON line of figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_gpu_check_on_cpu_trains_saves_resumes_bitwise_and_prints_its_json_line(tmp_path) -> None:
    p = subprocess.run([sys.executable, "scripts/gpu_check", "--device", "cpu", "--tiny", "--out", str(tmp_path / "w")],
                       cwd=REPO, capture_output=True, text=True, timeout=400)
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
