"""The offline kustomize renderer (eldr.deploy.kustomize): the subset deploy/k8s uses, and
refusal of everything else; where `kubectl` is installed, its output against the real
kustomize's (`kubectl kustomize`, kustomize v5 inside kubectl) for every overlay and fixture.

Not forced in CI: neither Debian, PyPI nor npm ships kustomize or kubectl (machines of the
project's image have kubectl from the image itself), so a clean machine skips those."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from eldr.deploy.kustomize import KustomizeError, render, strategic_merge

DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "web"},
    "spec": {
        "template": {
            "spec": {
                "containers": [
                    {
                        "name": "app",
                        "image": "eldr:1",
                        "args": ["serve", "router"],
                        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                        "ports": [{"name": "metrics", "containerPort": 9100}],
                    },
                    {"name": "sidecar", "image": "busybox:1"},
                ]
            }
        }
    },
}


def write(directory: Path, name: str, *docs: Any) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(yaml.safe_dump_all(list(docs), sort_keys=False))


def base(tmp_path: Path, **kustomization: Any) -> Path:
    d = tmp_path / "base"
    write(d, "deploy.yaml", DEPLOYMENT)
    write(d, "kustomization.yaml", {"resources": ["deploy.yaml"], **kustomization})
    return d


def overlay(tmp_path: Path, **kustomization: Any) -> Path:
    base(tmp_path)
    d = tmp_path / "overlay"
    write(d, "kustomization.yaml", {"resources": ["../base"], **kustomization})
    return d


def container(objects: list[dict[str, Any]], name: str = "app") -> dict[str, Any]:
    for c in objects[0]["spec"]["template"]["spec"]["containers"]:
        if c["name"] == name:
            return dict(c)
    raise AssertionError(name)


def test_a_base_renders_its_resources_unchanged(tmp_path: Path) -> None:
    assert render(base(tmp_path)) == [DEPLOYMENT]


def test_containers_and_env_merge_by_name(tmp_path: Path) -> None:
    d = overlay(tmp_path, patches=[{"path": "patch.yaml"}])
    patch = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "web"},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {"name": "app", "env": [{"name": "B", "value": "3"}, {"name": "C"}]}
                    ]
                }
            }
        },
    }
    write(d, "patch.yaml", patch)
    objects = render(d)
    app = container(objects)
    # kustomize's order: the patch's entries first, then the base's others
    assert app["env"] == [{"name": "B", "value": "3"}, {"name": "C"}, {"name": "A", "value": "1"}]
    assert app["args"] == ["serve", "router"]
    assert container(objects, "sidecar")["image"] == "busybox:1"


def test_other_lists_are_replaced_and_null_deletes() -> None:
    merged = strategic_merge(
        {"args": ["a", "b"], "keep": 1, "drop": 2}, {"args": ["c"], "drop": None}
    )
    assert merged == {"args": ["c"], "keep": 1}


def test_ports_merge_by_container_port() -> None:
    merged = strategic_merge(
        {"ports": [{"containerPort": 1, "name": "a"}]},
        {"ports": [{"containerPort": 1, "name": "b"}, {"containerPort": 2}]},
    )
    assert merged == {"ports": [{"containerPort": 1, "name": "b"}, {"containerPort": 2}]}


def test_namespace_is_set_on_namespaced_objects_only(tmp_path: Path) -> None:
    d = overlay(tmp_path, namespace="team", resources=["../base", "ns.yaml"])
    write(d, "ns.yaml", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}})
    objects = render(d)
    assert objects[0]["metadata"]["namespace"] == "team"
    assert "namespace" not in objects[1]["metadata"]


def test_a_namespace_object_is_never_renamed(tmp_path: Path) -> None:
    d = overlay(tmp_path, namespace="team", resources=["../base", "ns.yaml"])
    write(d, "ns.yaml", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "other"}})
    with pytest.raises(KustomizeError, match="renaming"):
        render(d)


def test_images_of_the_overlay_override_the_base(tmp_path: Path) -> None:
    base(tmp_path, images=[{"name": "eldr", "newTag": "0.1.0"}])
    d = tmp_path / "overlay"
    write(
        d,
        "kustomization.yaml",
        {"resources": ["../base"], "images": [{"name": "eldr", "newName": "reg.io/eldr"}]},
    )
    objects = render(d)
    assert container(objects)["image"] == "reg.io/eldr:0.1.0"
    assert container(objects, "sidecar")["image"] == "busybox:1"


def test_config_map_generator_reads_files_and_literals(tmp_path: Path) -> None:
    d = overlay(
        tmp_path,
        configMapGenerator=[
            {
                "name": "conf",
                "files": ["a.conf", "renamed=b.txt"],
                "literals": ["K=V"],
                "options": {"disableNameSuffixHash": True},
            }
        ],
    )
    (d / "a.conf").write_text("x")
    (d / "b.txt").write_text("y")
    cm = render(d)[-1]
    assert cm["metadata"]["name"] == "conf"
    assert cm["data"] == {"a.conf": "x", "renamed": "y", "K": "V"}


def test_name_hashes_are_refused(tmp_path: Path) -> None:
    d = overlay(tmp_path, configMapGenerator=[{"name": "c", "literals": ["a=b"]}])
    with pytest.raises(KustomizeError, match="disableNameSuffixHash"):
        render(d)


@pytest.mark.parametrize("field", ["namePrefix", "commonLabels", "replacements", "components"])
def test_unsupported_fields_are_refused(tmp_path: Path, field: str) -> None:
    with pytest.raises(KustomizeError, match="unsupported kustomize fields"):
        render(overlay(tmp_path, **{field: "x"}))


def test_a_patch_for_a_missing_object_is_refused(tmp_path: Path) -> None:
    d = overlay(tmp_path, patches=[{"path": "p.yaml"}])
    write(d, "p.yaml", {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}})
    with pytest.raises(KustomizeError, match="not among the resources"):
        render(d)


def test_inline_and_targeted_patches_are_refused(tmp_path: Path) -> None:
    d = overlay(tmp_path, patches=[{"patch": "[]", "target": {"kind": "Deployment"}}])
    with pytest.raises(KustomizeError, match="only `patches: - path"):
        render(d)


def test_patch_directives_are_refused() -> None:
    with pytest.raises(KustomizeError, match=r"\$patch"):
        strategic_merge({"a": {"b": 1}}, {"a": {"$patch": "delete"}})


def test_duplicate_objects_are_refused(tmp_path: Path) -> None:
    d = overlay(tmp_path, resources=["../base", "again.yaml"])
    write(d, "again.yaml", DEPLOYMENT)
    with pytest.raises(KustomizeError, match="declared twice"):
        render(d)


# --- against the real kustomize -------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = sorted((REPO / "deploy" / "k8s" / "overlays").iterdir())


@pytest.fixture(scope="module")
def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl not on PATH: the offline renderer is not compared with kustomize")
    return found


def by_identity(objects: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Objects by kind, namespace and name (kustomize sorts its output by kind; the
    renderer keeps resource order, which `kubectl apply` does not care about)."""
    return {
        (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"]): o for o in objects
    }


def assert_renders_as_kustomize(kubectl: str, directory: Path) -> None:
    done = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    real = by_identity([o for o in yaml.safe_load_all(done.stdout) if o])
    assert by_identity(render(directory)) == real


@pytest.mark.parametrize("directory", OVERLAYS, ids=lambda d: d.name)
def test_the_overlays_render_as_kubectl_kustomize_does(kubectl: str, directory: Path) -> None:
    assert_renders_as_kustomize(kubectl, directory)


def _env_and_ports_patch(tmp_path: Path) -> Path:
    d = overlay(tmp_path, patches=[{"path": "patch.yaml"}])
    spec = {
        "containers": [
            {
                "name": "app",
                "env": [{"name": "B", "value": "3"}, {"name": "C", "value": "4"}],
                "ports": [{"name": "admin", "containerPort": 9200}],
            },
            {"name": "new", "image": "new:1"},
        ],
        "volumes": [{"name": "tmp", "emptyDir": {}}],
    }
    write(
        d,
        "patch.yaml",
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "web"},
            "spec": {"template": {"spec": spec}},
        },
    )
    return d


def _images_and_namespace(tmp_path: Path) -> Path:
    base(tmp_path, images=[{"name": "eldr", "newTag": "0.1.0"}])
    d = tmp_path / "overlay"
    write(d, "ns.yaml", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}})
    write(
        d,
        "kustomization.yaml",
        {
            "resources": ["../base", "ns.yaml"],
            "namespace": "team",
            "images": [{"name": "eldr", "newName": "reg.io/eldr"}],
        },
    )
    return d


def _config_map(tmp_path: Path) -> Path:
    d = overlay(
        tmp_path,
        configMapGenerator=[
            {
                "name": "conf",
                "files": ["a.conf", "renamed=b.txt"],
                "literals": ["K=V"],
                "options": {"disableNameSuffixHash": True},
            }
        ],
    )
    (d / "a.conf").write_text("x")
    (d / "b.txt").write_text("y")
    return d


@pytest.mark.parametrize(
    "build",
    [_env_and_ports_patch, _images_and_namespace, _config_map],
    ids=lambda f: f.__name__.strip("_"),
)
def test_the_supported_features_render_as_kubectl_kustomize_does(
    kubectl: str, tmp_path: Path, build: Callable[[Path], Path]
) -> None:
    assert_renders_as_kustomize(kubectl, build(tmp_path))
