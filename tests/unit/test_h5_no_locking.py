"""Token files are read without HDF5's file lock (jobs.data.h5): on Lustre or NFS without flock the lock fails, so a
reader must not take one. Here another process holds the lock a writer takes; every reader still opens the file."""

from __future__ import annotations

import subprocess
import sys
import time

import h5py
import pytest

from jobs.config import DataConfig
from jobs.data import BatchSource
from jobs.data.cursor import file_identity
from jobs.data.files import ensure_dataset

_HOLD = "import h5py, sys, time; f = h5py.File(sys.argv[1], 'a'); print('held', flush=True); time.sleep(120)"


@pytest.fixture
def locked_token_file(tmp_path):
    cfg = DataConfig(name="synthetic", path=str(tmp_path / "synthetic.h5"))
    path = ensure_dataset(cfg, vocab_size=256, sample_len=17)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OSError, match="unable to lock file"):  # what a locking reader gets
            h5py.File(path, "r", locking=True)
        yield cfg, path
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_token_file_locked_by_another_process_is_still_read_by_every_reader(locked_token_file) -> None:
    cfg, path = locked_token_file
    t0 = time.monotonic()
    assert ensure_dataset(cfg, vocab_size=256, sample_len=17) == path  # the entry point's check
    assert file_identity(path)["size"] == path.stat().st_size  # the data cursor's identity of the file
    inputs, targets = BatchSource(path, seed=0, global_batch=4, seq_len=16, dp_rank=0, dp=1).batch(0)[:2]
    assert tuple(inputs.shape) == tuple(targets.shape) == (4, 16)
    assert time.monotonic() - t0 < 30
