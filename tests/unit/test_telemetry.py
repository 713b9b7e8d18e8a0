"""Model FLOPs / MFU and the CPU live-tensor tracker, against hand arithmetic and a published MFU."""

from __future__ import annotations

import gc
import sys
import threading

import pytest
import torch

from jobs.config import compose
from jobs.telemetry import LiveBytes, PeakMemory, achieved, live_tensors, model_flops_per_token
from jobs.telemetry.memory import CPU_SOURCE


def test_palm_540b_reaches_its_published_46_percent_mfu():
    # Chowdhery et al. 2022 (PaLM) Table 3 / appendix B: 540.35B parameters, L=118, H=48, Q=256, T=2048,
    # 238.3K tokens/s on 6144 TPU v4 chips of 275 peak bf16 TFLOP/s -> 46.2% MFU.
    fpt = 6 * 540.35e9 + 12 * 118 * 48 * 256 * 2048
    got = achieved(flops_per_token=fpt, tokens_per_step=238_300, world_size=6144, step_time_s=1.0, peak_tflops=275.0)
    assert got["mfu"] == pytest.approx(0.462, abs=0.001)
    assert got["tflops_per_rank"] == pytest.approx(127.1, abs=0.1)


def test_no_peak_means_no_mfu():
    assert set(
        achieved(flops_per_token=1e9, tokens_per_step=1000, world_size=2, step_time_s=1.0, peak_tflops=None)
    ) == {"tflops_per_rank"}


def test_flops_per_token_of_the_tiny_model_is_6n_plus_causal_6lhqt():
    m = compose(["model=tiny"]).model  # dim 64, 4 layers, 8 heads (head dim 8), 4 kv heads, ffn 192, vocab 256
    block = 64 * 8 * (2 * 8 + 2 * 4) + 3 * 64 * 192  # wq, wk, wv, wo + w1, w2, w3 (norms are not matmuls)
    n = 4 * block + 256 * 64  # the head counts, the embedding lookup does not
    # PaLM's 12·L·H·Q·T attention term, halved for the causal mask: the planner's formula
    assert model_flops_per_token(m, seq_len=32) == 6 * n + 6 * 4 * 8 * 8 * 32


def test_live_bytes_counts_what_ops_create_until_it_is_freed_or_resized():
    base = torch.zeros(100)  # 400 bytes present at entry
    with LiveBytes(lambda: [base]) as live:
        a = torch.ones(1000)  # +4000
        b = a * 2  # +4000 -> 8400
        del a  # -4000
        c = torch.empty(250)  # +1000 -> 5400
        b.untyped_storage().resize_(0)  # -4000 (FSDP2 frees unsharded parameters this way)
        now = live.current
    assert live.peak == 8400
    assert now == 400 + 1000
    assert c.numel() == 250


def test_live_bytes_counts_the_tensors_of_ops_that_return_tuples_and_lists():
    # aten ops return a tensor, or tuples and lists of them (walked without pytree: a tracked step on the tiny
    # model took 3-5x an untracked one with it)
    x = torch.arange(6.0)  # 24 bytes, not counted: present before and not in `tensors`
    with LiveBytes() as live:
        pair = torch.sort(x)  # a structseq (tuple) of values (24 bytes) and int64 indices (48)
        assert live.current == 72
        moved = torch._foreach_add([x, x], 1.0)  # a list: two new 24-byte tensors
        assert live.current == 72 + 48
        halves = torch.split(pair.values, 3)  # views of the values' storage: nothing new
        assert live.current == 120 and live.peak == 120
    assert len(moved) == len(halves) == 2


def test_live_bytes_loses_no_update_when_storages_are_freed_on_another_thread():
    # A C++ thread of torch's (gloo's, autograd's) can drop a tensor's last reference, and the storage's finalizer
    # then runs there (seen in the tp2 case) while the main thread counts an op's output. Unlocked,
    # `current -= ...` on one thread and `current += ...` on the other interleaved and one update was lost: a tp2
    # block's forward in CI measured exactly one 96 KiB activation short. With a thread switch forced every
    # microsecond, ~300 of these 20,000 were.
    n = 20_000
    live = LiveBytes()
    old = [torch.UntypedStorage(8) for _ in range(n)]
    for st in old:
        live._track_storage(st)  # what __torch_dispatch__ and the resize_ patch call for every storage
    new: list = []

    def count_new() -> None:
        for _ in range(n):
            new.append(torch.UntypedStorage(8))
            live._track_storage(new[-1])

    def free_old() -> None:
        while old:
            old.pop()  # its finalizer runs on this thread

    was = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=count_new), threading.Thread(target=free_old)]
        [t.start() for t in threads]
        [t.join() for t in threads]
    finally:
        sys.setswitchinterval(was)
    del st  # the loop's last storage
    assert live.current == 8 * n == sum(s.nbytes() for s in new)


def _garbage_cycle(nbytes: int) -> None:
    """An unreachable tensor that only the cyclic garbage collector frees."""
    holder: dict = {"t": torch.zeros(nbytes // 4)}
    holder["self"] = holder


def test_live_bytes_counts_no_garbage_and_no_collection_frees_anything_while_tracking():
    # CI saw one block's forward leave -68608 bytes live: a tensor in a reference cycle, inherited by the
    # forked rank, was counted at entry and freed by a collection that ran in the middle of the block.
    was = gc.isenabled()
    gc.collect()
    with LiveBytes(live_tensors) as clean:
        pass
    gc.disable()
    _garbage_cycle(101_376)
    gc.enable()
    old = gc.get_threshold()
    gc.set_threshold(1)  # a collection at (almost) every allocation
    try:
        keep = torch.zeros(100)  # noqa: F841 (live through the tracking)
        with LiveBytes(live_tensors) as live:
            start = live.current
            for _ in range(50):
                _garbage_cycle(4000)  # garbage made while tracking stays counted: nothing collects it
                [object() for _ in range(10)]
            grown = live.current - start
    finally:
        gc.set_threshold(*old)
        gc.enable() if was else gc.disable()
    assert start == clean.current + 400  # `keep`, and not the garbage
    assert grown == 50 * 4000
    assert gc.isenabled() == was


def test_cpu_peak_memory_is_sampled_and_read_once_per_window():
    keep = torch.zeros(10)
    pm = PeakMemory(torch.device("cpu"), tensors=lambda: [keep], sample_every=2)
    with pm.track(1):  # not sampled
        torch.ones(1000)
    assert pm.read() == {}
    with pm.track(2):
        x = torch.ones(1000)
    del x
    assert pm.read() == {"peak_mem_bytes": 40 + 4000, "peak_mem_source": CPU_SOURCE}
    assert pm.read() == {}
