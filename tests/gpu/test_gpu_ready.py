"""On CUDA: the preflight passes on this GPU, autocast's bf16 weight copies are what the planner counts,
and the flight recorder dumps NCCL's collectives from a one-rank cuda:nccl,cpu:gloo world."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobs.config import compose
from jobs.models.model import Transformer, init_weights
from parallel.precision import apply_autocast
from tests.conftest import REPO

pytestmark = pytest.mark.gpu


def test_the_preflight_passes_on_this_gpu(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "scripts/gpu_check", "--preflight", "--out", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    assert p.returncode == 0 and lines[-1]["gpu_check"] == "preflight ok", p.stdout[-4000:] + p.stderr[-2000:]
    world = next(ln for ln in lines if ln.get("check") == "world")
    assert world["nccl_timeout_s"] == 42.0 and world["flight_recorder_entries"] > 0


def test_autocast_on_cuda_keeps_the_bf16_weight_copies_the_planner_counts() -> None:
    from jobs.planner import arith as P

    m = compose(["model=tiny"]).model
    with torch.device("cuda"):
        model = Transformer(m)
    init_weights(model, seed=0)
    apply_autocast(model, device_type="cuda")
    tokens = torch.randint(0, m.vocab_size, (3, 7), device="cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    logits = model(tokens)  # the graph holds the saved tensors, the bf16 weight copies among them
    held = torch.cuda.memory_allocated() - before - logits.numel() * logits.element_size()
    stages = [P.StageShape(tuple(range(m.n_layers)), first=True, last=True)]
    copies = P.autocast_copy_bytes(m, stages, in_flight=m.n_layers, tp=1)
    assert held >= copies  # activations come on top; the copies alone must fit under what forward holds
    del logits
