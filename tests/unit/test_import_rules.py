"""The import rules of docs/design.md, read off the source (every import, at module level or inside a function):
parallel/ and checkpoint/ import neither jobs/ nor Hydra, the model room imports only the config and parallel/,
and no module imports a private name (`_x`) from another room."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO

ROOTS = ("jobs", "parallel", "checkpoint", "hydra_plugins", "scripts", "tests")
# jobs/ is one room per subpackage (jobs/models, jobs/planner, ...) and one for its top-level modules.
JOBS_ROOMS = {p.name for p in (REPO / "jobs").iterdir() if (p / "__init__.py").exists()}


def _room(module: str) -> str | None:
    """The room of a dotted module name of this repository, None for any other (torch, hydra, ...)."""
    parts = module.split(".")
    if parts[0] not in ROOTS:
        return None
    if parts[0] == "jobs" and len(parts) > 1 and parts[1] in JOBS_ROOMS:
        return f"jobs.{parts[1]}"
    return parts[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


# `import x` and `from x import a, b` (also parenthesised over several lines), at any indent: read with a regular
# expression, not ast, so that reading every file of the repository takes milliseconds.
_IMPORT = re.compile(r"^[ \t]*(?:import[ \t]+([\w.]+)|from[ \t]+([\w.]+)[ \t]+import[ \t]+(\([^)]*\)|[^\n]*))", re.M)


def _imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None for `import x`) of every absolute import in the file."""
    out = []
    text = path.read_text()
    for m in _IMPORT.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        if m[1]:
            out.append((line, m[1], None))
            continue
        names = re.sub(r"#[^\n]*", "", m[3]).strip("()")
        out += [(line, m[2], n.split()[0]) for n in names.split(",") if n.strip()]
    return out


def _files(*roots: str) -> list[Path]:
    return sorted(p for r in roots for p in (REPO / r).rglob("*.py") if ".venv" not in p.parts)


def _violations(roots: tuple[str, ...], rule) -> list[str]:
    return [
        f"{p.relative_to(REPO)}:{line}: {mod}{'.' + name if name else ''}"
        for p in _files(*roots)
        for line, mod, name in _imports(p)
        if rule(_module_name(p), mod, name)
    ]


def test_parallel_and_checkpoint_import_neither_jobs_nor_hydra() -> None:
    def bad(_: str, mod: str, __: str | None) -> bool:
        return mod.split(".")[0] in ("jobs", "hydra", "hydra_plugins", "omegaconf")

    assert _violations(("parallel", "checkpoint"), bad) == []


def test_the_model_room_imports_only_the_config_torch_and_parallel() -> None:
    def bad(_: str, mod: str, __: str | None) -> bool:
        top = mod.split(".")[0]
        return top in ROOTS and not (mod == "jobs.config" or _room(mod) in ("jobs.models", "parallel"))

    assert _violations(("jobs/models",), bad) == []


def test_no_module_imports_a_private_name_from_another_room() -> None:
    def bad(importer: str, mod: str, name: str | None) -> bool:
        private = name is not None and name.startswith("_") and not name.startswith("__")
        return private and _room(mod) is not None and _room(mod) != _room(importer)

    assert _violations(ROOTS, bad) == []


def test_a_room_is_a_jobs_subpackage_or_a_top_level_folder() -> None:
    assert (_room("jobs.planner.timing"), _room("jobs.config"), _room("scripts.bench.moe")) == (
        "jobs.planner",
        "jobs",
        "scripts",
    )
    assert _room("torch.distributed") is None and "models" in JOBS_ROOMS
