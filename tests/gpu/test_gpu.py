"""On CUDA: bf16 trains within a stated tolerance of fp32, resume is bitwise with train.deterministic=true,
and FSDP2 issues its collectives on NCCL with the counts the CPU tier asserts for gloo."""

from __future__ import annotations

import json
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.debug import CommDebugMode

from jobs.config import ModelConfig, compose
from jobs.device import backend_for
from jobs.failure.timeouts import set_pg_timeouts
from jobs.models.model import Transformer, init_weights
from parallel.dims import ParallelDims
from parallel.fsdp import apply_fsdp
from tests.conftest import run_train
from tests.multiproc._ranks import run_ranks

pytestmark = pytest.mark.gpu

GPUS = torch.cuda.device_count()  # NVML: CUDA stays uninitialised in the pytest process (forks stay usable)
ONE_GPU = ["mesh=single", "launcher.tasks_per_node=1", "train.device=cuda"]
TWO_GPUS = ["mesh.pp=1", "mesh.dp_shard=2", "mesh.tp=1", "launcher.tasks_per_node=2", "train.device=cuda"]
# Same bound as the CPU tier (tests/multiproc/test_mixed_precision.py, measured gap 1.95e-3 there). Not yet
# measured on a GPU; put the measured gap here when one runs it.
LOSS_GAP_MAX = 1e-2
LOSS_GAP_MIN = 1e-4
needs_two = pytest.mark.skipif(0 < GPUS < 2, reason="needs 2 GPUs")  # with none, conftest says "no CUDA"


def _metrics(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}  # a resumed run appends: the last line of a step wins


@pytest.mark.parametrize(
    "mesh", [pytest.param(ONE_GPU, id="one_gpu_autocast"), pytest.param(TWO_GPUS, id="fsdp2_policy", marks=needs_two)]
)
def test_bf16_trains_within_tolerance_of_fp32_on_cuda(mesh: list[str], data_path: str, tmp_path: Path) -> None:
    losses = {}
    for mp in ("fp32", "bf16"):
        run = run_train(
            [
                *mesh,
                "train.steps=20",
                "checkpoint.enabled=false",
                f"data.path={data_path}",
                f"train.mixed_precision={mp}",
            ],
            tmp_path / mp,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        losses[mp] = run.losses()
    gaps = [abs(a - b) for a, b in zip(losses["bf16"], losses["fp32"])]
    assert len(gaps) == 20 and max(gaps) <= LOSS_GAP_MAX, gaps
    assert max(gaps) > LOSS_GAP_MIN, f"bf16 equals fp32 to {max(gaps)}: bf16 did not run"
    assert losses["bf16"][-1] < losses["bf16"][0] - 0.8


def test_resume_on_cuda_with_deterministic_kernels_is_bitwise(data_path: str, tmp_path: Path) -> None:
    common = [
        *ONE_GPU,
        "train.steps=8",
        "checkpoint.every_steps=4",
        "train.deterministic=true",
        "train.mixed_precision=bf16",
        f"data.path={data_path}",
    ]
    ref = run_train(common, tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    run_dir = tmp_path / "resumed"
    first = run_train(common, run_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    shutil.rmtree(run_dir / "checkpoints" / "step_8")  # the next attempt resumes from step 4
    again = run_train(common, run_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "checkpoint_loaded" in (run_dir / "events.jsonl").read_text()
    want, got = _metrics(tmp_path / "ref"), _metrics(run_dir)
    assert [got[s] for s in range(5, 9)] == [want[s] for s in range(5, 9)]  # bitwise: float equality


FSDP_ALL_GATHER = "c10d._allgather_base_"
FSDP_REDUCE_SCATTER = "c10d._reduce_scatter_base_"


def _nccl_fsdp_counts(rank: int, world_size: int, cfg: ModelConfig) -> dict:
    torch.cuda.set_device(rank)
    dist.init_process_group(backend_for("cuda"), rank=rank, world_size=world_size, timeout=timedelta(seconds=60))
    mesh = ParallelDims(pp=1, dp_replicate=1, dp_shard=world_size, cp=1, tp=1, ep=1, world_size=world_size).build_mesh(
        "cuda"
    )
    set_pg_timeouts(42.0)
    nccl = mesh["dp_shard"].get_group()._get_backend(torch.device("cuda"))
    with torch.device("meta"):
        model = Transformer(cfg)
    apply_fsdp(model, mesh["dp_shard"], reshard_after_forward=True)
    model.to_empty(device="cuda")
    init_weights(model, seed=0)
    gen = torch.Generator().manual_seed(100 + rank)
    out: dict = {"backend": nccl.name(), "timeout_s": nccl.options._timeout.total_seconds()}
    for step in range(2):  # step 0 warms up (lazy init)
        tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=gen).cuda()
        with CommDebugMode() as fwd:
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten(0, 1))
        with CommDebugMode() as bwd:
            loss.backward()
        out["forward"] = {str(k): n for k, n in fwd.get_comm_counts().items() if n}
        out["backward"] = {str(k): n for k, n in bwd.get_comm_counts().items() if n}
    return out


@needs_two
def test_fsdp_runs_on_nccl_with_the_same_collective_counts_and_our_timeout() -> None:
    cfg = compose(["model=tiny"]).model
    res = run_ranks(_nccl_fsdp_counts, 2, cfg, init_pg=False, timeout=300)
    n = cfg.n_layers
    for rank in (0, 1):
        got = res.results[rank]
        assert got["backend"] == "nccl" and got["timeout_s"] == 42.0, got
        assert got["forward"] == {FSDP_ALL_GATHER: n + 1}, got
        assert got["backward"] == {FSDP_ALL_GATHER: n, FSDP_REDUCE_SCATTER: n + 1}, got
