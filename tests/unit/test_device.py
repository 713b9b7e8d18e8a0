"""train.device / train.mixed_precision: resolution, the checks and their messages, the NCCL environment,
autocast on parts without FSDP, and that planning never touches CUDA."""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from checkpoint.state import capture_rng, restore_rng
from jobs.config import compose
from jobs.device import (
    NCCL_DEFAULTS,
    backend_for,
    dump_flight_recorder,
    export_environ,
    gpu_index,
    resolve_device,
    resolve_mixed_precision,
    set_determinism,
)
from jobs.launch import rank as rank_mod
from jobs.launch.slurm import check_slurm_config
from jobs.models.model import Transformer, init_weights
from jobs.planner.gate import build_plan
from jobs.validate import check_device, validate
from parallel.precision import apply_autocast
from tests.conftest import REPO, run_train


@pytest.mark.parametrize(
    "name, gpus, want", [("auto", 0, "cpu"), ("auto", 4, "cuda"), ("cpu", 8, "cpu"), ("cuda", 1, "cuda")]
)
def test_device_resolves_from_the_name_and_the_visible_gpus(name: str, gpus: int, want: str) -> None:
    assert resolve_device(name, gpus=gpus) == want


def test_cuda_without_a_gpu_names_the_override_and_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"train\.device=cuda but torch .* sees no CUDA GPU here; set train\.device=cpu"
    ):
        check_device(compose(["train.device=cuda"]), gpus=0)


def test_fewer_gpus_than_tasks_per_node_names_launcher_tasks_per_node() -> None:
    cfg = compose(["train.device=cuda"])  # the default mesh: 8 ranks on one node
    with pytest.raises(
        ValueError,
        match=r"launcher\.tasks_per_node\(8\) ranks on this node but only 2 GPU\(s\) "
        r"visible: one rank per GPU; set launcher\.tasks_per_node=2",
    ):
        check_device(cfg, gpus=2)
    assert check_device(cfg, gpus=1, per_task=True) == ("cuda", "bf16")  # Slurm bound one GPU to this task
    assert check_device(cfg, gpus=8) == ("cuda", "bf16")


@pytest.mark.parametrize(
    "mp, device, want",
    [("auto", "cuda", "bf16"), ("auto", "cpu", "fp32"), ("bf16", "cpu", "bf16"), ("fp32", "cuda", "fp32")],
)
def test_mixed_precision_auto_is_bf16_on_cuda_and_fp32_on_cpu(mp: str, device: str, want: str) -> None:
    assert resolve_mixed_precision(mp, device_type=device) == want


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.device=gpu", "train.device='gpu' is not one of auto, cpu, cuda"),
        ("train.mixed_precision=fp16", "train.mixed_precision='fp16' is not one of auto, bf16, fp32"),
    ],
)
def test_unknown_names_are_config_errors(override: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(compose([override]))


def test_backend_is_nccl_for_cuda_tensors_and_gloo_for_cpu_ones() -> None:
    assert backend_for("cuda") == "cuda:nccl,cpu:gloo"
    assert backend_for("cpu") == "gloo"


def test_a_rank_takes_its_local_rank_gpu_or_the_one_slurm_bound_to_it() -> None:
    assert gpu_index(local_rank=5, gpus=8) == 5
    assert gpu_index(local_rank=5, gpus=1) == 0
    with pytest.raises(RuntimeError, match="local rank 5 has no GPU: 4 visible"):
        gpu_index(local_rank=5, gpus=4)


def test_cluster_env_wins_and_nccl_defaults_fill_only_what_is_unset_on_cuda() -> None:
    cluster = compose(["cluster=h100_ib"]).cluster.env
    env = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50", "NCCL_DEBUG": "INFO"}
    done = export_environ(cluster, device_type="cuda", trace_dir="/runs/x/nccl_traces/local.0", environ=env)
    assert env["NCCL_IB_HCA"] == cluster["NCCL_IB_HCA"] and env["NCCL_DEBUG"] == "WARN"  # the profile wins
    assert env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"  # the user's value is kept
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == "/runs/x/nccl_traces/local.0/nccl_trace_rank_"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in done and done["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    cpu_env: dict[str, str] = {}
    assert export_environ({}, device_type="cpu", environ=cpu_env) == {} and cpu_env == {}
    assert export_environ({}, device_type="cuda", environ=cpu_env)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_autocast_runs_the_forward_in_bf16_and_keeps_the_parameters_fp32() -> None:
    cfg = compose([]).model
    model = Transformer(cfg)
    init_weights(model, seed=0)
    seen: dict[str, torch.dtype] = {}
    model.layers["0"].attention.wq.register_forward_hook(lambda m, i, o: seen.update(wq_out=o.dtype))  # returns None
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    fp32_logits = model(tokens)
    apply_autocast(model, device_type="cpu")
    seen.clear()
    logits = model(tokens)
    assert seen["wq_out"] == torch.bfloat16 and logits.dtype == torch.bfloat16
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    logits.float().sum().backward()
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}
    assert 1e-4 < (logits.float() - fp32_logits).abs().max().item() < 0.1  # bf16 rounding, not a different model


def test_rng_capture_takes_only_the_current_gpus_generator(monkeypatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda: calls.append("current") or torch.tensor([7]))
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: calls.append("all") or [])
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s: calls.append(f"set {int(s[0])}"))
    state = capture_rng()
    assert torch.equal(state["cuda"], torch.tensor([7]))
    assert "cuda" in restore_rng(state)
    assert calls == ["current", "set 7"]


def test_planning_a_cuda_job_never_initialises_cuda() -> None:
    cfg = compose(["train.device=cuda", "train.mixed_precision=bf16", "cluster=h100_ib", "launcher=slurm"])
    plan = build_plan(cfg, measure=False)
    assert plan.world_size == 8 and plan.per_rank
    assert not torch.cuda.is_initialized()


def test_train_with_cuda_on_a_cpu_machine_exits_2_before_writing_anything(tmp_path) -> None:
    r = run_train(["train.device=cuda"], tmp_path / "run", timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "config error: train.device=cuda but torch" in r.stderr and "set train.device=cpu" in r.stderr
    assert not (tmp_path / "run").exists()


def test_submitting_a_cuda_job_to_a_cpu_profile_is_refused_on_the_login_node(tmp_path) -> None:
    cfg = compose(
        ["launcher=slurm", "train.device=cuda", f"run.dir={tmp_path}/runs/x", f"cluster.run_root={tmp_path}/runs"]
    )
    with pytest.raises(ValueError, match=r"train\.device=cuda but cluster=local has cluster\.gpus_per_node=0"):
        check_slurm_config(cfg)
    cfg.train.device = "auto"
    check_slurm_config(cfg)  # auto on CPU nodes trains on their CPUs


# ---------------------------------------------------------------- the first GPU


def test_the_cluster_env_is_exported_before_the_rank_makes_its_gpu_current(monkeypatch, tmp_path) -> None:
    """CUDA reads CUDA_DEVICE_MAX_CONNECTIONS / PYTORCH_CUDA_ALLOC_CONF when its context is created
    (torch.cuda.set_device): the profile's values must be in the environment by then."""
    monkeypatch.setattr(os, "environ", dict(os.environ))  # _setup_torch exports into the process environment
    for key in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        os.environ.pop(key, None)
    seen: dict[str, str | None] = {}

    def set_device(device_type: str, *, local_rank: int) -> torch.device:  # where torch.cuda.set_device runs
        seen.update(
            {
                k: os.environ.get(k)
                for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "PYTORCH_CUDA_ALLOC_CONF", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
            }
        )
        return torch.device("cpu")

    monkeypatch.setattr(rank_mod, "rank_device", set_device)
    cfg = compose(
        [
            "cluster=h100_ib",
            "train.deterministic=false",
            f"run.dir={tmp_path}",
            "+cluster.env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        ]
    )
    env = SimpleNamespace(local_world_size=1, local_rank=0, attempt="local.0")
    threads = torch.get_num_threads()
    try:
        rank_mod._setup_torch(cfg, env, device_type="cuda")
    finally:
        torch.set_num_threads(threads)
    assert seen == {
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    }


def test_auto_finding_no_gpu_on_a_gpu_profile_is_refused_naming_both_fixes() -> None:
    """A CPU build of torch on an H100 node would otherwise train the job on the node's CPUs."""
    with pytest.raises(
        ValueError,
        match=r"train\.device=auto on a node of cluster=h100_ib \(cluster\.gpus_per_node=8\) "
        r"but torch .* sees no CUDA GPU: it would train on the CPU\. Install a CUDA "
        r"build of torch .*or set train\.device=cpu",
    ):
        check_device(compose(["cluster=h100_ib"]), gpus=0)
    assert check_device(compose(["cluster=h100_ib", "train.device=cpu"]), gpus=0) == ("cpu", "fp32")  # on purpose
    assert check_device(compose(["cluster=local"]), gpus=0) == ("cpu", "fp32")  # a CPU profile: auto is CPU
    assert check_device(compose(["cluster=h100_ib", "launcher.tasks_per_node=1"]), gpus=1) == ("cuda", "bf16")


@pytest.mark.parametrize("profile", sorted(p.stem for p in (REPO / "conf" / "cluster").glob("*.yaml")))
def test_no_cluster_profile_overrides_the_async_error_handling_that_keeps_the_flight_recorder(profile: str) -> None:
    """Mode 1 (TearDown) ends the process before the flight recorder is dumped; 3 (SkipCleanUp) is ours and
    torchtitan's. A profile may leave it unset (the code's default applies) or agree."""
    env = compose([f"cluster={profile}"]).cluster.env
    assert env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3") == NCCL_DEFAULTS["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


_FR_CHILD = """
import sys, torch, torch.distributed as dist
from pathlib import Path
from jobs.device import dump_flight_recorder
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1)
x = torch.ones(4)
dist.all_reduce(x)
dist.broadcast(x, 0)
print(dump_flight_recorder(Path(sys.argv[1]), rank=3, timeout_s=90))  # its format, not its bound: a loaded box
"""


def test_the_flight_recorder_dump_holds_this_ranks_last_collectives_in_torchs_file_and_format(tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.run(
        [sys.executable, "-c", _FR_CHILD, str(tmp_path / "traces"), str(port)],
        cwd=REPO,
        timeout=120,
        capture_output=True,
        text=True,
        env={**os.environ, "TORCH_FR_BUFFER_SIZE": "100"},
    )
    assert p.returncode == 0, p.stderr[-2000:]
    path = tmp_path / "traces" / "nccl_trace_rank_3"
    assert p.stdout.strip() == str(path)
    dump = pickle.loads(path.read_bytes())
    assert [e["profiling_name"] for e in dump["entries"]] == ["gloo:all_reduce", "gloo:broadcast"]
    assert not list((tmp_path / "traces").glob("*.tmp"))


def test_a_flight_recorder_dump_that_hangs_or_fails_never_keeps_the_rank_from_exiting(monkeypatch, tmp_path) -> None:
    c10d = torch._C._distributed_c10d
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        if hasattr(c10d, name):
            monkeypatch.setattr(c10d, name, lambda: time.sleep(30) or b"")
    t0 = time.monotonic()
    assert dump_flight_recorder(tmp_path, rank=0, timeout_s=0.5) is None
    assert time.monotonic() - t0 < 5
    for name in ("_dump_nccl_trace", "_dump_fr_trace"):
        if hasattr(c10d, name):
            monkeypatch.delattr(c10d, name)  # a torch without the API
    assert dump_flight_recorder(tmp_path, rank=0) is None and not list(tmp_path.iterdir())


def test_deterministic_cuda_turns_off_the_nan_fill_and_says_what_it_costs_and_how_to_turn_it_off(monkeypatch) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))
    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    try:
        line = set_determinism(True, device_type="cuda")
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.utils.deterministic.fill_uninitialized_memory is False
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert "cost step time" in line and "train.deterministic=false turns them off" in line
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.utils.deterministic.fill_uninitialized_memory = before[1]
    assert "faster; resume is not bitwise" in set_determinism(False, device_type="cuda")
    assert "nothing it costs" in set_determinism(True, device_type="cpu")


def _saved_bf16_weight_copies(model: Transformer, tokens: torch.Tensor) -> int:
    """Bytes of the bf16 weight copies autograd saves in one forward (matched by shape, either orientation:
    a linear saves its weight transposed; the token count 21 matches no weight's dims)."""
    shapes = {tuple(sorted(p.shape)) for p in model.parameters() if p.dim() == 2}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.bfloat16 and tuple(sorted(t.shape)) in shapes:
            seen[t.data_ptr()] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return sum(seen.values())


@pytest.mark.parametrize("ac", ["none", "full"])
def test_the_planner_counts_the_bf16_weight_copies_autocast_keeps_for_backward(ac: str) -> None:
    """Without FSDP, bf16 comes from torch.autocast: each forward casts every matmul weight and the linear keeps
    the copy for backward, one per microbatch in flight (a checkpointed block keeps none but holds one again
    while it recomputes). The planner counted none of it."""
    from jobs.planner import arith as P
    from parallel.ac import apply_ac

    m = compose(["model=tiny"]).model
    model = Transformer(m)
    init_weights(model, seed=0)
    apply_ac(model, mode=ac, every=1)
    apply_autocast(model, device_type="cpu")
    measured = _saved_bf16_weight_copies(model, torch.randint(0, m.vocab_size, (3, 7)))
    stages = [P.StageShape(tuple(range(m.n_layers)), first=True, last=True)]
    kw = dict(
        tp=1,
        fsdp=1,
        pp=1,
        microbatches=4,
        stages_per_rank=1,
        schedule="1f1b",
        seq_len=7,
        micro_batch=3,
        activation_checkpointing=ac,
        ac_every=1,
    )
    mem = P.rank_memory(m, stages, autocast=True, **kw)
    block = 2 * (P.count_params(m).blocks[0].attention + P.count_params(m).blocks[0].ffn)  # one block's bf16 copy
    recomputing = block if ac == "full" else 0
    assert measured > 0 and mem.autocast_bytes == measured + recomputing
    assert mem.peak_bytes == P.rank_memory(m, stages, **kw).peak_bytes + measured + recomputing
    one_gpu = build_plan(
        compose(["mesh=single", "launcher.tasks_per_node=1", "train.mixed_precision=bf16"]), measure=False
    )
    assert one_gpu.per_rank["autocast_bytes"] > 0  # the plan of a one-rank bf16 run counts it
    fsdp = build_plan(
        compose(["mesh=single", "launcher.tasks_per_node=2", "mesh.dp_shard=2", "train.mixed_precision=bf16"]),
        measure=False,
    )
    assert fsdp.per_rank["autocast_bytes"] == 0  # FSDP's MixedPrecisionPolicy gathers bf16 shards instead
