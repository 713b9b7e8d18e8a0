"""One logger for the whole suite, with the rank in its prefix; rank 0 logs info, the others warnings."""

from __future__ import annotations

import logging
import sys

__all__ = ["get_logger", "setup_logging"]

_LOGGER = "meshjob"


def setup_logging(rank: int | None = None) -> logging.Logger:
    """Configures the `meshjob` logger once per process (rank None: the login-node / launcher process)."""
    logger = logging.getLogger(_LOGGER)
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stdout if rank in (None, 0) else sys.stderr)
    prefix = "[meshjob]" if rank is None else f"[rank {rank}]"
    handler.setFormatter(logging.Formatter(f"%(asctime)s {prefix} %(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank in (None, 0) else logging.WARNING)
    logger.propagate = False
    return logger


def get_logger() -> logging.Logger:
    return logging.getLogger(_LOGGER)
