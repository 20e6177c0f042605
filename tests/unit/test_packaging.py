"""pyproject.toml against the tree: every package is listed, every service has an entry point.

setuptools installs only the packages `[tool.setuptools] packages` names, so a new
subpackage missing from that list imports from a checkout (editable install) and is absent
from a wheel. `eldr serve` finds the services by their `eldr.services` entry points
(`eldr.serve`), so a service shell without one cannot be started.
"""

from __future__ import annotations

import tomllib
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _packages_in_tree(package_dir: dict[str, str]) -> set[str]:
    found = set()
    for top, rel in package_dir.items():
        base = ROOT / rel
        for init in base.rglob("__init__.py"):
            parts = init.parent.relative_to(base).parts
            found.add(".".join((top, *parts)))
    return found


def test_listed_packages_are_the_packages_in_the_tree(pyproject: dict[str, Any]) -> None:
    setuptools = pyproject["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    in_tree = _packages_in_tree(setuptools["package-dir"])
    assert sorted(in_tree - listed) == [], "packages missing from pyproject's list"
    assert sorted(listed - in_tree) == [], "listed packages with no __init__.py"


def test_every_service_shell_has_an_entry_point(pyproject: dict[str, Any]) -> None:
    declared = pyproject["project"]["entry-points"]["eldr.services"]
    shells = {p.parent.name for p in (ROOT / "services").glob("*/service.py")}
    assert set(declared) == shells
    for name, target in declared.items():
        assert target == f"eldr_services.{name}.service:main"


def test_installed_entry_points_match_pyproject(pyproject: dict[str, Any]) -> None:
    """The installed metadata is current (re-run `make venv` after editing pyproject)."""
    declared = pyproject["project"]["entry-points"]["eldr.services"]
    installed = {ep.name: ep.value for ep in entry_points(group="eldr.services")}
    assert installed == declared
