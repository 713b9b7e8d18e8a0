"""What the MoE parallel tests share: the seeded global batch, the single-process reference (loss, every gradient, the
router biases after one update), the meta-built parallel model, full gradients, and collectives counted by phase."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from jobs.config import ModelConfig
from jobs.models.model import Transformer, init_weights
from jobs.models.moe import MoE, moe_layers, update_expert_bias
from jobs.trainer import cross_entropy
from parallel import ep
from parallel.recipe import parallelize

__all__ = ["batch", "reference", "parallel_model", "full_grads", "biases", "GroupCollectives", "HostSyncs"]


def batch(*, seed: int, global_batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 256, (global_batch, seq + 1), generator=g)
    return toks[:, :-1], toks[:, 1:]


def biases(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {n: b.clone() for part in parts for n, b in part.named_buffers() if n.endswith("expert_bias")}


def full_grads(parts: list[nn.Module]) -> dict[str, torch.Tensor]:
    return {
        n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
        for part in parts
        for n, p in part.named_parameters()
    }


def reference(
    cfg: ModelConfig, x: torch.Tensor, y: torch.Tensor, *, prepare: Callable[[nn.Module], None] | None = None
) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process: (loss, every gradient, the router biases after one update at model.moe_bias_rate)."""
    model = Transformer(cfg)
    init_weights(model, seed=0)
    if prepare is not None:
        prepare(model)
    loss = cross_entropy(model(x), y)
    loss.backward()
    update_expert_bias(moe_layers([model]), rate=cfg.moe_bias_rate)
    return float(loss.detach()), full_grads([model]), biases([model])


def parallel_model(cfg: ModelConfig, *, dims, mesh, ep_mesh, seq: int, **kwargs) -> tuple[list[nn.Module], list[int]]:
    """`parallelize` on a meta-device model, then materialised and initialised as the trainer does (train mode)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    kwargs = {"sequence_parallel": False, "loss_parallel": False, "pp_schedule": "1f1b", **kwargs}
    parts, stages = parallelize(model, dims=dims, mesh=mesh, stages_per_rank=1, ep_mesh=ep_mesh, seq_len=seq, **kwargs)
    for part in parts:
        part.to_empty(device="cpu")
        init_weights(part, seed=0)
        part.train()
    return parts, stages


class GroupCollectives(TorchDispatchMode):
    """Counts the collectives issued on one process group (`group_name`) inside an MoE block, by phase and op:
    `watch(parts)` hooks every MoE block so that its forward and its backward are the counted windows."""

    def __init__(self, group_name: str) -> None:
        super().__init__()
        self.group_name, self.where, self.calls = group_name, None, Counter()

    def watch(self, parts: list[nn.Module]) -> None:
        for m in (m for part in parts for m in part.modules() if isinstance(m, MoE)):
            m.register_forward_pre_hook(lambda *_: self._set("forward"), prepend=True)
            m.register_forward_hook(lambda *_: self._set(None))  # after tp's output hook
            m.register_full_backward_pre_hook(lambda *_: self._set("backward"))
            m.register_full_backward_hook(lambda *_: self._set(None))

    def _set(self, where: str | None) -> None:
        self.where = where

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.where and func.namespace in ("c10d", "_c10d_functional") and self._group(args) == self.group_name:
            op = func.__name__.split(".")[0].replace("_", "")  # c10d's allreduce_ and DTensor's all_reduce alike
            kind = next(
                k for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", op) if k.replace("_", "") in op
            )
            self.calls[f"{self.where}_{kind}"] += 1
        return func(*args, **(kwargs or {}))

    @staticmethod
    def _group(args) -> str | None:
        """The group's name: the functional collectives' last string argument, c10d's ProcessGroup object."""
        names = [a for a in args if isinstance(a, str)]
        if names:
            return names[-1]
        for a in args:
            if isinstance(a, torch.ScriptObject):
                try:
                    return dist.ProcessGroup.unbox(a).group_name
                except RuntimeError:
                    continue
        return None


# Ops whose CUDA kernels read device data on the host (a device-to-host sync): `.item()` and friends, and the ops whose
# output size depends on the data unless told it (`repeat_interleave` without `output_size`, `bincount` reads min/max).
_SYNCING = ("_local_scalar_dense", "bincount", "nonzero", "unique", "masked_select")


class HostSyncs(TorchDispatchMode):
    """Counts the device-to-host syncs inside its window: the host reads through the MoE path's one seam
    (`parallel.ep.to_host`, counted as "to_host"), and every op that would read device data on the host on CUDA
    (by its name; `repeat_interleave` only without `output_size`), counted by name. CPU runs the same ops, so a
    count here is the count a GPU would see (tests/gpu checks it there with torch.cuda.set_sync_debug_mode)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self._real = ep.to_host

    def __enter__(self):
        def counted(t):
            self.calls["to_host"] += 1
            return self._real(t)

        ep.to_host = counted
        return super().__enter__()

    def __exit__(self, *exc):
        ep.to_host = self._real
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        kwargs = kwargs or {}
        if any(s in name for s in _SYNCING) or (
            name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 3
        ):
            self.calls[name] += 1
        return func(*args, **kwargs)
