"""Render a kustomize overlay offline, for the subset of kustomize that deploy/k8s uses.

No kustomize binary is needed: tests render every overlay and validate the result, and
`eldr deploy render` prints it. Hand-written because the real kustomize cannot be installed
from the registries this project uses (not in Debian bookworm, not on PyPI or npm, and
Debian's Go, 1.19, is older than recent kustomize releases need); where `kubectl` is
installed, the tests check that `kubectl kustomize` renders every overlay to the same
objects (the output order differs: kustomize sorts by kind). The subset is small on
purpose, and anything outside it raises `KustomizeError` instead of being rendered
differently from `kubectl kustomize`:

- `resources`: YAML files (several documents each) and directories with a kustomization;
- `namespace`: set on every namespaced object (a Namespace object must already have it);
- `images`: `name` -> `newName` / `newTag` / `digest` in every container and init container;
- `patches` with `path` only: strategic-merge patches naming their target by apiVersion,
  kind and metadata.name. Maps merge; `null` deletes a key; lists of containers, init
  containers, volumes, env and imagePullSecrets merge by `name`, volume mounts by
  `mountPath`, ports by `containerPort` (or `port`), in kustomize's order (the patch's
  items first, then the base's others); every other list is replaced;
- `configMapGenerator` with `files` and/or `literals` and `disableNameSuffixHash: true`.

Order follows kustomize: bases are rendered first (with their own transformers), then the
overlay's generators, patches, namespace and images.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

KUSTOMIZATION_FILE = "kustomization.yaml"
_ALLOWED_KEYS = frozenset(
    {"apiVersion", "kind", "resources", "namespace", "images", "patches", "configMapGenerator"}
)
_CLUSTER_SCOPED = frozenset(
    {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "CustomResourceDefinition",
        "PersistentVolume",
        "StorageClass",
        "PriorityClass",
        "IngressClass",
        "ValidatingWebhookConfiguration",
        "MutatingWebhookConfiguration",
    }
)
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
}

Resource = dict[str, Any]


class KustomizeError(ValueError):
    """The overlay uses kustomize features outside the supported subset, or is broken."""


def load_documents(path: Path) -> list[Resource]:
    """The non-empty YAML documents of `path`, each a mapping with apiVersion/kind/name."""
    import yaml  # type: ignore[import-untyped]  # dev dependency, imported when used

    with path.open(encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict) or not {"apiVersion", "kind", "metadata"} <= set(doc):
            raise KustomizeError(f"{path}: every document needs apiVersion, kind and metadata")
        if not isinstance(doc["metadata"], dict) or not doc["metadata"].get("name"):
            raise KustomizeError(f"{path}: a {doc['kind']} without metadata.name")
    return docs


def render(directory: Path) -> list[Resource]:
    """The objects the kustomization in `directory` produces, in resource order."""
    return _build(directory.resolve(), stack=())


def render_yaml(directory: Path) -> str:
    import yaml

    return str(yaml.safe_dump_all(render(directory), sort_keys=False, default_flow_style=False))


def _build(directory: Path, stack: tuple[Path, ...]) -> list[Resource]:
    if directory in stack:
        raise KustomizeError(f"kustomization cycle through {directory}")
    kfile = directory / KUSTOMIZATION_FILE
    if not kfile.is_file():
        raise KustomizeError(f"no {KUSTOMIZATION_FILE} in {directory}")
    import yaml

    with kfile.open(encoding="utf-8") as f:
        spec = yaml.safe_load(f) or {}
    if not isinstance(spec, dict):
        raise KustomizeError(f"{kfile}: not a mapping")
    unknown = set(spec) - _ALLOWED_KEYS
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported kustomize fields {sorted(unknown)}")

    objects: list[Resource] = []
    for entry in _list(kfile, spec, "resources"):
        path = (directory / str(entry)).resolve()
        if path.is_dir():
            objects.extend(_build(path, (*stack, directory)))
        elif path.is_file():
            objects.extend(load_documents(path))
        else:
            raise KustomizeError(f"{kfile}: resource {entry} does not exist")
    for generator in _list(kfile, spec, "configMapGenerator"):
        objects.append(_config_map(kfile, directory, generator))
    _check_unique(kfile, objects)
    for patch_entry in _list(kfile, spec, "patches"):
        if not isinstance(patch_entry, dict) or set(patch_entry) != {"path"}:
            raise KustomizeError(f"{kfile}: only `patches: - path: FILE` is supported")
        for patch in load_documents(directory / str(patch_entry["path"])):
            target = _find(objects, patch)
            if target is None:
                raise KustomizeError(
                    f"{kfile}: patch {patch_entry['path']} targets {_ident(patch)}, "
                    "which is not among the resources"
                )
            objects[objects.index(target)] = strategic_merge(target, patch)
    namespace = spec.get("namespace")
    if namespace is not None:
        _set_namespace(kfile, objects, str(namespace))
    for image in _list(kfile, spec, "images"):
        _set_image(kfile, objects, image)
    return objects


def _list(kfile: Path, spec: Mapping[str, Any], key: str) -> list[Any]:
    value = spec.get(key, [])
    if not isinstance(value, list):
        raise KustomizeError(f"{kfile}: {key} must be a list")
    return value


def _ident(obj: Mapping[str, Any]) -> str:
    return f"{obj['apiVersion']} {obj['kind']} {obj['metadata']['name']}"


def _check_unique(kfile: Path, objects: list[Resource]) -> None:
    seen: set[tuple[str, str, str]] = set()
    for obj in objects:
        key = (_group(obj["apiVersion"]), obj["kind"], obj["metadata"]["name"])
        if key in seen:
            raise KustomizeError(f"{kfile}: {_ident(obj)} is declared twice")
        seen.add(key)


def _group(api_version: str) -> str:
    return api_version.rpartition("/")[0] if "/" in api_version else ""


def _find(objects: list[Resource], patch: Resource) -> Resource | None:
    for obj in objects:
        if (
            _group(obj["apiVersion"]) == _group(patch["apiVersion"])
            and obj["kind"] == patch["kind"]
            and obj["metadata"]["name"] == patch["metadata"]["name"]
        ):
            return obj
    return None


def _config_map(kfile: Path, directory: Path, generator: object) -> Resource:
    if not isinstance(generator, dict):
        raise KustomizeError(f"{kfile}: configMapGenerator entries must be mappings")
    unknown = set(generator) - {"name", "files", "literals", "options"}
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported configMapGenerator fields {sorted(unknown)}")
    options = generator.get("options") or {}
    if options != {"disableNameSuffixHash": True}:
        raise KustomizeError(
            f"{kfile}: configMapGenerator needs options.disableNameSuffixHash: true (name "
            "hashes are not supported)"
        )
    data: dict[str, str] = {}
    for entry in generator.get("files", []):
        key, sep, rel = str(entry).partition("=")
        if not sep:
            key, rel = Path(rel or key).name, key
        data[key] = (directory / rel).read_text(encoding="utf-8")
    for entry in generator.get("literals", []):
        key, sep, value = str(entry).partition("=")
        if not sep:
            raise KustomizeError(f"{kfile}: literal {entry!r} is not KEY=VALUE")
        data[key] = value
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": generator["name"]},
        "data": data,
    }


def strategic_merge(base: Any, patch: Any) -> Any:
    """`patch` merged into a copy of `base` (the subset described in the module docstring)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = copy.deepcopy(base)
        for key, value in patch.items():
            if isinstance(key, str) and key.startswith("$"):
                raise KustomizeError(f"patch directive {key} is not supported")
            if value is None:
                merged.pop(key, None)
            elif key in merged and isinstance(value, list) and isinstance(merged[key], list):
                merged[key] = _merge_list(key, merged[key], value)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    return copy.deepcopy(patch)


def _merge_list(key: str, base: list[Any], patch: list[Any]) -> list[Any]:
    merge_key = _MERGE_KEYS.get(key)
    if key == "ports":
        merge_key = "containerPort" if all("containerPort" in p for p in base + patch) else "port"
    if merge_key is None or not all(isinstance(i, dict) and merge_key in i for i in base + patch):
        return copy.deepcopy(patch)
    # kustomize's order (checked against `kubectl kustomize` in tests): the patch's items
    # first, in its order, each merged into its base item, then the base items it did not
    # name. It matters where order does (env entries referring to earlier ones).
    rest = copy.deepcopy(base)
    merged = []
    for item in patch:
        for i, existing in enumerate(rest):
            if existing[merge_key] == item[merge_key]:
                merged.append(strategic_merge(rest.pop(i), item))
                break
        else:
            merged.append(copy.deepcopy(item))
    return merged + rest


def _set_namespace(kfile: Path, objects: list[Resource], namespace: str) -> None:
    for obj in objects:
        if obj["kind"] == "Namespace":
            if obj["metadata"]["name"] != namespace:
                raise KustomizeError(
                    f"{kfile}: Namespace {obj['metadata']['name']} differs from namespace "
                    f"{namespace} (renaming is not supported)"
                )
        elif obj["kind"] not in _CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace


def containers(obj: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """Every container and init container of an object's pod specs, at any depth."""
    for key, value in obj.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            yield from (c for c in value if isinstance(c, dict))
        elif isinstance(value, dict):
            yield from containers(value)


def _image_name(image: str) -> str:
    name = image.split("@", 1)[0]
    slash = name.rfind("/")
    colon = name.rfind(":")
    return name[:colon] if colon > slash else name


def _set_image(kfile: Path, objects: list[Resource], image: object) -> None:
    if not isinstance(image, dict) or "name" not in image:
        raise KustomizeError(f"{kfile}: images entries need a name")
    unknown = set(image) - {"name", "newName", "newTag", "digest"}
    if unknown:
        raise KustomizeError(f"{kfile}: unsupported images fields {sorted(unknown)}")
    for obj in objects:
        for container in containers(obj):
            current = str(container.get("image", ""))
            if _image_name(current) != image["name"]:
                continue
            name = image.get("newName", image["name"])
            if "digest" in image:
                container["image"] = f"{name}@{image['digest']}"
            elif "newTag" in image:
                container["image"] = f"{name}:{image['newTag']}"
            else:
                rest = current[len(_image_name(current)) :]
                container["image"] = f"{name}{rest}"
