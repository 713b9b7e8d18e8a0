"""train.compile's refusals, train.compile_backend's check, and optim.fused's choice of AdamW kernel."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from jobs.config import compose
from jobs.models.model import Transformer, init_weights
from jobs.trainer import adamw_kernel, build_optimizers
from jobs.validate import check_device, validate
from parallel.compile import apply_compile


def test_optim_fused_auto_is_fused_on_cuda_and_foreach_on_cpu() -> None:
    assert adamw_kernel(None, "cuda") == {"fused": True}
    assert adamw_kernel(None, "cpu") == {"foreach": True}
    assert adamw_kernel(True, "cpu") == {"fused": True}
    assert adamw_kernel(False, "cuda") == {"foreach": True}


def test_build_optimizers_passes_the_kernel_to_adamw() -> None:
    cfg = compose(["mesh=single", "launcher.tasks_per_node=1", "optim.fused=true"])
    (opt,) = build_optimizers([torch.nn.Linear(4, 4)], cfg.optim, device_type="cpu")
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    (opt,) = build_optimizers([torch.nn.Linear(4, 4)], compose(["mesh=single"]).optim, device_type="cpu")
    assert opt.defaults["foreach"] is True and not opt.defaults["fused"]


def test_compile_with_tensor_parallel_is_refused_naming_the_fix() -> None:
    with pytest.raises(
        ValueError, match=r"train.compile=true with mesh.tp\(2\) > 1.*set train.compile=false or mesh.tp=1"
    ):
        validate(compose(["train.compile=true"]))  # the default mesh has tp2
    assert validate(compose(["train.compile=true", "mesh.tp=1", "launcher.tasks_per_node=4"])).dims.tp == 1


def test_an_unknown_compile_backend_is_refused_where_the_ranks_run_naming_the_override() -> None:
    cfg = compose(["mesh=single", "launcher.tasks_per_node=1", "train.device=cpu", "train.compile=true"])
    cfg.train.compile_backend = "inductr"
    with pytest.raises(ValueError, match=r"train.compile_backend='inductr' is not a torch.compile backend.*aot_eager"):
        check_device(cfg, gpus=0)
    cfg.train.compile = False
    assert check_device(cfg, gpus=0) == ("cpu", "fp32")  # not compiling: the key is not read
    cfg.train.compile = True
    for backend in ("inductor", "aot_eager"):  # the default and a debugging one
        cfg.train.compile_backend = backend
        assert check_device(cfg, gpus=0) == ("cpu", "fp32")


def test_compile_in_place_keeps_the_parameter_names_and_the_output() -> None:
    # backend aot_eager: Dynamo's capture and AOTAutograd as the trainer gets them, without inductor's code
    # generation (127 s against a cold inductor cache on 2 loaded cores, ~10 s here); inductor's numerics
    # are tests/multiproc/test_compile.py's (compiled under FSDP2 and PP, the eager losses).
    cfg = compose(["mesh=single", "model.n_layers=3"])
    model = Transformer(cfg.model)
    init_weights(model, seed=0)
    names = [n for n, _ in model.named_parameters()]
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(tokens)
    apply_compile(model, backend="aot_eager")
    assert [n for n, _ in model.named_parameters()] == names  # no _orig_mod.: checkpoints and init unchanged
    assert all(b._compiled_call_impl is not None for b in model.layers.values())
    torch._dynamo.reset()
    counters.clear()
    with torch.no_grad():
        compiled = model(tokens)
    assert counters["stats"]["unique_graphs"] == 1  # both blocks run the first block's graph
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
