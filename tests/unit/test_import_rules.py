"""The import rules of docs/design.md, read off the source (every import, at module level or inside a function):
parallel/ and checkpoint/ import neither jobs/ nor Hydra, the model room imports only the config and parallel/,
and no module imports a private name (`_x`) from another room."""

from __future__ import annotations

import ast
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


def _imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None for `import x`) of every absolute import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, node.module, a.name) for a in node.names]
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
