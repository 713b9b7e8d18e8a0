"""Peak memory per rank: the CUDA allocator's peak on a GPU, a live-tensor tracker on CPU.

On CUDA, `torch.cuda.max_memory_allocated`, reset at every logging window. On CPU torch keeps no
allocator statistics, and torch's own `torch.distributed._tools.mem_tracker.MemTracker` refuses a
module called more than once per iteration (every pipeline microbatch and every accumulation step
does), so `LiveBytes` counts it here: the storages alive when tracking starts (what `tensors()`
yields; `live_tensors`: every tensor a Python object holds, which costs one garbage-collector scan)
plus every storage an op creates while it is active, until that storage is freed or resized (FSDP2 frees unsharded parameters with
`UntypedStorage.resize_(0)`, patched while active, as MemTracker does). It sees tensors that go
through the dispatcher; buffers allocated inside gloo or by `torch.from_numpy` are not counted.
While active it holds the cyclic garbage collector off (after one collection on entry): otherwise
unreachable tensors in reference cycles (left by earlier work, or inherited by a forked rank) are
counted as live at the start and then "freed" whenever a collection happens to run, which makes
what a block's forward leaves live come out negative (seen in CI on the tp2 plan-vs-measured case).
A storage can be freed on any thread (a C++ thread of torch's, gloo's or autograd's, can drop a tensor's
last reference, and its finalizer then runs there), so the count is updated under a lock: unlocked,
a free that interleaved with an op's allocation lost one of the two updates (a tp2 block's forward
once measured exactly one 96 KiB activation short).
Its Python hook on every op costs time, so on CPU only every `sample_every`-th step is tracked
and a window without a tracked step reports nothing.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

__all__ = ["LiveBytes", "PeakMemory", "live_tensors", "CUDA_SOURCE", "CPU_SOURCE"]

CUDA_SOURCE = "torch.cuda.max_memory_allocated"
CPU_SOURCE = "cpu live tensors (dispatch tracker)"


class LiveBytes(TorchDispatchMode):
    """Bytes of live tensor storages while active (`current`), and their maximum (`peak`)."""

    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]] = tuple) -> None:
        super().__init__()
        self._tensors = tensors
        self._sizes: dict[int, int] = {}
        self._lock = threading.RLock()  # frees arrive on other threads; reentrant: a finalizer may run inside
        self.current = self.peak = 0

    def __enter__(self) -> LiveBytes:
        self._gc_was_enabled = gc.isenabled()
        gc.collect()
        gc.disable()
        with self._lock:
            self._sizes.clear()
            self.current = 0
        for t in self._tensors():
            self._track(t)
        self.peak = self.current
        self._resize = torch.UntypedStorage.resize_
        tracker, orig = self, self._resize

        def resize_(st: torch.UntypedStorage, size: int):
            out = orig(st, size)
            tracker._track_storage(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*args)
        if self._gc_was_enabled:
            gc.enable()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor desugar into local ops, which come back here
        out = func(*args, **(kwargs or {}))
        self._track_out(out)
        return out

    def _track_out(self, out: object) -> None:
        """An op's result: a tensor, or tuples and lists of them (what aten ops return); pytree's general walk
        cost more than the op itself on the tiny model (3-5x a tracked step's time)."""
        if isinstance(out, torch.Tensor):
            self._track(out)
        elif isinstance(out, (tuple, list)):
            for o in out:
                self._track_out(o)
        elif isinstance(out, dict):
            tree_map_only(torch.Tensor, self._track, out)

    def _track(self, t: torch.Tensor) -> None:
        if isinstance(t, DTensor):
            t = t._local_tensor
        if type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter):
            self._track_storage(t.untyped_storage())

    def _track_storage(self, st: torch.UntypedStorage) -> None:
        key, size = st._cdata, st.nbytes()
        with self._lock:
            if key not in self._sizes:
                weakref.finalize(st, self._free, key)
            self.current += size - self._sizes.get(key, 0)
            self._sizes[key] = size
            self.peak = max(self.peak, self.current)

    def _free(self, key: int) -> None:
        with self._lock:
            self.current -= self._sizes.pop(key, 0)


def live_tensors() -> Iterator[torch.Tensor]:
    """Every tensor a Python object refers to, as the garbage collector sees them: besides the model
    and optimizer state, what a pipeline stage keeps between steps (its receive buffers)."""
    with warnings.catch_warnings():  # isinstance() touches deprecated module attributes (reduce_op)
        warnings.simplefilter("ignore", FutureWarning)
        found = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    yield from found


class PeakMemory:
    """Peak bytes of this rank per logging window: `track()` wraps a step, `read()` ends the window."""

    def __init__(
        self, device: torch.device, *, sample_every: int, tensors: Callable[[], Iterable[torch.Tensor]] = live_tensors
    ) -> None:
        self.device, self.sample_every = device, max(sample_every, 1)
        self._tensors = tensors
        self._peak: int | None = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    @contextlib.contextmanager
    def track(self, step: int) -> Iterator[None]:
        if self.device.type == "cuda" or step % self.sample_every:
            yield
            return
        with LiveBytes(self._tensors) as live:
            yield
        self._peak = max(self._peak or 0, live.peak)

    def read(self) -> dict[str, object]:
        """{"peak_mem_bytes", "peak_mem_source"} since the last read ({} on CPU without a tracked step)."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return {"peak_mem_bytes": peak, "peak_mem_source": CUDA_SOURCE}
        peak, self._peak = self._peak, None
        return {} if peak is None else {"peak_mem_bytes": peak, "peak_mem_source": CPU_SOURCE}
