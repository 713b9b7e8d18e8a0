"""Token files are read where the filesystem has no file locks (jobs.data.h5): Lustre or NFS without flock fail
HDF5's lock with errno 37/38/524, and the reader opens the file again without it. No such filesystem is mounted
here, so HDF5's refusal is stood in for: the first, locking open raises what HDF5 raises there. Where locks work,
a reader still takes its lock (prepare-data's append relies on it)."""

from __future__ import annotations

import errno
import subprocess
import sys

import h5py
import pytest

from jobs.config import DataConfig
from jobs.data import BatchSource
from jobs.data import h5 as jobs_h5
from jobs.data.cursor import file_identity
from jobs.data.files import ensure_dataset

_HOLD = "import h5py, sys, time; f = h5py.File(sys.argv[1], 'a'); print('held', flush=True); time.sleep(120)"


@pytest.fixture
def token_file(tmp_path):
    cfg = DataConfig(name="synthetic", path=str(tmp_path / "synthetic.h5"))
    return cfg, ensure_dataset(cfg, vocab_size=256, sample_len=17)


def _without_flock(monkeypatch, code: int) -> list[object]:
    """h5py.File as HDF5 behaves on a filesystem without flock: a locking open fails with `code`."""
    real, calls = h5py.File, []

    def file(path, mode="r", **kw):
        calls.append(kw.get("locking", True))
        if kw.get("locking", True) is not False:
            raise OSError(code, f"Unable to synchronously open file (unable to lock file, errno = {code})")
        return real(path, mode, **kw)

    monkeypatch.setattr(jobs_h5.h5py, "File", file)
    return calls


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, 524])
def test_every_reader_opens_a_token_file_where_the_filesystem_has_no_locks(monkeypatch, token_file, code) -> None:
    cfg, path = token_file
    calls = _without_flock(monkeypatch, code)
    assert ensure_dataset(cfg, vocab_size=256, sample_len=17) == path  # the entry point's check
    assert file_identity(path)["size"] == path.stat().st_size  # the data cursor's identity of the file
    inputs, targets = BatchSource(path, seed=0, global_batch=4, seq_len=16, dp_rank=0, dp=1).batch(0)[:2]
    assert tuple(inputs.shape) == tuple(targets.shape) == (4, 16)
    assert calls == [True, False] * 3  # each reader: refused with the lock, opened without it


def test_where_locks_work_a_reader_is_still_refused_while_a_writer_holds_the_file(token_file) -> None:
    _, path = token_file
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OSError, match="unable to lock file, errno = 11"):
            jobs_h5.open_read(path)
    finally:
        holder.kill()
        holder.wait(timeout=30)
