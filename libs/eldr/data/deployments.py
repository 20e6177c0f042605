"""Load decode deployments from `deployments.toml` (package data) or a user file.

The packaged catalog is `deployments.toml` (spec-derived: datasheets, model configs, one
published measurement) plus `measured_deployments.toml`, the deployments `eldr bench-moe-step fit`
wrote from a GPU microbenchmark. The measured file holds `[deployment.*]` tables only; they
name the models and GPUs of the spec file, and may set `expert_s`, `token_s` and a
`provenance` table (docs/COST_MODEL.md, "Measuring an MoE decode step").
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from eldr.core.costmodel import Deployment, GpuSpec, ModelSpec
from eldr.errors import InputError

DEFAULT_DEPLOYMENT_FOR_TRACES = "llama4-maverick-fp8-8xh200"
"""The deployment matching the pbc-llama4-mmlu traces' own model (Llama-4-Maverick)."""

SPEC_DEPLOYMENTS_FILE = "deployments.toml"
MEASURED_DEPLOYMENTS_FILE = "measured_deployments.toml"


class DeploymentError(InputError):
    """A deployment file is malformed or names something it does not define."""


@dataclass(frozen=True)
class DeploymentCatalog:
    gpus: dict[str, GpuSpec]
    models: dict[str, ModelSpec]
    deployments: dict[str, Deployment]
    source: str

    def get(self, name: str) -> Deployment:
        try:
            return self.deployments[name]
        except KeyError:
            known = ", ".join(sorted(self.deployments))
            raise DeploymentError(f"unknown deployment {name!r} (known: {known})") from None


def _require(table: dict[str, Any], key: str, where: str) -> Any:
    if key not in table:
        raise DeploymentError(f"{where}: missing key {key!r}")
    return table[key]


def parse_catalog(doc: dict[str, Any], source: str) -> DeploymentCatalog:
    """Build deployments from a parsed TOML document."""
    if doc.get("schema") != 1:
        raise DeploymentError(f"{source}: expected schema = 1, got {doc.get('schema')!r}")
    per_layer_s = float(_require(doc.get("overhead", {}), "per_layer_s", f"{source} [overhead]"))
    try:
        gpus = {
            key: GpuSpec(
                name=str(_require(t, "name", f"{source} [gpu.{key}]")),
                hbm_bytes_per_s=float(_require(t, "hbm_bytes_per_s", f"[gpu.{key}]")),
                achievable_fraction=float(_require(t, "achievable_fraction", f"[gpu.{key}]")),
                source=str(t.get("source", "")),
            )
            for key, t in doc.get("gpu", {}).items()
        }
        models = {}
        for key, t in doc.get("model", {}).items():
            where = f"{source} [model.{key}]"
            models[key] = ModelSpec(
                name=str(_require(t, "name", where)),
                num_layers=int(_require(t, "num_layers", where)),
                num_moe_layers=int(_require(t, "num_moe_layers", where)),
                num_experts=int(_require(t, "num_experts", where)),
                top_k=int(_require(t, "top_k", where)),
                expert_params=float(_require(t, "expert_params", where)),
                expert_bits_per_param=float(_require(t, "expert_bits_per_param", where)),
                dense_params=float(_require(t, "dense_params", where)),
                dense_bits_per_param=float(_require(t, "dense_bits_per_param", where)),
                kv_bytes_per_token=float(_require(t, "kv_bytes_per_token", where)),
                source=str(t.get("source", "")),
            )
        deployments = {}
        for key, t in doc.get("deployment", {}).items():
            where = f"{source} [deployment.{key}]"
            model_key = str(_require(t, "model", where))
            gpu_key = str(_require(t, "gpu", where))
            if model_key not in models:
                raise DeploymentError(f"{where}: unknown model {model_key!r}")
            if gpu_key not in gpus:
                raise DeploymentError(f"{where}: unknown gpu {gpu_key!r}")
            model = models[model_key]
            overhead_s = float(t.get("overhead_s", per_layer_s * model.num_layers))
            provenance = t.get("provenance", {})
            if not isinstance(provenance, dict):
                raise DeploymentError(f"{where}: provenance must be a table")
            deployments[key] = Deployment(
                name=key,
                model=model,
                gpu=gpus[gpu_key],
                gpus_per_worker=int(_require(t, "gpus_per_worker", where)),
                overhead_s=overhead_s,
                description=str(t.get("description", "")),
                expert_s=float(t["expert_s"]) if "expert_s" in t else None,
                token_s=float(t.get("token_s", 0.0)),
                provenance=tuple((str(k), str(v)) for k, v in provenance.items()),
            )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, DeploymentError):
            raise
        raise DeploymentError(f"{source}: {exc}") from exc
    return DeploymentCatalog(gpus=gpus, models=models, deployments=deployments, source=source)


def _parse_toml(text: str, source: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise DeploymentError(f"{source}: not valid TOML: {exc}") from exc


def merge_measured(doc: dict[str, Any], measured: dict[str, Any], source: str) -> dict[str, Any]:
    """`doc` with the `[deployment.*]` tables of a measured-deployments document added.

    A measured file may hold nothing but `schema` and deployments, and may not redefine a
    deployment of `doc` (the spec-derived numbers never change to match a measurement).
    """
    if measured.get("schema") != 1:
        raise DeploymentError(f"{source}: expected schema = 1, got {measured.get('schema')!r}")
    extra = set(measured) - {"schema", "deployment"}
    if extra:
        raise DeploymentError(
            f"{source}: only [deployment.*] tables allowed, found {sorted(extra)}"
        )
    merged = dict(doc)
    deployments = dict(doc.get("deployment", {}))
    for name, table in measured.get("deployment", {}).items():
        if name in deployments:
            raise DeploymentError(f"{source}: deployment {name!r} is already defined")
        deployments[name] = table
    merged["deployment"] = deployments
    return merged


def load_catalog(path: Path | None = None, measured_path: Path | None = None) -> DeploymentCatalog:
    """Read the packaged deployments (spec-derived plus measured), or those in `path`.

    measured_path: a measured-deployments file to use instead of the packaged one (with
    `path`, in addition to it).
    """
    if path is None:
        data = resources.files("eldr.data")
        source = f"eldr/data/{SPEC_DEPLOYMENTS_FILE}"
        doc = _parse_toml(data.joinpath(SPEC_DEPLOYMENTS_FILE).read_text("utf-8"), source)
        packaged = data.joinpath(MEASURED_DEPLOYMENTS_FILE)
        if measured_path is None and packaged.is_file():
            where = f"eldr/data/{MEASURED_DEPLOYMENTS_FILE}"
            doc = merge_measured(doc, _parse_toml(packaged.read_text("utf-8"), where), where)
    else:
        source = str(path)
        doc = _parse_toml(Path(path).read_text("utf-8"), source)
    if measured_path is not None:
        where = str(measured_path)
        measured = _parse_toml(Path(measured_path).read_text("utf-8"), where)
        doc = merge_measured(doc, measured, where)
    return parse_catalog(doc, source)
