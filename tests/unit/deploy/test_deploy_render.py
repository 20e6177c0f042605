"""Every kustomization under deploy/ renders with the real kustomize (`kubectl kustomize`,
kustomize v5 inside kubectl) into well-formed, distinct objects; `eldr deploy render` prints
that rendering, and says in one line when kubectl is missing or refuses the overlay.

Without kubectl the rendering tests skip, or fail with ELDR_TEST_REQUIRE_KUBECTL (`.ci/run`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from eldr.cli import main
from support.kustomize import KUSTOMIZATIONS, REPO, render, render_yaml, require_kubectl

DEPLOY = REPO / "deploy"


def test_the_bases_and_overlays_are_all_found() -> None:
    found = {d.relative_to(DEPLOY).as_posix() for d in KUSTOMIZATIONS}
    assert {"k8s/base", "k8s/overlays/dev", "k8s/overlays/prod"} <= found


@pytest.mark.parametrize(
    "directory", KUSTOMIZATIONS, ids=lambda d: d.relative_to(DEPLOY).as_posix()
)
def test_every_kustomization_renders_to_distinct_named_objects(directory: Path) -> None:
    objects = render(directory)
    assert objects
    seen: set[tuple[str, str, str, str]] = set()
    for obj in objects:
        assert isinstance(obj, dict)
        assert {"apiVersion", "kind", "metadata"} <= set(obj), obj
        name = obj["metadata"].get("name")
        assert name, f"a {obj['kind']} without metadata.name"
        key = (obj["apiVersion"], obj["kind"], obj["metadata"].get("namespace", ""), name)
        assert key not in seen, f"{key} rendered twice"
        seen.add(key)


def test_render_prints_what_kubectl_kustomize_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    overlay = DEPLOY / "k8s" / "overlays" / "prod"
    expected = render_yaml(overlay)
    assert main(["deploy", "render", str(overlay)]) == 0
    assert capsys.readouterr().out == expected
    out = tmp_path / "prod.yaml"
    assert main(["deploy", "render", str(overlay), "--out", str(out)]) == 0
    assert out.read_text() == expected


def write(directory: Path, name: str, *docs: Any) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(yaml.safe_dump_all(list(docs), sort_keys=False))


def test_render_says_in_one_line_why_kubectl_refused_the_overlay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    require_kubectl()
    write(tmp_path, "kustomization.yaml", {"resources": ["missing.yaml"]})
    assert main(["deploy", "render", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"eldr deploy render: kubectl kustomize {tmp_path}: ")
    assert "missing.yaml" in err
    assert err.count("\n") == 1


def test_render_names_the_missing_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    assert main(["deploy", "render", str(DEPLOY / "k8s" / "overlays" / "dev")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("eldr deploy render: kubectl not found on PATH")
    assert err.count("\n") == 1
