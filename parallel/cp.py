"""Context parallelism: the sequence split over the cp axis in zig-zag chunks, and causal attention over it
by all-gathered K/V (`mesh.cp_impl=allgather`) or by K/V blocks rotated around a ring (`ring`).

Built on torch.distributed primitives (torch's `context_parallel` has sharding handlers only for the CUDA SDPA
kernels: on CPU it raises NotImplementedError for `_scaled_dot_product_flash_attention_for_cpu`), so it runs on
gloo/CPU and CUDA alike. Layout: the sequence is cut into 2*cp chunks and cp
rank i holds chunks i and 2cp-1-i (Llama 3 §3.3.2 / zig-zag ring attention): under a causal mask an
early chunk is cheap and a late one dear, so every rank gets the same work. Each rank runs the whole
model on its 2 chunks; only attention looks across ranks. RoPE uses the chunks' global positions
(`Transformer.rope_positions`), the data loader hands each rank its chunks' tokens
(`seq_positions`), and each rank's mean loss covers equally many tokens, so the mean over cp ranks
(FSDP's gradient average over dp_shard*cp, the trainer's loss all-reduce) is the global mean.

- allgather: K and V (before the GQA repeat, so n_kv_heads cross the wire) are all-gathered over cp
  and each query chunk attends to the chunks up to its own (a lower-right causal SDPA: no mask on CUDA);
  backward reduce-scatters the K/V gradients. One collective each way per layer; per rank the same
  2 causal + 2cp-1 full chunk blocks as the ring.
- ring: cp steps; at step s a rank holds the K/V of rank (r - s) mod cp and passes it on to r + 1
  (batch_isend_irecv, whose backward passes the gradient the other way). A (query chunk, key chunk)
  block is full when the key chunk is earlier, causal on the diagonal and skipped when later; the
  partial softmaxes are merged with their log-sum-exp. Per rank: 2 causal + 2cp-1 full blocks. Each block runs a
  fused kernel that returns its log-sum-exp (`ring_kernel`: flash on CPU; on CUDA flash in bf16/fp16, the
  memory-efficient kernel in fp32), so a layer holds O(seq/cp) for backward, no block's score matrix.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from parallel.config import CP_IMPLS, ring_kernel

__all__ = [
    "CP_IMPLS",
    "RING_KERNELS",
    "zigzag_positions",
    "ring_blocks",
    "block_forward",
    "block_backward",
    "ContextParallelAttention",
    "apply_cp",
]


def zigzag_positions(seq_len: int, *, cp: int, cp_rank: int) -> torch.Tensor:
    """Global token positions held by `cp_rank`: chunk cp_rank then chunk 2cp-1-cp_rank of 2cp equal chunks."""
    assert seq_len % (2 * cp) == 0, (seq_len, cp)
    c = seq_len // (2 * cp)
    first, second = cp_rank, 2 * cp - 1 - cp_rank
    return torch.cat([torch.arange(first * c, (first + 1) * c), torch.arange(second * c, (second + 1) * c)])


def _chunks(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def ring_blocks(cp: int, cp_rank: int) -> list[tuple[int, int, int, str]]:
    """The ring's attention blocks on `cp_rank`: (step, query chunk, key chunk, "full" | "causal"); skipped
    blocks (key chunk after query chunk) are absent. A pure function: the ring runs exactly this list."""
    out = []
    for step in range(cp):
        src = (cp_rank - step) % cp
        for qc in _chunks(cp_rank, cp):
            for kc in _chunks(src, cp):
                if kc < qc:
                    out.append((step, qc, kc, "full"))
                elif kc == qc:
                    out.append((step, qc, kc, "causal"))
    return out


class _AllGatherSeq(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward reduce-scatters (sums) the gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = dist.get_world_size(ctx.group)
        out = grad.new_empty((grad.shape[0] // n, *grad.shape[1:]))
        dist.reduce_scatter_single(out, grad.contiguous(), group=ctx.group)
        return out, None


class _RingShift(torch.autograd.Function):
    """Sends x to the next cp rank and returns the previous one's; backward sends the gradient back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup, nxt: int, prv: int) -> torch.Tensor:
        ctx.group, ctx.nxt, ctx.prv = group, nxt, prv
        return _exchange(x, to=nxt, frm=prv, group=group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, to=ctx.prv, frm=ctx.nxt, group=ctx.group), None, None, None


def _exchange(x: torch.Tensor, *, to: int, frm: int, group: dist.ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    buf = torch.empty_like(x)
    ops = [dist.P2POp(dist.isend, x, to, group), dist.P2POp(dist.irecv, buf, frm, group)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return buf


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's softmax attention and its log-sum-exp: q (b, h, s, d), k/v (b, h, t, d) -> (b, h, s, d), (b, h, s, 1)."""
    scores = (q.float() @ k.float().transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    return torch.exp(scores - lse) @ v.float(), lse


def _merge(acc: tuple[torch.Tensor, torch.Tensor] | None, part: tuple[torch.Tensor, torch.Tensor]):
    """Two partial softmax attentions over disjoint keys merged into one, exactly (log-sum-exp weights)."""
    if acc is None:
        return part
    (o1, l1), (o2, l2) = acc, part
    lse = torch.logaddexp(l1, l2)
    return o1 * torch.exp(l1 - lse) + o2 * torch.exp(l2 - lse), lse


_aten = torch.ops.aten
# Per-block kernels that return the block's log-sum-exp (what the ring merges by), with their backward ops, by the name
# `ring_kernel` picks (parallel/config.py, torch-free: the planner's notes use it). The CUDA pair is what torch's own
# ring attention calls (torch/distributed/tensor/experimental/_context_parallel/_attention.py).
RING_KERNELS = {
    "flash_cpu": (
        _aten._scaled_dot_product_flash_attention_for_cpu,
        _aten._scaled_dot_product_flash_attention_for_cpu_backward,
    ),
    "flash": (_aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_flash_attention_backward),
    "efficient": (
        _aten._scaled_dot_product_efficient_attention,
        _aten._scaled_dot_product_efficient_attention_backward,
    ),
}


def block_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    """One block through `kernel`: (out (b, h, c, d), log-sum-exp (b, h, c) fp32, what its backward op needs)."""
    op = RING_KERNELS[kernel][0]
    if kernel == "flash_cpu":
        out, lse = op(q, k, v, 0.0, causal)
        return out, lse, ()
    if kernel == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = op(q, k, v, 0.0, causal)
        return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse, seed, offset = op(q, k, v, None, True, 0.0, causal)  # compute_log_sumexp=True
    return out, lse[..., : q.shape[2]], (seed, offset, lse.shape[-1])  # its lse is padded to a multiple of 32 rows


def block_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, saved: tuple):
    """(dq, dk, dv) of one block, given the merged output and log-sum-exp (exact: the softmax's gradient needs only
    the final row statistics) and `saved`, what `block_forward` returned for its backward op (dropout is 0)."""
    op = RING_KERNELS[kernel][1]
    if kernel == "flash_cpu":
        return op(dout, q, k, v, out, lse, 0.0, causal)
    if kernel == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        return op(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset)
    seed, offset, padded = saved
    lse = F.pad(lse, (0, padded - lse.shape[-1]))
    return op(dout, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal)[:3]


class _FusedRing(torch.autograd.Function):
    """The ring with a fused kernel per block that returns the block's log-sum-exp (`kernel`, a key of RING_KERNELS:
    flash on CPU; flash or memory-efficient on CUDA). These kernels do not differentiate through the log-sum-exp, so
    the ring's backward is written out: forward merges the blocks; backward runs each block's backward op against
    the merged output and log-sum-exp, K/V travelling the ring again with their gradient accumulator, which one last
    hop brings home. Held for backward: q, k, v, the output and the log-sum-exp, O(seq/cp) per layer, no block's
    score matrix. q (b, h, 2c, d), k/v (b, kv_heads, 2c, d)."""

    @staticmethod
    def forward(ctx, q, k, v, attn: ContextParallelAttention, kernel: str) -> torch.Tensor:
        rep, mine, qs = q.shape[1] // k.shape[1], _chunks(attn.rank, attn.cp), q.chunk(2, dim=2)
        acc: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {c: None for c in mine}
        kv, saved = torch.stack([k, v]), ()
        for step, blocks in attn.ring_steps(count=True):
            if step:
                kv = _exchange(kv, to=attn.nxt, frm=attn.prv, group=attn.group)
            src = _chunks((attn.rank - step) % attn.cp, attn.cp)
            for qc, kc, kind in blocks:
                i, j = mine.index(qc), src.index(kc)
                kb, vb = (t.chunk(2, dim=2)[j].repeat_interleave(rep, dim=1).contiguous() for t in (kv[0], kv[1]))
                o, lse, saved = block_forward(kernel, qs[i].contiguous(), kb, vb, kind == "causal")
                acc[qc] = _merge(acc[qc], (o.float(), lse.float().unsqueeze(-1)))
        out = torch.cat([acc[c][0] for c in mine], dim=2).to(q.dtype)
        lse = torch.cat([acc[c][1] for c in mine], dim=2).squeeze(-1).contiguous()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.attn, ctx.kernel, ctx.block_saved = attn, kernel, saved  # every block is (c x c): one `saved` serves all
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        attn = ctx.attn
        rep, mine = q.shape[1] // k.shape[1], _chunks(attn.rank, attn.cp)
        qs, outs, douts, lses = ([c.contiguous() for c in t.chunk(2, dim=2)] for t in (q, out, dout, lse))
        dq = [torch.zeros_like(c, dtype=torch.float32) for c in qs]
        kv = torch.stack([k, v])
        kv = torch.cat([kv, torch.zeros_like(kv)])  # K, V, dK, dV: the gradients travel with their K/V
        for step, blocks in attn.ring_steps():
            if step:
                kv = _exchange(kv, to=attn.nxt, frm=attn.prv, group=attn.group)
            src = _chunks((attn.rank - step) % attn.cp, attn.cp)
            for qc, kc, kind in blocks:
                i, j = mine.index(qc), src.index(kc)
                kb, vb = (t.chunk(2, dim=2)[j].repeat_interleave(rep, dim=1).contiguous() for t in (kv[0], kv[1]))
                g = block_backward(
                    ctx.kernel, douts[i], qs[i], kb, vb, outs[i], lses[i], kind == "causal", ctx.block_saved
                )
                dq[i] += g[0].float()
                for t, d in ((2, g[1]), (3, g[2])):  # the GQA repeat's gradient: a sum over each group's heads
                    kv[t].chunk(2, dim=2)[j].add_(d.unflatten(1, (-1, rep)).sum(2).to(kv.dtype))
        dkv = kv[2:] if attn.cp == 1 else _exchange(kv[2:], to=attn.nxt, frm=attn.prv, group=attn.group)
        return torch.cat(dq, dim=2).to(q.dtype), dkv[0], dkv[1], None, None


class ContextParallelAttention:
    """Causal attention over the cp axis for one attention layer: (q, k, v) of this rank's two chunks,
    (batch, seq/cp, heads, head_dim) (k/v with n_kv_heads) -> (batch, seq/cp, heads, head_dim).
    `blocks` counts the attention blocks this rank computed ("full", "causal"), for tests and benchmarks."""

    def __init__(self, cp_mesh: DeviceMesh, *, impl: str, seq_len: int = 0) -> None:
        if impl not in CP_IMPLS:
            raise ValueError(f"mesh.cp_impl={impl!r} is not one of {', '.join(CP_IMPLS)}")
        self.impl, self.group = impl, cp_mesh.get_group()
        self.cp, self.rank = cp_mesh.size(), cp_mesh.get_local_rank()
        ranks = dist.get_process_group_ranks(self.group)
        self.nxt, self.prv = ranks[(self.rank + 1) % self.cp], ranks[(self.rank - 1) % self.cp]
        self.blocks: Counter[str] = Counter()
        self.fused = True  # a fused kernel per block where one runs (`kernel`, _FusedRing); False: _ring_autograd
        # The all-gather's causal biases by (query, key) length, made before any forward (a CausalBias is a tensor
        # subclass: made under a dispatch mode, e.g. a test's counter, it fails); a `seq_len`-token sample's here.
        self.biases: dict[tuple[int, int], object] = {}
        for qc in _chunks(self.rank, self.cp) if seq_len else ():
            self._bias(seq_len // (2 * self.cp), (qc + 1) * seq_len // (2 * self.cp))

    def _bias(self, c: int, t: int):
        """The lower-right causal bias of c queries over t keys (each query sees the keys up to its own position)."""
        if (c, t) not in self.biases:
            # lazy: torch.nn.attention.bias imports torch._dynamo (~0.6 s, and torch._inductor), which a rank
            # without context parallel never needs; it dispatches no op, so it may come under any dispatch mode
            from torch.nn.attention.bias import causal_lower_right

            self.biases[c, t] = causal_lower_right(c, t)
        return self.biases[c, t]

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self._allgather(q, k, v) if self.impl == "allgather" else self._ring(q, k, v)
        return out.type_as(q)

    def _allgather(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """K/V all-gathered over cp and put in sequence order (chunk g is rank g's first chunk for g < cp, else rank
        2cp-1-g's second); each of this rank's query chunks qc attends to chunks 0..qc, causal on its own: one SDPA
        with a lower-right causal bias (flash / memory-efficient kernels on CUDA; no mask is built there, and the
        causal structure costs no host work: it follows from the chunk layout)."""
        c = q.shape[1] // 2
        kv = torch.stack([k, v]).transpose(0, 2)  # (seq, b, 2, kv_heads, d): gathered along seq
        per_rank = _AllGatherSeq.apply(kv, self.group).unflatten(0, (self.cp, 2, c))
        ordered = torch.cat([per_rank[:, 0], per_rank.flip(0)[:, 1]]).flatten(0, 1)  # (2cp * c, b, 2, kv_heads, d)
        rep = q.shape[2] // k.shape[2]
        outs = []
        for i, qc in enumerate(_chunks(self.rank, self.cp)):
            keys = ordered[: (qc + 1) * c].permute(2, 1, 3, 0, 4)  # (2, b, kv_heads, (qc+1) c, d)
            kf, vf = (t.repeat_interleave(rep, dim=1) for t in (keys[0], keys[1]))
            qi = q[:, i * c : (i + 1) * c].transpose(1, 2)
            outs.append(F.scaled_dot_product_attention(qi, kf, vf, attn_mask=self._bias(c, kf.shape[2])))
            self.blocks["full"] += qc
            self.blocks["causal"] += 1
        return torch.cat(outs, dim=2).transpose(1, 2)

    def ring_steps(self, *, count: bool = False) -> list[tuple[int, list[tuple[int, int, str]]]]:
        """`ring_blocks` grouped by step, (step, [(query chunk, key chunk, kind)]); `count`: adds them to `blocks`."""
        plan = ring_blocks(self.cp, self.rank)
        for *_, kind in plan if count else ():
            self.blocks[kind] += 1
        return [(s, [(q, k, kind) for t, q, k, kind in plan if t == s]) for s in range(self.cp)]

    def kernel(self, q: torch.Tensor) -> str:
        """The per-block kernel the ring runs for queries like `q` (`ring_kernel`; "unfused" with `fused` off)."""
        if not self.fused:
            return "unfused"
        cap = torch.cuda.get_device_capability(q.device) if q.device.type == "cuda" else (0, 0)
        return ring_kernel(q.device.type, str(q.dtype).removeprefix("torch."), q.shape[-1], capability=cap)

    def _ring(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kernel = self.kernel(q)
        if kernel == "unfused":
            return self._ring_autograd(q, k, v)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        return _FusedRing.apply(qt, kt, vt, self, kernel).transpose(1, 2)

    def _ring_autograd(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The ring from differentiable pieces (any device): autograd runs its backward through _RingShift."""
        rep = q.shape[2] // k.shape[2]
        qs = q.transpose(1, 2).chunk(2, dim=2)  # the two query chunks, (b, h, c, d) each
        mine = _chunks(self.rank, self.cp)
        kv = torch.stack([k, v])  # one tensor per hop: K and V travel (and their gradients return) together
        acc: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {c: None for c in mine}
        plan = ring_blocks(self.cp, self.rank)
        for step in range(self.cp):
            if step:
                kv = _RingShift.apply(kv, self.group, self.nxt, self.prv)
            src = _chunks((self.rank - step) % self.cp, self.cp)
            ks, vs = (t.repeat_interleave(rep, dim=2).transpose(1, 2).chunk(2, dim=2) for t in (kv[0], kv[1]))
            for s, qc, kc, kind in plan:
                if s != step:
                    continue
                i, j = mine.index(qc), src.index(kc)
                acc[qc] = _merge(acc[qc], _block(qs[i], ks[j], vs[j], causal=kind == "causal"))
                self.blocks[kind] += 1
        out = torch.cat([acc[c][0] for c in mine], dim=2)
        return out.transpose(1, 2)


def apply_cp(model: nn.Module, cp_mesh: DeviceMesh, *, impl: str, seq_len: int) -> None:
    """Makes `model` (or a pipeline stage of it) a cp rank's model: every attention layer attends over the
    cp axis and RoPE uses this rank's zig-zag positions of a `seq_len`-token sample; an MoE block's sequence-wise
    balance loss sums its expert counts over the cp axis (`seq_groups`). No parameters change."""
    model.rope_positions = zigzag_positions(seq_len, cp=cp_mesh.size(), cp_rank=cp_mesh.get_local_rank())
    for block in model.layers.values():
        block.attention.context_parallel = ContextParallelAttention(cp_mesh, impl=impl, seq_len=seq_len)
        moe = block.feed_forward
        if hasattr(moe, "seq_groups"):  # an MoE block: its balance loss counts whole sequences
            moe.seq_groups = (*moe.seq_groups, cp_mesh.get_group())
