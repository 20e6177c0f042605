"""The deploy/ overlays as the real kustomize renders them (`kubectl kustomize`, through
`eldr deploy render`'s `kustomize`), for the manifest, Tiltfile and entry-point tests.

Without kubectl a test that needs a rendering skips with the reason, or fails where
ELDR_TEST_REQUIRE_KUBECTL is set (`.ci/run`).
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import yaml

from eldr.deploy.cli import kustomize
from support.prereq import missing

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZATIONS = sorted(p.parent for p in (REPO / "deploy").rglob("kustomization.yaml"))
"""Every directory under deploy/ that kustomize can build (bases and overlays)."""


def require_kubectl() -> None:
    """Skip (or fail, with ELDR_TEST_REQUIRE_KUBECTL) where kubectl is not on PATH."""
    if shutil.which("kubectl") is None:
        missing(
            "ELDR_TEST_REQUIRE_KUBECTL",
            "kubectl not on PATH: the kustomize overlays cannot be rendered",
        )


@functools.cache
def _render_yaml(directory: Path) -> str:
    return kustomize(directory)


def render_yaml(directory: Path) -> str:
    """The YAML `kubectl kustomize directory` prints (rendered once per test session)."""
    require_kubectl()
    return _render_yaml(directory.resolve())


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects of `directory`'s kustomization, fresh copies on every call."""
    return [d for d in yaml.safe_load_all(render_yaml(directory)) if d is not None]
