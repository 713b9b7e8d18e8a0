"""Tensor parallelism (with sequence parallelism and loss parallelism) for the Llama-style model, MoE blocks included."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from parallel.ep import is_grouped_experts

__all__ = ["apply_tp", "EXPERT_TP_DIMS"]

# The routed experts' weights split over tp along their hidden dim (etp = tp, parallel.dims.fold_moe_mesh):
# w1, w3 (experts, dim, hidden) column-wise, w2 (experts, hidden, dim) row-wise.
EXPERT_TP_DIMS = {"w1": 2, "w3": 2, "w2": 1}


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool, loss_parallel: bool) -> None:
    """Shards attention heads and the MLP hidden dim over `tp_mesh` (Megatron column -> row pattern).

    Per block: wq/wk/wv and w1/w3 are column-parallel, wo and w2 row-parallel, so each sub-layer
    costs one all-reduce forward (or, with sequence parallelism, one all-gather before and one
    reduce-scatter after, with norms and residuals sharded along the sequence). The output head
    is column-parallel; with loss parallelism its logits stay sharded over the vocabulary and the
    cross-entropy runs on the shards (`torch.distributed.tensor.parallel.loss_parallel`).
    An MoE block's FFN is split as `_moe_plan` says. Works on a pipeline stage: modules the stage
    does not own are skipped.
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, object] = {}
    if getattr(model, "tok_embeddings", None) is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if getattr(model, "norm", None) is not None and sequence_parallel:
        top["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        top["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        )
    if top:
        parallelize_module(model, tp_mesh, top)

    for block in model.layers.values():
        moe = _is_moe(block.feed_forward)
        plan: dict[str, object] = {
            "attention": PrepareModuleInput(input_layouts=(seq, None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            **(_moe_plan(block.feed_forward, seq) if moe else _ffn_plan(seq)),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)
        if moe:
            _shard_routed_experts(block.feed_forward.experts, tp_mesh)


def _ffn_plan(seq) -> dict[str, object]:
    return {
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        "feed_forward.w3": ColwiseParallel(),
    }


def _is_moe(ffn: nn.Module) -> bool:
    """An MoE block's FFN (jobs.models.moe.MoE: router, routed experts, shared experts; parallel/ never imports jobs/)."""
    experts = getattr(ffn, "experts", None)
    return experts is not None and is_grouped_experts(experts)


def _moe_plan(moe: nn.Module, seq) -> dict[str, object]:
    """The MoE block under tp (its experts tensor-parallel over the attention's tp ranks, etp = tp).

    Its tokens are whole on every tp rank (with sequence parallelism all-gathered at its input, and its output,
    whole too, cut back to this rank's chunk: its gradient is all-gathered), so the router runs replicated: the
    same input, choices and gradient on every tp rank. The shared experts are split like the dense FFN (w1/w3
    column-wise, w2 row-wise: one all-reduce forward, one backward), the routed experts by
    `_shard_routed_experts` (one all-reduce forward, one backward). Sequence parallel adds one all-gather each
    way; the experts' gradients need no tp collective (each rank's hidden slice is its own).
    """
    plan: dict[str, object] = {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(seq,),
            desired_input_layouts=(Replicate(),),
            use_local_input=True,
            output_layouts=(Replicate(),),
            desired_output_layouts=(seq,),
            use_local_output=True,
        ),
    }
    if getattr(moe, "shared", None) is not None:
        plan |= {
            "feed_forward.shared": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
            ),
            "feed_forward.shared.w1": ColwiseParallel(),
            "feed_forward.shared.w2": RowwiseParallel(),  # Replicate: added to the routed output of the same tokens
            "feed_forward.shared.w3": ColwiseParallel(),
        }
    return plan


class _CopyToTp(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over tp (each rank's hidden slice gave a partial one)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTp(torch.autograd.Function):
    """Sums the partial outputs over tp; the backward passes the (replicated) gradient through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _shard_routed_experts(experts: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Splits the routed experts' weights over tp along their hidden dim (EXPERT_TP_DIMS), so each tp rank's
    grouped SwiGLU gives a partial output for every row, and sums those rows over tp before the router's gate
    weights multiply them: the router's gradient is then the same on every tp rank (no all-reduce of it).
    Hooks on the experts' forward: the rows' gradient is summed over tp (backward all-reduce), the rows'
    outputs are (forward all-reduce). parallel.ep's dispatch/combine go inside these two (the all-reduces
    run on the rows in token order, which every tp rank of an ep group holds alike)."""
    for name, dim in EXPERT_TP_DIMS.items():
        param = getattr(experts, name)
        sharded = distribute_tensor(param.data, tp_mesh, [Shard(dim)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    group = tp_mesh.get_group()
    experts.register_forward_pre_hook(lambda _m, args: (_CopyToTp.apply(args[0], group), *args[1:]))
    experts.register_forward_hook(lambda _m, _args, out: _ReduceFromTp.apply(out, group))
