"""The riskiest parts of the CUDA path, each in its own process, one JSON line per check: `scripts/gpu_check --preflight`.

Run first on a machine that never ran meshjob (under two minutes on one GPU), so that what would break the
full check shows up before it spends its window: this torch's API gaps, disk write speed, strict determinism
with bf16 autocast + full activation checkpointing + fused AdamW run twice bitwise, a one-rank
`cuda:nccl,cpu:gloo` world with the 5-axis mesh, its timeouts read back, FSDP2 in bf16 and a flight-recorder
dump, the straggler clock (profiled compute kernels, NCCL's apart), the achieved rate of Llama 3 405B's matmuls
and attention as one tp8 rank runs them (against the planner's 0.80 of peak), `model.norm_kernel=fused` running
torch's fused RMSNorm kernel, then the real trainer saving and resuming bitwise. A check runs as `python scripts/gpu_preflight.py
CHECK --device D --out DIR` and prints one JSON object as its last line; `run_preflight` runs them all.
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Model widths of the full check's 1B model on CUDA, two layers (the kernels it runs; fits any GPU); tiny on CPU.
WIDE = ["model.dim=2048", "model.n_heads=16", "model.n_kv_heads=8", "model.ffn_dim=8192", "model.vocab_size=32000"]
CHECKS = ("torch", "disk", "kernels", "world", "stragglers", "cp_ring", "gemms", "norm_kernel", "trainer")


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> dotted torch path, from `import torch...` and `from torch... import x` lines."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    out[a.asname or a.name.split(".")[0]] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def _resolve(dotted: str) -> bool:
    """Whether `dotted` (a module, or attributes of one) exists in this torch."""
    parts = dotted.split(".")
    obj, i = None, len(parts)
    while i > 0:  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            i -= 1
    if obj is None:
        return False
    for name in parts[i:]:
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def torch_api_gaps() -> list[str]:
    """Every torch name the project's packages import or reach by attribute that this torch lacks."""
    used: dict[str, str] = {}
    for pkg in ("jobs", "parallel", "checkpoint"):
        for path in sorted((REPO / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text())
            names = _aliases(tree)
            for node in ast.walk(tree):
                chain, cur = [], node
                while isinstance(cur, ast.Attribute):
                    chain.append(cur.attr)
                    cur = cur.value
                if isinstance(cur, ast.Name) and cur.id in names and (chain or node is cur):
                    dotted = ".".join([names[cur.id], *reversed(chain)])
                    used.setdefault(dotted, f"{path.relative_to(REPO)}:{node.lineno}")
    gaps, seen_missing = [], set()
    for dotted in sorted(used):
        if any(dotted.startswith(m + ".") for m in seen_missing):
            continue
        if not _resolve(dotted):
            seen_missing.add(dotted)
            gaps.append(f"{dotted} ({used[dotted]})")
    return gaps


def _shape(device: str, *, layers: int) -> tuple[list[str], int]:
    """Model overrides and the sequence length for `device`: the 1B model's widths on CUDA, tiny on CPU."""
    if device == "cuda":
        return ["model=tiny", *WIDE, f"model.n_layers={layers}", "model.max_seq_len=2048"], 2048
    return ["model=tiny", "model.max_seq_len=64"], 64


def check_torch(device: str, out: Path) -> dict:
    """Versions, the GPU torch sees, and every torch API the project uses that this torch lacks."""
    import torch

    gaps = torch_api_gaps()
    res = {
        "ok": not gaps,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpus": torch.cuda.device_count(),
        "python": sys.version.split()[0],
        "venv": sys.prefix != sys.base_prefix,
        "gaps": gaps,
    }
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        res.update(gpu=p.name, mem_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}")
    return res


def check_disk(device: str, out: Path) -> dict:
    """Write + fsync speed where checkpoints go (a 1B checkpoint is 13.7 GB: 12 bytes per parameter)."""
    size = (1 << 30) if device == "cuda" else (64 << 20)
    path = out / "disk-probe.bin"
    block = os.urandom(16 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(size // len(block)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    secs = time.perf_counter() - t0
    path.unlink()
    free = shutil.disk_usage(out).free
    gbps = size / secs / 1e9
    return {
        "ok": free > 3 * 13.7e9 if device == "cuda" else True,
        "write_GBps": round(gbps, 3),
        "free_GB": round(free / 1e9, 1),
        "est_1b_checkpoint_s": round(13.7 / gbps, 1),
        "dir": str(out),
    }


def check_kernels(device: str, out: Path) -> dict:
    """Two identical runs of two training steps under train.deterministic's settings (jobs.device.set_determinism):
    bf16 autocast, full activation checkpointing, GQA attention, fused AdamW on CUDA; bitwise equal or not."""
    import torch

    from jobs.config import compose
    from jobs.device import set_determinism
    from jobs.models.model import Transformer, init_weights
    from parallel.ac import apply_ac
    from parallel.precision import apply_autocast

    if device == "cuda":
        torch.cuda.set_device(0)
    set_determinism(True, device_type=device)
    overrides, seq = _shape(device, layers=2)
    m = compose(overrides).model
    runs, secs = [], []
    for _ in range(2):
        with torch.device("meta"):
            model = Transformer(m)
        apply_ac(model, mode="full", every=1)
        apply_autocast(model, device_type=device)
        model.to_empty(device=device)
        init_weights(model, seed=0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device == "cuda")
        tok = torch.randint(0, m.vocab_size, (2, seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
        t0 = time.perf_counter()
        for _ in range(2):
            logits = model(tok[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tok[:, 1:].flatten(0, 1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        secs.append(round(time.perf_counter() - t0, 3))
        runs.append([loss.item(), sum(p.double().sum().item() for p in model.parameters())])
        del model, opt
    res = {
        "ok": runs[0] == runs[1],
        "bitwise": runs[0] == runs[1],
        "loss": runs[0][0],
        "param_sums": [r[1] for r in runs],
        "seconds": secs,
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
        "logits_dtype": str(logits.dtype),
    }
    if device == "cuda":
        res["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return res


def _one_rank_world(device: str) -> None:
    """A one-rank process group on the trainer's backend for `device` (NCCL + gloo on CUDA), GPU 0."""
    import torch
    import torch.distributed as dist

    from jobs.device import backend_for

    if device == "cuda":
        torch.cuda.set_device(0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend_for(device), init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def check_world(device: str, out: Path) -> dict:
    """A one-rank world on the trainer's backend with the 5-axis mesh, float64 and CPU all-reduces, our process
    group timeouts read back, FSDP2 in bf16 forward and backward, and the flight recorder dumped to a file."""
    import pickle

    import torch
    import torch.distributed as dist

    from jobs.config import compose
    from jobs.device import backend_for, dump_flight_recorder, export_environ
    from jobs.failure.timeouts import set_pg_timeouts
    from jobs.models.model import Transformer, init_weights
    from parallel.dims import ParallelDims
    from parallel.fsdp import apply_fsdp
    from parallel.precision import fsdp_policy

    traces = out / "nccl_traces"
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # gloo records too (on CUDA export_environ sets NCCL's)
    export_environ({}, device_type=device, trace_dir=str(traces))
    _one_rank_world(device)
    mesh = ParallelDims(1, 1, 1, 1, 1, 1, 1).build_mesh(device)
    x = torch.ones(3, dtype=torch.float64, device=device)
    dist.all_reduce(x)
    c = torch.ones(1)
    dist.all_reduce(c)  # a CPU tensor: gloo on CUDA ranks
    groups = set_pg_timeouts(42.0)
    res: dict = {"backend": backend_for(device), "mesh": dict(zip(mesh.mesh_dim_names, mesh.shape)), "groups": groups}
    if device == "cuda":
        try:  # a private attribute: its absence is a finding, not a reason to lose the rest
            res["nccl_timeout_s"] = dist.group.WORLD._get_backend(torch.device("cuda")).options._timeout.total_seconds()
        except Exception as e:  # noqa: BLE001
            res["nccl_timeout_error"] = f"{type(e).__name__}: {e}"[:300]
    m = compose(["model=tiny"]).model
    with torch.device("meta"):
        model = Transformer(m)
    apply_fsdp(model, mesh["dp_shard"], reshard_after_forward=True, mp_policy=fsdp_policy("bf16"))
    model.to_empty(device=device)
    init_weights(model, seed=0)
    logits = model(torch.randint(0, m.vocab_size, (2, 32)).to(device))
    logits.float().sum().backward()
    res.update(fsdp_out_dtype=str(logits.dtype), grad_dtype=str(next(model.parameters()).grad.dtype))
    path = dump_flight_recorder(traces, rank=0)
    res["flight_recorder"] = str(path) if path else None
    res["flight_recorder_entries"] = len(pickle.loads(path.read_bytes()).get("entries", [])) if path else 0
    dist.destroy_process_group()
    res["ok"] = (
        x.tolist() == [1.0, 1.0, 1.0]
        and len(res["mesh"]) == 5
        and res.get("nccl_timeout_s", 42.0) == 42.0
        and res["fsdp_out_dtype"] == "torch.bfloat16"
        and res["flight_recorder_entries"] > 0
    )
    return res


def check_stragglers(device: str, out: Path) -> dict:
    """The GPU straggler clock (jobs/telemetry/kernels.py) on a one-rank world: gemms in `forward`, an all-reduce in
    `collective`, three profiled steps; compute kernel seconds per phase (NCCL's apart), what reading the trace
    costs. Not run on CPU, where the profiler records no kernel (tests/unit/test_kernel_clock.py covers its ranges and
    ops there); a CPU-profiler process with a gloo group once aborted here at its end ("terminate called without an
    active exception", 1 run in ~25), cause not found."""
    if device != "cuda":
        return {"ok": True, "skipped": "no kernels on CPU (tests/unit/test_kernel_clock.py covers the CPU profiler)"}
    import torch
    import torch.distributed as dist

    from jobs.telemetry.kernels import KernelSampler

    _one_rank_world(device)
    k = KernelSampler(1)
    a = torch.randn(2048, 2048, device=device)
    names, rows, read_s = ["forward", "collective"], [], []
    for _ in range(3):  # the first start initialises CUPTI
        k.begin()
        with k.range("forward"):
            for _ in range(4):
                a = (a @ a) / 2048**0.5
        with k.range("collective"):
            dist.all_reduce(torch.ones(1 << 22, device=device))
        t0 = time.perf_counter()
        rows.append(dict(zip(names, k.end(names))))
        read_s.append(round(time.perf_counter() - t0, 4))
    dist.destroy_process_group()
    res = {
        "compute_s": rows[-1],
        "nccl_s": k.comm_s,
        "phases_seen": list(k.phases_seen),
        "trace_events": k.trace_events,
        "stop_and_read_s": read_s,
    }
    res["ok"] = res["phases_seen"] == names and rows[-1]["forward"] > 0 and rows[-1]["collective"] == 0
    return res


# The question `gemms` answers (docs/planner.md, held-out validation): the planner runs every matmul FLOP at 0.80 of the
# datasheet peak (the best GEMM shape's rate) and attention at FlashAttention-2's published rate, and predicts
# Llama 3 405B 1.15-1.18x too fast; its tp8 shards (wk/wv n=128, wo k=2048) may run slower, SDPA's backend faster.
# Measured here at the paper's shapes (8,192 tokens per microbatch); on CPU the tiny model at tp 2, which checks
# the mechanics only.
GEMMS_CASE = {"cuda": ("llama3_405b", 8, 8192, "bf16"), "cpu": ("tiny", 2, 64, "fp32")}


def ring_attention_run(*, dtype_name: str, seq: int, fused: bool = True) -> dict:
    """The ring attention (parallel/cp.py) on a one-rank cp group on GPU 0 (the world already made): (1, seq, 8, 64)
    q/k/v in `dtype_name`, forward and backward, against causal SDPA in fp32 (the largest error of the output and the
    three gradients, relative to each one's largest value), the per-block kernel it ran and the peak memory it added over its inputs."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.cp import ContextParallelAttention

    attn = ContextParallelAttention(init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))["cp"], impl="ring")
    attn.fused = fused
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, w = (
        torch.randn(1, seq, 8, 64, device="cuda", generator=g, dtype=getattr(torch, dtype_name)) for _ in range(4)
    )
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref_in), is_causal=True).transpose(1, 2)
    (ref * w.float()).sum().backward()
    for t in (q, k, v):
        t.requires_grad_()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = attn(q, k, v)
    (out * w).sum().backward()
    torch.cuda.synchronize()
    pairs = zip((out, q.grad, k.grad, v.grad), (ref, *(t.grad for t in ref_in)))
    errs = [((a.float() - b).abs().max() / b.abs().max()).item() for a, b in pairs]  # relative to the largest value
    return {
        "kernel": attn.kernel(q),
        "blocks": dict(attn.blocks),
        "max_rel_err": max(errs),
        "input_bytes": q.nbytes,
        "peak_added_bytes": torch.cuda.max_memory_allocated() - base,
    }


def check_cp_ring(device: str, out: Path) -> dict:
    """The ring's per-block CUDA kernels (parallel/cp.py): bf16 runs flash, fp32 the memory-efficient kernel, each
    equal to causal SDPA within its dtype's tolerance, holding O(seq) memory (the unfused ring's fp32 block scores,
    O(seq^2), measured beside it). CPU's flash ring: tests/multiproc/test_context_parallel.py."""
    if device != "cuda":
        return {"ok": True, "skipped": "CUDA kernels only (the CPU ring: tests/multiproc/test_context_parallel.py)"}
    _one_rank_world(device)
    seq = 8192
    runs = {name: ring_attention_run(dtype_name=name, seq=seq) for name in ("bfloat16", "float32")}
    runs["unfused_bfloat16"] = ring_attention_run(dtype_name="bfloat16", seq=seq, fused=False)
    bound = 32 * runs["bfloat16"]["input_bytes"]  # q, k, v, out, their grads and a block's copies: well under it
    ok = (
        runs["bfloat16"]["kernel"] == "flash"
        and runs["float32"]["kernel"] == "efficient"
        and runs["bfloat16"]["max_rel_err"] < 2e-2
        and runs["float32"]["max_rel_err"] < 1e-3
        and runs["bfloat16"]["peak_added_bytes"] < bound < runs["unfused_bfloat16"]["peak_added_bytes"]
    )
    return {"ok": ok, "seq": seq, "bound_bytes": bound, **runs}


def _sig(x: float) -> float:
    """`x` to 4 significant digits (a CPU's TFLOP/s are small, a GPU's large)."""
    return float(f"{x:.4g}")


def _fwd_bwd_seconds(fn, args: tuple, grad, *, sync, seconds: float) -> float:
    """Median seconds of fn(*args)'s forward and its backward to every input (autograd.grad: no accumulation),
    timed as jobs.calibrate times the model."""
    import torch

    from jobs.planner.timing import timed

    return timed(lambda: torch.autograd.grad(fn(*args), args, grad), seconds=seconds, sync=sync)


def _stream_GBps(device: str, *, sync) -> float:
    """Bytes an element-wise op moves per second (`y = x * 2` in bf16 on 1 GiB: read + write), the rate the planner's
    memory-bound ops take from the datasheet (`cluster.gpu_hbm_GBps`); 64 MiB in fp32 on CPU."""
    import torch

    from jobs.planner.timing import timed

    n = (1 << 29) if device == "cuda" else (1 << 24)
    x = torch.ones(n, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    return 2 * x.numel() * x.element_size() / timed(lambda: x * 2, seconds=0.3, sync=sync) / 1e9


def check_gemms(device: str, out: Path) -> dict:
    """One tp rank's matmuls of one microbatch (every distinct nn.Linear shape, forward + both gradients, as
    F.linear runs them) and its causal attention (SDPA, kv heads repeated as jobs/models/model.py does), each timed
    alone: achieved TFLOP/s per shape and over them weighted by FLOPs, against the planner's cited GEMM rate;
    attention's in the planner's count, against `cluster.gpu_attention_tflops`; both over the block (the figure for
    a calibrated `cluster.matmul_tflops[profile_key]`, which holds attention); and an element-wise op's bytes per
    second (`cluster.gpu_hbm_GBps`): the planner's three cited device rates, measured."""
    import torch

    from jobs.config import compose

    model, tp, tokens, dtype_name = GEMMS_CASE[device]
    m = compose([f"model={model}"]).model
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows, flops, secs = _linear_rates(m, tp=tp, tokens=tokens, device=device, dtype=dtype, sync=sync)
    f_att, t_att = _attention_flops_seconds(m, tp=tp, tokens=tokens, device=device, dtype=dtype, sync=sync)
    res = {
        "model": model,
        "tp": tp,
        "tokens": tokens,
        "dtype": dtype_name,
        "profile_key": f"{dtype_name}.tp{tp}",
        "stream_GBps": _sig(_stream_GBps(device, sync=sync)),
        "linears": rows,
        "linear_tflops": _sig(flops / secs / 1e12),
        "attention_tflops": _sig(f_att / t_att / 1e12),
        "block_tflops": _sig((flops + m.n_layers * f_att) / (secs + m.n_layers * t_att) / 1e12),
    }
    if device == "cuda":
        res.update(
            _against_planner(
                linear_tflops=res["linear_tflops"], attention_tflops=res["attention_tflops"], tokens=tokens
            )
        )
    res["ok"] = all(r["tflops"] > 0 for r in rows) and res["attention_tflops"] > 0 and res["stream_GBps"] > 0
    return res


def _linear_rates(m, *, tp: int, tokens: int, device: str, dtype, sync) -> tuple[list[dict], float, float]:
    """(a row per distinct nn.Linear shape of one tp rank with its count and TFLOP/s, forward + both gradients;
    their FLOPs and seconds, each shape times its count)."""
    import torch
    import torch.nn.functional as F

    from jobs.planner.gemm import linear_counts

    rand = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)  # noqa: E731
    rows, flops, secs = [], 0.0, 0.0
    for i, o, count in linear_counts(m, tp=tp):
        grad = torch.randn(tokens, o, device=device, dtype=dtype)
        t = _fwd_bwd_seconds(F.linear, (rand(tokens, i), rand(o, i)), grad, sync=sync, seconds=0.3)
        f = 6.0 * tokens * i * o
        rows.append({"shape": f"{tokens}x{i}@{i}x{o}", "count": count, "tflops": _sig(f / t / 1e12)})
        flops, secs = flops + count * f, secs + count * t
    return rows, flops, secs


def _attention_flops_seconds(m, *, tp: int, tokens: int, device: str, dtype, sync) -> tuple[float, float]:
    """(FLOPs in the planner's count, seconds) of one tp rank's causal attention, forward + backward."""
    import torch
    import torch.nn.functional as F

    hd, heads = m.dim // m.n_heads, m.n_heads // tp
    # the kernel alone, on k/v already repeated to every head (jobs/models/model.py's GQA repeat is a memory-bound op)
    qkv = tuple(torch.randn(1, heads, tokens, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    t_att = _fwd_bwd_seconds(
        lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        qkv,
        torch.randn(1, heads, tokens, hd, device=device, dtype=dtype),
        sync=sync,
        seconds=0.3,
    )
    f_att = 3.0 * tokens * tokens * 2 * heads * hd  # steptime.stage_flops: causal, half of QK^T and PV, x3 for training
    return f_att, t_att


def _against_planner(*, linear_tflops: float, attention_tflops: float, tokens: int) -> dict:
    """This GPU's name and bf16 peak, and the measured rates over the planner's cited ones where it cites one
    (attention's at `tokens`, the measured sequence length)."""
    import torch

    from jobs.config import compose
    from jobs.planner.hardware import MATMUL_EFFICIENCY, hardware, matmul_efficiency, peak_bf16_tflops

    name = torch.cuda.get_device_properties(0).name
    peak = peak_bf16_tflops(name)
    res = {"gpu": name, "peak_tflops": peak}
    if peak:  # the planner's cited GEMM rate for this GPU
        res["planner_linear_tflops"] = round((matmul_efficiency(name) or MATMUL_EFFICIENCY) * peak, 1)
        res["linear_over_planner"] = round(linear_tflops / res["planner_linear_tflops"], 3)
    h100 = compose(["cluster=h100_ib"]).cluster
    if peak == h100.gpu_bf16_tflops:  # an H100 SXM's compute (an H200's, an H800's): its FlashAttention-2 figure
        att = round(hardware(h100, dtype="bf16", tasks_per_node=8).attention_at(tokens), 1)  # at this length
        res.update(planner_attention_tflops=att, attention_over_planner=round(attention_tflops / att, 3))
    return res


def _norm_profile(kernel: str, *, device: str, dtype_name: str, dim: int = 2048, tokens: int = 4096) -> dict:
    """One RMSNorm on `kernel` (bf16 or fp32 input and weight, as FSDP's bf16 parameters give it), forward and
    backward (autograd.grad to input and weight) each profiled alone after a warm-up: the host ops and the device
    work (kernels, memsets, copies) of each."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from jobs.models.model import RMSNorm
    from jobs.telemetry.kernels import from_kineto

    dtype = getattr(torch, dtype_name)
    norm = RMSNorm(dim, 1e-5, kernel=kernel).to(device=device, dtype=dtype)
    x = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(tokens, dim, device=device, dtype=dtype)
    acts = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if device == "cuda" else [])]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    res = {}
    for _ in range(2):  # the second pass is the one kept: the first loads the kernels
        with profile(activities=acts) as fwd:
            y = norm(x)
            sync()
        with profile(activities=acts) as bwd:
            torch.autograd.grad(y, (x, norm.weight), grad)
            sync()
        for phase, prof in (("forward", fwd), ("backward", bwd)):
            events = from_kineto(prof.profiler.kineto_results.events())
            res[phase] = {
                "ops": sorted({e.name for e in events if e.kind == "op"}),
                "kernels": [e.name[:80] for e in events if e.kind == "kernel"],
            }
    return res


def _norm_losses(device: str) -> dict[str, float]:
    """The loss of one forward of the same two-layer model and tokens under each model.norm_kernel, bf16 autocast
    (the one-rank trainer's precision: the block norms see the fp32 residual stream)."""
    import torch

    from jobs.config import compose
    from jobs.models.model import Transformer, init_weights
    from parallel.precision import apply_autocast

    overrides, seq = _shape(device, layers=2)
    losses = {}
    for kernel in ("eager", "fused"):
        m = compose([*overrides, f"model.norm_kernel={kernel}"]).model
        model = Transformer(m).to(device)
        init_weights(model, seed=0)
        apply_autocast(model, device_type=device)
        tok = torch.randint(0, m.vocab_size, (2, seq + 1), generator=torch.Generator().manual_seed(1)).to(device)
        with torch.no_grad():
            logits = model(tok[:, :-1]).float()
        losses[kernel] = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tok[:, 1:].flatten()).item()
        del model
    return losses


def check_norm_kernel(device: str, out: Path) -> dict:
    """`model.norm_kernel=fused` runs torch's fused RMSNorm: on CUDA its forward is one kernel under
    aten::_fused_rms_norm with none of eager's pow / mean ops, its backward aten::_fused_rms_norm_backward with
    fewer kernels than eager's (bf16 input and weight at dim 2048); and a model's loss under fused equals eager's
    within bf16 autocast's tolerance. On CPU F.rms_norm decomposes into eager's ops (no kernels to count): the op
    and the losses only (bitwise there)."""
    losses = _norm_losses(device)
    rel = abs(losses["fused"] - losses["eager"]) / abs(losses["eager"])
    runs = {k: _norm_profile(k, device=device, dtype_name="bfloat16") for k in ("eager", "fused")}
    fwd, bwd = runs["fused"]["forward"], runs["fused"]["backward"]
    ok = "aten::_fused_rms_norm" in fwd["ops"] and rel < (1e-3 if device == "cuda" else 1e-7)
    if device == "cuda":
        ok = ok and len(fwd["kernels"]) == 1 and not {"aten::pow", "aten::mean"} & set(fwd["ops"])
        ok = ok and "aten::_fused_rms_norm_backward" in bwd["ops"]
        ok = ok and len(bwd["kernels"]) < len(runs["eager"]["backward"]["kernels"])
    counts = {k: {p: len(r[p]["kernels"]) for p in ("forward", "backward")} for k, r in runs.items()}
    return {"ok": ok, "losses": losses, "loss_rel_diff": rel, "kernel_counts": counts, "fused": runs["fused"]}


def check_trainer(device: str, out: Path) -> dict:
    """The real trainer, one rank, deterministic, full AC: 6 steps saving at 3 and 6; step 6 removed; the
    resume from 3 must give steps 4..6 the same losses bitwise."""
    overrides, seq = _shape(device, layers=2)
    run = out / "trainer"
    ov = [
        *overrides,
        f"train.seq_len={seq}",
        "train.global_batch=4",
        "train.micro_batch=2",
        "mesh=single",
        "launcher.tasks_per_node=1",
        f"train.device={device}",
        "train.mixed_precision=bf16",
        "train.steps=6",
        "checkpoint.every_steps=3",
        "train.deterministic=true",
        "train.activation_checkpointing=full",
        f"data.path={out / 'tokens.h5'}",
        "data.num_samples=64",
        "optim.lr=3e-4",
        "optim.warmup_steps=2",
        f"run.dir={run}",
    ]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    first: dict = {}
    res: dict = {"runs": []}
    for attempt in range(2):
        t0 = time.perf_counter()
        p = subprocess.run([sys.executable, "-m", "jobs.train", *ov], cwd=REPO, env=env, capture_output=True, text=True)
        res["runs"].append({"rc": p.returncode, "wall_s": round(time.perf_counter() - t0, 1)})
        if p.returncode:
            res["runs"][-1]["tail"] = (p.stderr or p.stdout)[-1200:]
            break
        rows = {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}
        if attempt == 0:
            first = rows
            shutil.rmtree(run / "checkpoints" / "step_6", ignore_errors=True)
    if len(res["runs"]) == 2 and res["runs"][1]["rc"] == 0:
        res["bitwise"] = all(rows[s]["loss"] == first[s]["loss"] for s in (4, 5, 6))
        res["losses"] = [first[s]["loss"] for s in sorted(first)]
    res["ok"] = bool(res.get("bitwise"))
    return res


def run_check(name: str, *, device: str, out: Path, timeout_s: float) -> dict:
    """One check in a fresh interpreter (each owns its CUDA context and its process group)."""
    t0 = time.perf_counter()
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    try:
        p = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), name, "--device", device, "--out", str(out)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        res = (
            json.loads(lines[-1])
            if p.returncode == 0 and lines
            else {"ok": False, "rc": p.returncode, "error": (p.stderr or p.stdout)[-1500:]}
        )
    except subprocess.TimeoutExpired:
        res = {"ok": False, "rc": 124, "error": f"timed out after {timeout_s:.0f} s"}
    return {"check": name, **res, "wall_s": round(time.perf_counter() - t0, 1)}


def run_preflight(*, device: str, out: Path, deadline_s: float) -> list[dict]:
    """Every check in order, riskiest first, each printed as one JSON line when it ends; the time left is
    shared among the checks still to run (a check given under 10 s is skipped, saying so)."""
    end = time.monotonic() + deadline_s
    results = []
    for i, name in enumerate(CHECKS):
        share = (end - time.monotonic()) / (len(CHECKS) - i) * (2.0 if name == "trainer" else 1.0)
        budget = min(end - time.monotonic(), share)
        res = (
            {"check": name, "ok": False, "skipped": f"deadline: {budget:.0f} s left for it"}
            if budget < 10
            else run_check(name, device=device, out=out, timeout_s=budget)
        )
        print(json.dumps(res, default=str), flush=True)
        results.append(res)
    return results


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("check", choices=CHECKS)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = globals()[f"check_{args.check}"](args.device, out)
    print(json.dumps(res, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
