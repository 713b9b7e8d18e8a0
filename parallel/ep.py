"""Expert parallelism: routed experts sharded over the ep axis, tokens dispatched and combined with all-to-alls.

`apply_ep` makes each MoE block's `GroupedExperts` weights DTensors sharded on dim 0 (whole experts)
over the ep axis of the MoE mesh, and wraps the experts' forward with two hooks:
  dispatch (pre-hook): the per-expert token counts are exchanged (one small all_to_all_single of
    ints on the tokens' device) and read on the host once (`to_host`, the layer's one sync), then the tokens go to the ranks owning their experts (all_to_all_single, uneven splits),
    and are regrouped by local expert;
  combine (post-hook): the expert outputs go back to where their tokens came from (all_to_all_single).
Both token all-to-alls are `_AllToAll` (autograd: each one's backward is the reverse all-to-all), so a
MoE layer costs exactly two token all-to-alls per microbatch forward and two backward, plus the count
exchange in forward. Under tensor parallel (parallel/tp.py splits each expert's hidden dim over tp and the
block's tokens over the tp ranks) the experts are sharded over the 2-D (ep, tp) mesh: each tp rank dispatches its
own tokens within its ep group (the ranks of its tp index), the rows an ep rank received are all-gathered over tp
before the experts and their partial outputs reduce-scattered over tp after (two all-to-alls on the tp group), so
the ep all-to-alls carry every token once, not tp times. `apply_expert_fsdp` then shards the
experts over the expert-data-parallel axis (`edp` = dp_shard / ep) only, so their gradients are reduced among
the ranks holding the same experts (on one edp rank in fp32 it only divides their gradients: no FSDP unit).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

__all__ = ["apply_ep", "apply_expert_fsdp", "all_to_all", "dispatcher", "is_grouped_experts", "to_host"]


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
    """The two hooks of one GroupedExperts module; `state` carries the splits from dispatch to combine.

    Over the ep group (this rank's tp index; None with mesh.ep=1) the rows go to the ranks owning their experts;
    under tensor parallel (`tp_group`, set by parallel.tp) each tp rank dispatches only its own tokens (the block's
    input is sharded over tp) and the rows received by the tp ranks of one ep rank are gathered among them, since
    each holds a hidden slice of the same experts; the partial outputs are reduce-scattered back (Megatron's
    all-to-all + tp all-gather / reduce-scatter + all-to-all)."""

    def __init__(self) -> None:
        self.group, self.ep = None, 1
        self.tp_group, self.tp = None, 1
        self.state: tuple | None = None

    def dispatch(self, module: nn.Module, args: tuple) -> tuple:
        """(x grouped by expert, counts per expert on x's device) -> (the rows of this rank's experts grouped by
        local expert, their counts on the device, the same on the host). The counts travel on x's device (the
        groups' own backend), and are read on the host once, in one piece."""
        x, counts = args[:2]
        ep, tp = self.ep, self.tp
        n_local = counts.shape[0] // ep
        send_counts = counts.view(ep, n_local)
        recv_counts = send_counts
        if ep > 1:
            recv_counts = torch.empty_like(send_counts)
            dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # [source rank, local expert]
        gathered = recv_counts.unsqueeze(0)  # [tp rank, ep source rank, local expert]
        if tp > 1:
            gathered = recv_counts.new_empty(tp * ep * n_local)  # flat: gloo wants the input's shape, tp times
            dist.all_gather_into_tensor(gathered, recv_counts.flatten(), group=self.tp_group)
            gathered = gathered.view(tp, ep, n_local)
        host = to_host(torch.cat([send_counts.sum(1), gathered.flatten()]))
        send, rows = host[:ep], host[ep:]
        by_rank = [sum(rows[i * n_local : (i + 1) * n_local]) for i in range(tp * ep)]  # rows per (tp, ep source)
        tp_rows = [sum(by_rank[t * ep : (t + 1) * ep]) for t in range(tp)]
        recv = by_rank[self._tp_rank() * ep : (self._tp_rank() + 1) * ep]
        local_host = [sum(rows[i::n_local]) for i in range(n_local)]
        if ep > 1:
            x = all_to_all(x, out_splits=recv, in_splits=send, group=self.group)
        if tp > 1:  # every tp rank's rows, each rank's block after the other's (an all-gather with uneven sizes)
            x = all_to_all(x.repeat(tp, 1), out_splits=tp_rows, in_splits=[x.shape[0]] * tp, group=self.tp_group)
        # Received rows are ordered by (tp rank, source rank, local expert): regroup them by local expert.
        expert = torch.arange(n_local, device=x.device).repeat(tp * ep)
        expert = torch.repeat_interleave(expert, gathered.flatten(), output_size=sum(tp_rows))
        perm = expert.argsort(stable=True)
        self.state = (perm, send, recv, tp_rows)
        return x.index_select(0, perm), gathered.sum((0, 1)), local_host

    def combine(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        perm, send, recv, tp_rows = self.state
        self.state = None
        inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
        back = out.index_select(0, inverse)
        if self.tp > 1:  # each tp rank's rows, summed over the hidden slices (a reduce-scatter with uneven sizes)
            mine = tp_rows[self._tp_rank()]
            back = all_to_all(back, out_splits=[mine] * self.tp, in_splits=tp_rows, group=self.tp_group)
            back = back.view(self.tp, mine, -1).sum(0)
        if self.ep > 1:
            back = all_to_all(back, out_splits=send, in_splits=recv, group=self.group)
        return back

    def _tp_rank(self) -> int:
        return dist.get_rank(self.tp_group) if self.tp > 1 else 0


def dispatcher(module: nn.Module) -> _Dispatcher:
    """`module`'s dispatcher (GroupedExperts), made and hooked on first use: parallel.tp sets its tp group,
    `apply_ep` its ep group, whichever runs first installs the hooks."""
    found = module.__dict__.get("_dispatcher")
    if found is None:
        found = module.__dict__["_dispatcher"] = _Dispatcher()
        module.register_forward_pre_hook(found.dispatch)
        module.register_forward_hook(found.combine, prepend=True)
    return found


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Shards every GroupedExperts module's weights over `ep_mesh` by whole experts (dim 0) and sets the ep group of
    its dispatcher (the all-to-alls around its forward). `ep_mesh` is the ep axis, or (ep, tp) after tensor
    parallel (whose hidden-dim split, a 1-D DTensor on the tp axis, is kept on the second axis). Runs on the
    meta-device model."""
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
        hooks = dispatcher(module)
        hooks.group, hooks.ep = ep_mesh.get_group(0), ep


def apply_expert_fsdp(
    model: nn.Module,
    edp_mesh: DeviceMesh,
    *,
    dp: int,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy | None = None,
) -> set[nn.Parameter]:
    """FSDP2 over the expert-data-parallel axis for every GroupedExperts module (before the blocks are
    wrapped, so the block's FSDP leaves these weights alone); HSDP when `edp_mesh` is 2-D (dp_replicate, edp).
    Their gradients are reduced over `edp_mesh` only and divided by the whole data-parallel degree `dp` (dp * cp
    with context parallel: each expert's gradient already sums the tokens of the ep ranks it serves), which gives
    the same mean over the global batch as the dense weights.

    On one edp rank without a compute dtype (ep = dp_shard, fp32) FSDP would have nothing to shard, gather,
    reduce or cast: the experts get no FSDP unit (its hooks and DTensor wrapping cost every layer forward and
    backward), only the division by `dp` on their gradients (Megatron-Core's expert gradient scaling). Returns
    the expert weights left so, which the blocks' FSDP must ignore (`apply_fsdp(ignored_params=...)`)."""
    mp = mp_policy or MixedPrecisionPolicy()
    unwrapped: set[nn.Parameter] = set()
    for module in model.modules():
        if not is_grouped_experts(module):
            continue
        if edp_mesh.size() == 1 and mp.param_dtype is None:
            module.register_forward_pre_hook(_GradDivider(dp))
            unwrapped.update(module.parameters(recurse=False))
            continue
        fully_shard(module, mesh=edp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
        module.set_gradient_divide_factor(float(dp))
        # SUM, then / dp (gloo has no PREMUL_SUM). Not on one edp rank (also under HSDP): torch 2.13's FSDP then
        # divides its local copy by the factor and post-divides once more (grads / dp^2; tests/multiproc/test_moe_ep.py).
        if edp_mesh.size(-1) > 1:
            module.set_force_sum_reduction_for_comms(True)
    return unwrapped


class _GradDivider:
    """Forward pre-hook of a GroupedExperts module left without FSDP: every backward's gradient of its weights / dp
    (microbatches accumulate the same mean as FSDP's). A hook on each weight the forward uses, put there once: the
    weights are replaced after `parallelize` (`to_empty` off the meta device), so it cannot be put there earlier."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def __call__(self, module: nn.Module, args: tuple) -> None:
        for param in module.parameters(recurse=False):
            if not getattr(param, "_grad_divided_by_dp", False):
                param.register_hook(self._divide)
                param._grad_divided_by_dp = True

    def _divide(self, grad: torch.Tensor) -> torch.Tensor:
        return grad / self.dp
