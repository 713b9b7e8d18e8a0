"""`meshjob <command> [arguments]`: one console script for every command; each is also `python -m jobs.<module>`."""

from __future__ import annotations

import importlib
import sys

from jobs import exitcodes
from jobs.commands import COMMANDS

__all__ = ["main"]


def _usage() -> str:
    width = max(len(c.name) for c in COMMANDS)
    rows = [f"  {c.name:<{width}}  {c.title}" for c in COMMANDS]
    return "\n".join(
        [
            "usage: meshjob <command> [arguments]",
            "",
            "commands:",
            *rows,
            "",
            "meshjob <command> --help: its keys and examples",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return exitcodes.OK if argv else exitcodes.CONFIG_ERROR
    command = next((c for c in COMMANDS if c.name == argv[0]), None)
    if command is None:
        print(f"meshjob: unknown command {argv[0]!r}\n\n{_usage()}", file=sys.stderr)
        return exitcodes.CONFIG_ERROR
    sys.argv = [f"meshjob {command.name}", *argv[1:]]  # @hydra.main (-m, --cfg) parses sys.argv
    # the command's module is imported by name: `meshjob status` does not import the trainer's torch stack
    return importlib.import_module(command.module).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
