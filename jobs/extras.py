"""Optional dependencies (pyproject's extras): a rank never imports them; the command that needs one names the extra."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["EXTRAS", "MissingExtra", "require"]

EXTRAS = {"matplotlib": "report", "tokenizers": "data"}  # module -> the extra that installs it ([dev] has both)


class MissingExtra(RuntimeError):
    """An optional dependency is not installed; the message names the extra."""


def require(module: str, *, needed_by: str) -> ModuleType:
    """The module, or MissingExtra: `tokenizers is not installed (jobs.prepare_data needs it): pip install ...`."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        extra = EXTRAS[module]
        raise MissingExtra(
            f"{module} is not installed ({needed_by} needs it): pip install 'meshjob[{extra}]', or in a checkout "
            f"pip install -e '.[{extra}]'"
        ) from e
