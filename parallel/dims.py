"""ParallelDims: the parallelism degrees, their validation, and the one place the DeviceMesh is built."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the login node's jobs.validate checks the degrees without torch
    from torch.distributed.device_mesh import DeviceMesh

from parallel.config import MULTI_STAGE_SCHEDULES, PP_SCHEDULES, MeshConfig

__all__ = ["ParallelDims", "MESH_AXES", "EP_MESH_AXES", "MOE_MESH_AXES", "fold_moe_mesh"]

# The mesh axes, outermost first. Outer axes cross nodes (pp, then dp_replicate), inner ones stay
# inside a node (tp last: its collectives run every layer and need the fastest links; cp next, its
# K/V exchange runs every layer too). ep splits dp_shard on a second mesh (EP_MESH_AXES below).
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
# The MoE mesh (mesh.ep > 1) over the same ranks: dp_shard * cp = edp * ep, ep inner (parallel/ep.py).
EP_MESH_AXES = ("pp", "dp_replicate", "edp", "ep", "cp", "tp")
# The MoE layers' mesh as planned (Megatron-Core's parallel folding): over the same ranks as the attention
# mesh, edp * ep = dp_shard * cp and the experts' tensor-parallel degree etp = tp.
MOE_MESH_AXES = ("pp", "dp_replicate", "edp", "ep", "etp")


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of each mesh axis for a world of `world_size` ranks.

    The mesh is row-major over MESH_AXES: rank = ((((pp·R + r)·S + s)·C + c)·T + t), so tp groups are
    adjacent ranks (one node's NVLink domain) and pp groups are the farthest apart. Derived meshes:
    `dp` = dp_replicate * dp_shard slices of the global batch (see `dp_rank`); FSDP2 shards over
    `dp_shard` and replicates over `dp_replicate` (HSDP). With cp > 1, FSDP2 shards over the flattened
    `dp_shard_cp` = dp_shard * cp axis instead (as torchtitan): cp ranks hold the same parameters and
    see different tokens, so their gradients are averaged exactly like dp's (reduce-scatter).
    """

    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    ep: int
    world_size: int

    @classmethod
    def from_config(
        cls, mesh: MeshConfig, *, world_size: int, world_size_expr: str = "", training: bool = True
    ) -> ParallelDims:
        """Resolves `mesh.dp_shard=-1` and validates; errors name the `mesh.*` override and the arithmetic.

        `training=False` (the planner) accepts any mesh.ep."""
        where = f" ({world_size_expr})" if world_size_expr else ""
        for axis in ("pp", "dp_replicate", "cp", "tp", "ep"):
            v = getattr(mesh, axis)
            if v < 1:
                raise ValueError(f"mesh.{axis}({v}) must be >= 1")
        if mesh.dp_shard < 1 and mesh.dp_shard != -1:
            raise ValueError(f"mesh.dp_shard({mesh.dp_shard}) must be >= 1, or -1 for the ranks left over")
        others = mesh.pp * mesh.dp_replicate * mesh.cp * mesh.tp
        dp_shard = mesh.dp_shard
        if dp_shard == -1:
            if world_size % others:
                raise ValueError(
                    f"mesh.dp_shard=-1 cannot be inferred: world size {world_size}{where} is not divisible by "
                    f"mesh.pp({mesh.pp}) * mesh.dp_replicate({mesh.dp_replicate}) * mesh.cp({mesh.cp}) * "
                    f"mesh.tp({mesh.tp}) = {others}; change those degrees or the world size"
                )
            dp_shard = world_size // others
        product = others * dp_shard
        if product != world_size:
            raise ValueError(
                f"mesh.pp({mesh.pp}) * mesh.dp_replicate({mesh.dp_replicate}) * mesh.dp_shard({dp_shard}) * "
                f"mesh.cp({mesh.cp}) * mesh.tp({mesh.tp}) = {product} != world size {world_size}{where}; "
                "make the product equal the world size (mesh.dp_shard=-1 fills the rest)"
            )
        if training and mesh.ep > 1:
            _check_ep(mesh, dp_shard=dp_shard)
        if mesh.pp_schedule not in PP_SCHEDULES:
            raise ValueError(f"mesh.pp_schedule={mesh.pp_schedule!r} is not one of {', '.join(PP_SCHEDULES)}")
        return cls(mesh.pp, mesh.dp_replicate, dp_shard, mesh.cp, mesh.tp, mesh.ep, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different slices of the global batch are in flight."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp * self.cp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    def describe_meshes(self) -> str:
        """Both meshes over the same ranks: the attention layers' and (with mesh.ep > 1) the MoE layers'."""
        attention = " * ".join(f"{a}{getattr(self, a)}" for a in MESH_AXES if getattr(self, a) > 1) or "single"
        if not self.ep_enabled:
            return f"{attention} (every layer: mesh.ep=1)"
        moe = fold_moe_mesh(
            pp=self.pp, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, cp=self.cp, tp=self.tp, ep=self.ep
        )
        folded = " * ".join(f"{a}{v}" for a, v in moe.items() if v > 1 or a == "edp")
        return f"attention {attention} | MoE {folded} (folded over the same {self.world_size} ranks)"

    def describe(self) -> str:
        out = " * ".join(f"{a}{getattr(self, a)}" for a in MESH_AXES if getattr(self, a) > 1) or "single"
        within = "dp_shard*cp" if self.cp_enabled else "dp_shard"
        return f"{out} (ep{self.ep} within {within})" if self.ep > 1 else out

    def build_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """Builds the world DeviceMesh with every axis named (size-1 axes included), plus the flattened
        `dp_shard_cp` axis FSDP2 shards over when cp > 1."""
        from torch.distributed.device_mesh import init_device_mesh  # lazy: ranks only, not the login node

        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES)
        if self.cp_enabled:
            mesh[("dp_shard", "cp")]._flatten("dp_shard_cp")
        return mesh

    def fsdp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP2 shards over: dp_shard (or dp_shard_cp), with dp_replicate in front for HSDP."""
        shard = "dp_shard_cp" if self.cp_enabled else "dp_shard"
        with warnings.catch_warnings():  # torch 2.13 warns that slicing a flattened axis from the root will change
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            return mesh[("dp_replicate", shard)] if self.hsdp_enabled else mesh[shard]

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    def build_ep_mesh(self, device_type: str = "cpu") -> DeviceMesh:
        """The MoE mesh over the same ranks, dp_shard * cp split into (edp, ep) (`fold_moe_mesh`; its cp axis is
        1, folded in): ep = adjacent dp_shard*cp ranks that exchange tokens, edp = the ranks holding the same
        experts (their gradients are reduced over it). Row-major, so rank (s, c) of dp_shard * cp is
        (edp, ep) = divmod(s * cp + c, ep): the same ranks as the attention mesh's."""
        from torch.distributed.device_mesh import init_device_mesh  # lazy: ranks only, not the login node

        shape = (self.pp, self.dp_replicate, self.dp_shard * self.cp // self.ep, self.ep, 1, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=EP_MESH_AXES)

    @staticmethod
    def dp_rank(mesh: DeviceMesh) -> int:
        """This rank's index among the dp = dp_replicate * dp_shard slices of the global batch."""
        return mesh["dp_replicate"].get_local_rank() * mesh["dp_shard"].size() + mesh["dp_shard"].get_local_rank()


def fold_moe_mesh(*, pp: int, dp_replicate: int, dp_shard: int, cp: int, tp: int, ep: int) -> dict[str, int]:
    """The MoE layers' mesh folded over the attention mesh's ranks (MOE_MESH_AXES): per pipeline stage and
    replica, the dp_shard * cp ranks become edp * ep (ep adjacent ranks exchange tokens, edp hold the same
    experts) and the experts are tensor-parallel over the attention's tp ranks (etp = tp). Raises ValueError
    naming mesh.ep, the arithmetic and the degrees that fit."""
    ranks = dp_shard * cp
    if ep < 1 or ranks % ep:
        fits = [d for d in range(1, ranks + 1) if ranks % d == 0]
        raise ValueError(
            f"mesh.ep({ep}) must divide mesh.dp_shard({dp_shard}) * mesh.cp({cp}) = {ranks}: the MoE "
            f"mesh folds edp * ep over the attention mesh's data-parallel ranks; set mesh.ep to one of "
            f"{', '.join(map(str, fits))}"
        )
    return {"pp": pp, "dp_replicate": dp_replicate, "edp": ranks // ep, "ep": ep, "etp": tp}


def _check_ep(mesh: MeshConfig, *, dp_shard: int) -> None:
    """Expert parallelism as built (parallel/ep.py): ep folded into dp_shard * cp, with FSDP/HSDP, pp and tp (the
    experts tensor-parallel over the attention's tp ranks, etp = tp: there is no separate key)."""
    fold_moe_mesh(pp=mesh.pp, dp_replicate=mesh.dp_replicate, dp_shard=dp_shard, cp=mesh.cp, tp=mesh.tp, ep=mesh.ep)


def stages_per_rank(mesh: MeshConfig) -> int:
    """Virtual pipeline stages per pp rank: 1 for single-stage schedules, 2 by default for multi-stage ones."""
    if mesh.pp_stages_per_rank != -1:
        return mesh.pp_stages_per_rank
    return 2 if mesh.pp_schedule in MULTI_STAGE_SCHEDULES else 1


def device_type() -> str:
    import torch  # lazy: ranks only, not the login node

    return "cuda" if torch.cuda.is_available() else "cpu"
