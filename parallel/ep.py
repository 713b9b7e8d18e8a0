"""Expert parallelism: routed experts sharded over the ep axis, tokens dispatched and combined with all-to-alls.

`apply_ep` makes each MoE block's `GroupedExperts` weights DTensors sharded on dim 0 (whole experts)
over the ep axis of the MoE mesh, and wraps the experts' forward with two hooks:
  dispatch (pre-hook): the per-expert token counts are exchanged (one small all_to_all_single of
    ints on the tokens' device) and read on the host once (`to_host`, the layer's one sync), then the tokens go to the ranks owning their experts (all_to_all_single, uneven splits),
    and are regrouped by local expert;
  combine (post-hook): the expert outputs go back to where their tokens came from (all_to_all_single).
Both token all-to-alls are `_AllToAll` (autograd: each one's backward is the reverse all-to-all), so a
MoE layer costs exactly two token all-to-alls per microbatch forward and two backward, plus the count
exchange in forward. Under tensor parallel (parallel/tp.py splits each expert's hidden dim over tp) the
experts are sharded over the 2-D (ep, tp) mesh: each tp rank dispatches within its own ep group (the ranks of
its tp index) and tp's all-reduces stay outside the two all-to-alls. `apply_expert_fsdp` then shards the
experts over the expert-data-parallel axis (`edp` = dp_shard / ep) only, so their gradients are reduced among
the ranks holding the same experts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = ["apply_ep", "apply_expert_fsdp", "all_to_all", "is_grouped_experts", "to_host"]


def is_grouped_experts(module: nn.Module) -> bool:
    """The routed experts' module (jobs.models.moe.GroupedExperts says so itself; parallel/ never imports jobs/)."""
    return getattr(module, "is_grouped_experts", False)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits on dim 0; the backward sends the gradients the reverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(
            out, x.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits, group=group
        )
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out_splits, in_splits = ctx.splits
        gin = grad.new_empty(sum(in_splits), *grad.shape[1:])
        dist.all_to_all_single(
            gin, grad.contiguous(), output_split_sizes=in_splits, input_split_sizes=out_splits, group=ctx.group
        )
        return gin, None, None, None


def all_to_all(x: torch.Tensor, *, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows x[sum(in_splits[:r]) : ...] go to rank r of `group`; returns what every rank sent here (autograd)."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def to_host(counts: torch.Tensor) -> list[int]:
    """The MoE path's one device-to-host read per layer and forward (torchtitan's count): the token counts that size
    the all-to-alls (and the padded expert matmul). Every host read of routing data goes through here."""
    return counts.tolist()


class _Dispatcher:
    """The two hooks of one GroupedExperts module; `state` carries the splits from dispatch to combine."""

    def __init__(self, group, ep: int) -> None:
        self.group, self.ep = group, ep
        self.state: tuple | None = None

    def dispatch(self, module: nn.Module, args: tuple) -> tuple:
        """(x grouped by expert, counts per expert on x's device) -> (the rows of this rank's experts grouped by
        local expert, their counts on the device, the same on the host). The counts travel on x's device (the
        group's own backend), and are read on the host once, in one piece."""
        x, counts = args[:2]
        n_local = counts.shape[0] // self.ep
        send_counts = counts.view(self.ep, n_local)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [source rank, local expert]
        local = recv_counts.sum(0)
        host = to_host(torch.cat([send_counts.sum(1), recv_counts.sum(1), local]))
        send, recv, local_host = host[: self.ep], host[self.ep : 2 * self.ep], host[2 * self.ep :]
        x_recv = all_to_all(x, out_splits=recv, in_splits=send, group=self.group)
        # Received rows are ordered by (source rank, local expert): regroup them by local expert.
        expert = torch.arange(n_local, device=x.device).repeat(self.ep)
        expert = torch.repeat_interleave(expert, recv_counts.flatten(), output_size=sum(recv))
        perm = expert.argsort(stable=True)
        self.state = (perm, send, recv)
        return x_recv.index_select(0, perm), local, local_host

    def combine(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        perm, send, recv = self.state
        self.state = None
        inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
        back = out.index_select(0, inverse)
        return all_to_all(back, out_splits=send, in_splits=recv, group=self.group)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shards every GroupedExperts module's weights over `ep_mesh` by whole experts (dim 0) and puts the
    dispatch/combine all-to-alls around its forward. `ep_mesh` is the ep axis, or (ep, tp) after tensor parallel
    (whose hidden-dim split, a 1-D DTensor on the tp axis, is kept on the second axis). Runs on the meta-device
    model. Dispatch runs after, combine before any hooks already there (tp's), so the all-to-alls are innermost."""
    ep = ep_mesh.size(0)
    for module in model.modules():
        if not is_grouped_experts(module):
            continue
        for name, param in list(module.named_parameters(recurse=False)):
            if param.shape[0] % ep:
                raise ValueError(
                    f"model.n_routed_experts({param.shape[0]}) % mesh.ep({ep}) != 0: each ep rank needs whole experts"
                )
            tp_placements = list(param.placements) if isinstance(param, DTensor) else []
            assert len(tp_placements) == ep_mesh.ndim - 1, (name, tp_placements, ep_mesh)
            full = torch.empty(param.shape, dtype=param.dtype, device=param.device) if tp_placements else param.data
            sharded = distribute_tensor(full, ep_mesh, [Shard(0), *tp_placements], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        hooks = _Dispatcher(ep_mesh.get_group(0), ep)
        module.register_forward_pre_hook(hooks.dispatch)
        module.register_forward_hook(hooks.combine, prepend=True)


def apply_expert_fsdp(
    model: nn.Module,
    edp_mesh: DeviceMesh,
    *,
    dp: int,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> None:
    """FSDP2 over the expert-data-parallel axis for every GroupedExperts module (before the blocks are
    wrapped, so the block's FSDP leaves these weights alone); HSDP when `edp_mesh` is 2-D (dp_replicate, edp).
    Their gradients are reduced over `edp_mesh` only and divided by the whole data-parallel degree `dp` (dp * cp
    with context parallel: each expert's gradient already sums the tokens of the ep ranks it serves), which gives
    the same mean over the global batch as the dense weights."""
    for module in model.modules():
        if is_grouped_experts(module):
            fully_shard(
                module,
                mesh=edp_mesh,
                reshard_after_forward=reshard_after_forward,
                mp_policy=mp_policy or MixedPrecisionPolicy(),
            )
            module.set_gradient_divide_factor(float(dp))
            # SUM, then / dp (gloo has no PREMUL_SUM). Not on one edp rank (also under HSDP): torch 2.13's FSDP then
            # divides its local copy by the factor and post-divides once more (grads / dp^2; tests/multiproc/test_moe_ep.py).
            if edp_mesh.size(-1) > 1:
                module.set_force_sum_reduction_for_comms(True)
