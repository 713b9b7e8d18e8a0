"""train.device / train.mixed_precision: resolution, the checks and their messages, the NCCL environment,
autocast on parts without FSDP, and that planning never touches CUDA."""

from __future__ import annotations

import pytest
import torch

from checkpoint.state import capture_rng, restore_rng
from jobs.config import compose
from jobs.device import backend_for, export_environ, gpu_index, resolve_device, resolve_mixed_precision
from jobs.launch.slurm import check_slurm_config
from jobs.model import Transformer, init_weights
from jobs.planner.gate import build_plan
from jobs.validate import check_device, validate
from parallel.precision import apply_autocast
from tests.conftest import run_train


@pytest.mark.parametrize("name, gpus, want", [("auto", 0, "cpu"), ("auto", 4, "cuda"), ("cpu", 8, "cpu"),
                                              ("cuda", 1, "cuda")])
def test_device_resolves_from_the_name_and_the_visible_gpus(name: str, gpus: int, want: str) -> None:
    assert resolve_device(name, gpus=gpus) == want


def test_cuda_without_a_gpu_names_the_override_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"train\.device=cuda but torch .* sees no CUDA GPU here; set train\.device=cpu"):
        check_device(compose(["train.device=cuda"]), gpus=0)


def test_fewer_gpus_than_tasks_per_node_names_launcher_tasks_per_node() -> None:
    cfg = compose(["train.device=cuda"])  # the default mesh: 8 ranks on one node
    with pytest.raises(ValueError, match=r"launcher\.tasks_per_node\(8\) ranks on this node but only 2 GPU\(s\) "
                                         r"visible: one rank per GPU; set launcher\.tasks_per_node=2"):
        check_device(cfg, gpus=2)
    assert check_device(cfg, gpus=1, per_task=True) == ("cuda", "bf16")  # Slurm bound one GPU to this task
    assert check_device(cfg, gpus=8) == ("cuda", "bf16")


@pytest.mark.parametrize("mp, device, want", [("auto", "cuda", "bf16"), ("auto", "cpu", "fp32"),
                                              ("bf16", "cpu", "bf16"), ("fp32", "cuda", "fp32")])
def test_mixed_precision_auto_is_bf16_on_cuda_and_fp32_on_cpu(mp: str, device: str, want: str) -> None:
    assert resolve_mixed_precision(mp, device_type=device) == want


@pytest.mark.parametrize("override, message", [
    ("train.device=gpu", "train.device='gpu' is not one of auto, cpu, cuda"),
    ("train.mixed_precision=fp16", "train.mixed_precision='fp16' is not one of auto, bf16, fp32"),
])
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
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the profile's value, not the default 3
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
    cfg = compose(["launcher=slurm", "train.device=cuda", f"run.dir={tmp_path}/runs/x", f"cluster.run_root={tmp_path}/runs"])
    with pytest.raises(ValueError, match=r"train\.device=cuda but cluster=local has cluster\.gpus_per_node=0"):
        check_slurm_config(cfg)
    cfg.train.device = "auto"
    check_slurm_config(cfg)  # auto on CPU nodes trains on their CPUs
