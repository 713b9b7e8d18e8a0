"""Tensor parallelism (with sequence parallelism and loss parallelism) for the Llama-style model, MoE blocks included."""

from __future__ import annotations

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

from parallel.ep import dispatcher, is_grouped_experts

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
            _shard_routed_experts(block.feed_forward, tp_mesh)


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
    """The MoE block under tp: its tokens sharded over tp along the sequence (with sequence parallelism they already
    are; without, each rank takes its chunk of the replicated input and the output is all-gathered), so every tp
    rank routes and dispatches only its own tokens (Megatron's sequence-parallel MoE; `_shard_routed_experts`).
    The router's gate is replicated with its gradient summed over tp (SequenceParallel: each rank's gradient
    covers its tokens only). The shared experts are split like the dense FFN under sequence parallelism: w1/w3
    column-wise after an all-gather of the tokens, w2 row-wise with a reduce-scatter back to this rank's tokens.
    """
    plan: dict[str, object] = {
        "feed_forward": PrepareModuleInputOutput(
            input_layouts=(seq,),
            desired_input_layouts=(Shard(1),),
            use_local_input=True,
            output_layouts=(Shard(1),),
            desired_output_layouts=(seq,),
            use_local_output=True,
        ),
        "feed_forward.router.gate": SequenceParallel(sequence_dim=0, use_local_output=True),
    }
    if getattr(moe, "shared", None) is not None:  # called on the block's tokens flattened: (tokens, dim)
        plan |= {
            "feed_forward.shared": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
            "feed_forward.shared.w1": ColwiseParallel(),
            "feed_forward.shared.w2": RowwiseParallel(output_layouts=Shard(0)),
            "feed_forward.shared.w3": ColwiseParallel(),
        }
    return plan


def _shard_routed_experts(moe: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Splits the routed experts' weights over tp along their hidden dim (EXPERT_TP_DIMS) and sets the tp group of
    their dispatcher (parallel.ep): the rows each tp rank routes are gathered over tp before the experts (each rank
    computes its hidden slice of every row) and the partial outputs reduce-scattered after, each rank getting its
    own rows' sums. The balance loss counts its experts over the tp ranks (whole sequences) and its gradient, summed
    over them with the router's, is divided by tp (`token_shards`)."""
    experts = moe.experts
    for name, dim in EXPERT_TP_DIMS.items():
        param = getattr(experts, name)
        sharded = distribute_tensor(param.data, tp_mesh, [Shard(dim)], src_data_rank=None)
        experts.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
    hooks = dispatcher(experts)
    hooks.tp_group, hooks.tp = tp_mesh.get_group(), tp_mesh.size()
    moe.seq_groups = (*moe.seq_groups, tp_mesh.get_group())
    moe.token_shards = tp_mesh.size()
