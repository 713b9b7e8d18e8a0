"""pyproject's package list and package data against the tree: a forgotten subpackage or config file fails here,
in a second, rather than in an installed wheel (tests/multiproc/test_install.py builds one)."""

from __future__ import annotations

import tomllib

from setuptools import find_packages

from tests.conftest import REPO


def _setuptools() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_python_package_of_the_tree_is_in_pyprojects_package_list() -> None:
    tree = find_packages(str(REPO), include=["jobs", "jobs.*", "parallel", "parallel.*", "checkpoint", "checkpoint.*"])
    plugins = [f"hydra_plugins.{p.name}" for p in (REPO / "hydra_plugins").iterdir() if (p / "__init__.py").exists()]
    mapped = list(_setuptools()["package-dir"])
    assert mapped == ["jobs._conf", "jobs._sbatch"]
    assert sorted(_setuptools()["packages"]) == sorted([*tree, *plugins, *mapped])


def test_the_package_data_globs_cover_every_config_and_template_file() -> None:
    data = _setuptools()["package-data"]
    for package, folder in _setuptools()["package-dir"].items():
        files = {p.relative_to(REPO / folder) for p in (REPO / folder).rglob("*") if p.is_file()}
        shipped = {
            p for pattern in data[package] for p in files if p.match(pattern) and len(p.parts) == pattern.count("/") + 1
        }
        left = {p for p in files - shipped if p.name != "__init__.py" and "__pycache__" not in p.parts}
        assert left <= {p for p in files if p.parts[0] == "examples"}, sorted(map(str, left))
