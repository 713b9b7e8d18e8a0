"""Token files opened for reading where the filesystem has no file locks: on Lustre or NFS mounted without flock,
HDF5's lock fails (errno 37 ENOLCK, 38 ENOSYS or 524 ENOTSUPP: "unable to lock file") and every rank would stop;
there the file is opened again with `locking=False`. Where locks work the reader keeps its shared lock: it is how
jobs.prepare_data sees that a run reads the file and appends to a copy instead of in place (jobs/data/prepare.py
`_append`; HDF5 without SWMR is not safe to extend under a reader). On a filesystem without locks that writer
cannot lock either, and takes the copy path too. jobs/telemetry/run_report.py reads phase files with
`locking=False` always: nothing there is extended behind its back."""

from __future__ import annotations

import errno
import os

import h5py

__all__ = ["NO_LOCKS", "open_read"]

NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, 524})  # 524: the kernel's ENOTSUPP (NFS), not in errno


def open_read(path: str | os.PathLike[str]) -> h5py.File:
    """`h5py.File(path, "r")`, without HDF5's lock where the filesystem refuses locks."""
    try:
        return h5py.File(path, "r")
    except OSError as e:
        if e.errno not in NO_LOCKS:
            raise
        return h5py.File(path, "r", locking=False)
