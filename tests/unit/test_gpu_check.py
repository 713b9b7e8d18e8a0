"""scripts/gpu_check's pieces that decide what it reports: the torch API gaps and the figures read from a run dir."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import re
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
    assert [g.split(" ")[0] for g in gaps] == ["torch.distributed.fsdp.MixedPrecisionPolicy",
                                              "torch.nn.utils.get_total_norm"]
    assert re.match(r"torch\.nn\.utils\.get_total_norm \(jobs/[\w/]+\.py:\d+\)", gaps[1]), gaps[1]  # its first use


def test_figures_take_the_median_after_the_first_step_and_say_none_for_absent_fields(gpu_check, tmp_path: Path) -> None:
    rows = [{"step": s, "loss": 5.0 - s, "step_time_s": t, "tokens_per_s": 1000 / t} for s, t in
            [(1, 9.0), (2, 1.0), (3, 2.0), (4, 3.0)]]
    rows[3]["peak_mem_bytes"] = 123
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "checkpoint_loaded", "step": 2, "load_s": 0.5}) + "\n")
    got = gpu_check.figures(tmp_path)
    assert got["step_time_s"] == 2.0 and got["tokens_per_s"] == 500.0  # step 1 (warm-up) left out
    assert got["mfu"] is None and got["tflops_per_rank"] is None and got["peak_mem_bytes"] == 123
    assert got["load"] == {"step": 2, "load_s": 0.5} and got["losses"][4] == 1.0
