"""The one owner of a rank's stop signals: handlers installed at process start that only set a flag.

The trainer reads the flag at each step boundary and folds it into the step's one all-reduce, so
every rank stops after the same step (docs/fault-tolerance.md: "what happens when..."). Python runs a handler only in
the main thread and only between bytecodes, so while the main thread is blocked in C++ (a rendezvous,
a collective, a checkpoint load) the flag stays unset; `arrived()` also reads the signal numbers that
the C-level handler writes to a wakeup pipe (`signal.set_wakeup_fd`), which the watchdog thread polls.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

__all__ = ["StopSignals", "parse_signals"]


def parse_signals(names: Sequence[str]) -> list[signal.Signals]:
    """`["SIGUSR2", "TERM"]` -> signals; ValueError naming `failure.requeue_signals` for an unknown name."""
    out = []
    for name in names:
        key = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
        try:
            out.append(signal.Signals[key])
        except KeyError:
            raise ValueError(
                f"failure.requeue_signals: {name!r} is not a signal name; use e.g. [SIGUSR2,SIGTERM]"
            ) from None
    return out


class StopSignals:
    """Installs handlers for the requeue signals (and SIGINT: Ctrl-C saves and stops); `received` is
    the first signal that arrived, or None. A handler does nothing but record the signal."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.count = 0
        self._installed: set[signal.Signals] = set()
        self._wakeup: int | None = None  # read end of the wakeup pipe

    def install(self, signals: Sequence[signal.Signals], *, ctrl_c: bool = True, wakeup: bool = True) -> StopSignals:
        """Installs the handlers (main thread only); `wakeup`: also the wakeup pipe that `arrived()` reads. Then
        unblocks them: a process started with them blocked (a Slurm rank under its task's watcher, a torchrun
        worker under its agent: `jobs.launch.task_exits`, `jobs.launch.stop_notice`) takes one that arrived while
        it started, now."""
        self._installed = {*signals, *([signal.SIGINT] if ctrl_c else [])}
        for sig in self._installed:
            signal.signal(sig, self._on_signal)
        if wakeup and self._wakeup is None:
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            self._wakeup = r
        signal.pthread_sigmask(signal.SIG_UNBLOCK, self._installed)
        return self

    def arrived(self) -> bool:
        """Whether a stop signal arrived, also one whose Python handler has not run yet (the main thread
        is blocked in C++); safe to call from any thread."""
        if self.received is None and self._wakeup is not None:
            try:
                data = os.read(self._wakeup, 512)
            except OSError:  # BlockingIOError: nothing arrived
                data = b""
            mine = [n for n in data if n in {int(s) for s in self._installed}]
            if mine and self.received is None:
                self.received = mine[0]
        return self.received is not None

    def ignore_from_now(self) -> None:
        """The attempt is finished: a stop signal arriving now (Slurm's time-limit warning during
        teardown) means nothing. Ignored, not merely unhandled: at interpreter exit CPython puts a
        signal with a Python handler back to SIG_DFL, and USR2's default action kills the process,
        which turned a finished job into FAILED (seen on the local cluster)."""
        for sig in self._installed:
            signal.signal(sig, signal.SIG_IGN)

    def note(self, signum: int) -> None:
        """Records `signum` as if it had arrived (a warning that was sent while no process could take it)."""
        self._on_signal(signum, None)

    def _on_signal(self, signum: int, _frame) -> None:
        if self.received is None:
            self.received = signum
        self.count += 1

    @property
    def name(self) -> str | None:
        return None if self.received is None else signal.Signals(self.received).name
