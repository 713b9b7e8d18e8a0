"""Token files and data cursors opened for reading without HDF5's file locks: on Lustre or NFS mounted without flock,
HDF5's lock fails (errno 37 ENOLCK, 38 ENOSYS or 524 ENOTSUPP: "unable to lock file") and every rank would stop.
Only jobs.prepare_data writes a token file (a new one to a temporary name, renamed; an append in place, committed by
the manifest it writes last, which readers check), so the lock guards nothing a reader relies on.
jobs/telemetry/run_report.py reads the phase files the same way."""

from __future__ import annotations

import os

import h5py

__all__ = ["open_read"]


def open_read(path: str | os.PathLike[str]) -> h5py.File:
    """`h5py.File(path, "r")` without file locking."""
    return h5py.File(path, "r", locking=False)
