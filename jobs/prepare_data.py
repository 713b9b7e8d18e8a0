"""`python -m jobs.prepare_data data.inputs=[FILES] data.path=OUT.h5 [overrides]`: tokenize a corpus into the
HDF5 token file the trainer reads (`data=tokenized data.path=OUT.h5`); re-run with more inputs to append.

Exit 0 when written (or nothing new to add), 2 on a config error or a malformed input file (the message
names the file and line; nothing is written)."""

from __future__ import annotations

import sys

from jobs import exitcodes
from jobs.cli import main_for
from jobs.config import JobConfig
from jobs.extras import MissingExtra
from jobs.log import setup_logging

__all__ = ["main", "run"]


def run(cfg: JobConfig) -> int:
    from jobs.data.files import padded_vocab
    from jobs.data.prepare import prepare_data

    log = setup_logging()
    try:
        m = prepare_data(cfg.data, vocab_size=cfg.model.vocab_size)
    except ValueError as e:  # a config error, or an InputError naming the file and line
        print(f"error: {e}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    except MissingExtra as e:
        print(f"error: {e}", file=sys.stderr)
        return exitcodes.ENV_ERROR
    log.info(
        "%s: %d files, %d documents (%d held out), vocabulary %d: train with data=tokenized data.path=%s "
        "model.vocab_size=%d",
        cfg.data.path,
        len(m["files"]),
        m["documents"] + m["heldout_documents"],
        m["heldout_documents"],
        m["vocab_size"],
        cfg.data.path,
        padded_vocab(m["vocab_size"]),
    )
    return exitcodes.OK


def main(argv: list[str] | None = None) -> int:
    return main_for(run, argv, command="prepare-data")


if __name__ == "__main__":
    exitcodes.exit_command(main())
