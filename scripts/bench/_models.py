"""The benchmarks' shared models: the FSDP2-sharded MLP stack that the checkpoint benchmarks save and load."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def mlp_stack(dim: int, layers: int, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """`layers` Linear(dim, dim) (seed 0), each and the whole fully_shard-ed over `world` ranks when world > 1
    (a default process group must exist), and its AdamW: the state is 3x the params once a step has run."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    if world > 1:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        for lin in model:
            fully_shard(lin, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
