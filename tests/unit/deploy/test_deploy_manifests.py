"""The Kubernetes manifests (deploy/k8s), the Helm values and the Dockerfile, offline: every
object `kubectl kustomize` renders validates against the Kubernetes API schemas
(kubernetes-validate, strict), every ELDR container has probes on its metrics port, requests
and limits and a command the `eldr` CLI accepts, and the pieces that name each other
(Secrets, ConfigMap keys, HPA metrics, selectors, the image's migrations directory) agree."""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from eldr.cli import build_parser
from eldr.dev.metricrefs import adapter_rules
from eldr.serve import service_names
from eldr.settings import CommonSettings
from eldr.store.settings import StoreSettings
from eldr_services.router.settings import RouterSettings
from eldr_services.signature.settings import SignatureSettings
from eldr_services.simdecode.settings import SimDecodeSettings
from eldr_services.simprefill.settings import SimPrefillSettings
from eldr_services.trainer.settings import TrainerSettings
from support.kustomize import render

REPO = Path(__file__).resolve().parents[3]
DEPLOY = REPO / "deploy"
OVERLAYS = {name: DEPLOY / "k8s" / "overlays" / name for name in ("dev", "prod")}
KUBERNETES_VERSION = "1.29"
"""Oldest Kubernetes the manifests target (autoscaling/v2, policy/v1 PDBs)."""

Obj = dict[str, Any]


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def overlay(request: pytest.FixtureRequest) -> tuple[str, list[Obj]]:
    return request.param, render(OVERLAYS[request.param])


@pytest.fixture(scope="module")
def dev() -> list[Obj]:
    return render(OVERLAYS["dev"])


@pytest.fixture(scope="module")
def prod() -> list[Obj]:
    return render(OVERLAYS["prod"])


def containers(obj: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every container and init container of an object's pod specs, at any depth."""
    for key, value in obj.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            yield from (c for c in value if isinstance(c, dict))
        elif isinstance(value, dict):
            yield from containers(value)


def of_kind(objects: list[Obj], kind: str) -> dict[str, Obj]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def eldr_workloads(objects: list[Obj]) -> Iterator[tuple[Obj, Obj, Obj]]:
    """(object, pod spec, container) of every container running the ELDR image."""
    for obj in objects:
        if obj["kind"] not in ("Deployment", "Job", "StatefulSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        for c in pod["containers"]:
            if re.match(r"^(.*/)?eldr[:@]", c["image"]):
                yield obj, pod, c


def test_every_object_validates_against_the_kubernetes_schemas(
    overlay: tuple[str, list[Obj]],
) -> None:
    name, objects = overlay
    assert objects
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{name}: {obj['kind']} {obj['metadata']['name']}: {path}: {exc.message}")


def test_the_schema_check_rejects_an_unknown_field(prod: list[Obj]) -> None:
    broken = of_kind(prod, "Deployment")["eldr-router"]
    broken = {**broken, "spec": {**broken["spec"], "replicaz": 2}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_every_object_is_in_the_overlay_namespace(overlay: tuple[str, list[Obj]]) -> None:
    name, objects = overlay
    namespace = {"dev": "eldr-dev", "prod": "eldr"}[name]
    for obj in objects:
        if obj["kind"] == "Namespace":
            assert obj["metadata"]["name"] == namespace
        else:
            assert obj["metadata"]["namespace"] == namespace, obj["metadata"]["name"]


def test_each_service_is_a_deployment_running_eldr_serve(overlay: tuple[str, list[Obj]]) -> None:
    name, objects = overlay
    deployments = of_kind(objects, "Deployment")
    expected = {"signature", "router", "trainer"} | (
        {"simdecode", "simprefill"} if name == "dev" else set()
    )
    assert {d.removeprefix("eldr-") for d in deployments} == expected
    for service in expected:
        (c,) = deployments[f"eldr-{service}"]["spec"]["template"]["spec"]["containers"]
        assert c["args"] == ["serve", service]
        assert service in service_names()


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def test_every_eldr_command_is_accepted_by_the_cli(
    overlay: tuple[str, list[Obj]], parser: argparse.ArgumentParser
) -> None:
    for obj, _, c in eldr_workloads(overlay[1]):
        args = parser.parse_args(c["args"])
        assert callable(args.func), obj["metadata"]["name"]


def test_containers_have_probes_on_the_metrics_port(overlay: tuple[str, list[Obj]]) -> None:
    config = of_kind(overlay[1], "ConfigMap")["eldr-config"]["data"]
    metrics_port = int(config["ELDR_METRICS_PORT"])
    for obj, _, c in eldr_workloads(overlay[1]):
        if obj["kind"] == "Job":
            continue  # a one-shot command serves no HTTP
        name = obj["metadata"]["name"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert ports["metrics"] == metrics_port, name
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}, name
        assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}, name
        assert c["startupProbe"]["httpGet"]["path"] == "/healthz", name


def quantity(value: str) -> float:
    units = {"m": 1e-3, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "": 1}
    number, unit = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value)).groups()  # type: ignore[union-attr]
    return float(number) * units[unit]


def test_every_container_has_requests_within_limits(overlay: tuple[str, list[Obj]]) -> None:
    for obj in overlay[1]:
        if obj["kind"] not in ("Deployment", "Job", "StatefulSet"):
            continue
        for c in containers(obj):
            resources = c["resources"]
            for what in ("cpu", "memory"):
                request = quantity(resources["requests"][what])
                limit = quantity(resources["limits"][what])
                assert 0 < request <= limit, (obj["metadata"]["name"], what)


def test_eldr_containers_run_unprivileged(overlay: tuple[str, list[Obj]]) -> None:
    for obj, pod, c in eldr_workloads(overlay[1]):
        name = obj["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["automountServiceAccountToken"] is False, name
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, name
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"], name


def test_instance_ids_are_pod_names(overlay: tuple[str, list[Obj]]) -> None:
    for obj, _, c in eldr_workloads(overlay[1]):
        if obj["kind"] == "Job":
            continue
        env = {e["name"]: e for e in c["env"]}
        assert env["ELDR_INSTANCE_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_router_and_signature_scale_with_hpas_on_cpu_and_decision_rate(
    overlay: tuple[str, list[Obj]],
) -> None:
    objects = overlay[1]
    hpas = of_kind(objects, "HorizontalPodAutoscaler")
    deployments = of_kind(objects, "Deployment")
    served = {
        rule["name"]["as"] for rule in adapter_rules(DEPLOY / "prometheus" / "adapter-values.yaml")
    }
    assert set(hpas) == {"eldr-router", "eldr-signature"}
    for name, hpa in hpas.items():
        assert hpa["spec"]["scaleTargetRef"]["name"] == name
        assert "replicas" not in deployments[name]["spec"], "the HPA owns the replica count"
        kinds = {m["type"] for m in hpa["spec"]["metrics"]}
        assert "Resource" in kinds
        for metric in hpa["spec"]["metrics"]:
            if metric["type"] in ("Pods", "External"):
                metric_name = metric[metric["type"].lower()]["metric"]["name"]
                assert "decisions_per_second" in metric_name
                assert metric_name in served, f"prometheus-adapter does not serve {metric_name}"


def test_the_trainer_is_a_singleton(overlay: tuple[str, list[Obj]]) -> None:
    trainer = of_kind(overlay[1], "Deployment")["eldr-trainer"]
    assert trainer["spec"]["replicas"] == 1
    assert trainer["spec"]["strategy"]["type"] == "Recreate"
    assert "eldr-trainer" not in of_kind(overlay[1], "HorizontalPodAutoscaler")


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_every_service_has_a_disruption_budget(overlay: tuple[str, list[Obj]]) -> None:
    pdbs = of_kind(overlay[1], "PodDisruptionBudget")
    for service in ("router", "signature", "trainer"):
        deployment = of_kind(overlay[1], "Deployment")[f"eldr-{service}"]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        matching = [
            p for p in pdbs.values() if selects(p["spec"]["selector"]["matchLabels"], labels)
        ]
        assert len(matching) == 1, service


def test_the_migration_job_runs_db_upgrade(overlay: tuple[str, list[Obj]]) -> None:
    job = of_kind(overlay[1], "Job")["eldr-db-migrate"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["args"] == ["db", "upgrade"]
    env = {e["name"]: e for e in c["env"]}
    assert env["ELDR_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "eldr-db"


def secret_refs(objects: list[Obj]) -> set[tuple[str, str]]:
    refs = set()
    for obj in objects:
        if obj["kind"] in ("Deployment", "Job", "StatefulSet"):
            for c in containers(obj):
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("secretKeyRef")
                    if ref:
                        refs.add((ref["name"], ref["key"]))
    return refs


def test_dev_secrets_provide_every_key_the_pods_read(dev: list[Obj]) -> None:
    secrets = of_kind(dev, "Secret")
    for name, key in secret_refs(dev):
        assert name in secrets, f"no Secret {name}"
        assert key in secrets[name]["stringData"], f"Secret {name} has no key {key}"


def test_prod_commits_no_secrets_and_docs_list_those_it_reads(prod: list[Obj]) -> None:
    assert not of_kind(prod, "Secret")
    docs = (REPO / "docs" / "DEPLOY.md").read_text()
    for name, key in secret_refs(prod):
        assert f"`{name}`" in docs, f"docs/DEPLOY.md does not say how to create {name}"
        assert f"--from-literal={key}=" in docs, f"docs/DEPLOY.md does not create key {key}"


def test_each_service_logs_into_nats_as_its_own_user(dev: list[Obj]) -> None:
    for obj, _, c in eldr_workloads(dev):
        if obj["kind"] == "Job":
            continue
        env = {e["name"]: e for e in c["env"]}
        service = c["args"][1]
        secret = env["ELDR_USER"]["valueFrom"]["secretKeyRef"]["name"]
        assert env["ELDR_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == secret
        assert secret == f"nats-eldr-{service}"
        user = of_kind(dev, "Secret")[secret]["stringData"]["user"]
        auth = (OVERLAYS["dev"] / "auth.conf").read_text()
        assert f"--user {user}={service}" in auth, f"{user} has no {service} role in auth.conf"


def test_the_dev_nats_server_gets_every_password_of_its_users(dev: list[Obj]) -> None:
    nats = of_kind(dev, "StatefulSet")["eldr-nats"]
    (c,) = nats["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c["env"]}
    auth = (OVERLAYS["dev"] / "auth.conf").read_text()
    referenced = set(re.findall(r"password: \$(\w+)", auth))
    assert set(env) == referenced
    config = of_kind(dev, "ConfigMap")["eldr-nats-config"]["data"]
    assert config["auth.conf"] == auth


SETTINGS_CLASSES = (
    CommonSettings,
    StoreSettings,
    SignatureSettings,
    RouterSettings,
    TrainerSettings,
    SimDecodeSettings,
    SimPrefillSettings,
)


def known_settings() -> set[str]:
    return {f"ELDR_{name.upper()}" for cls in SETTINGS_CLASSES for name in cls.model_fields}


def test_every_configured_setting_exists(overlay: tuple[str, list[Obj]]) -> None:
    """The services ignore unknown ELDR_ variables, so a misspelt key would do nothing."""
    known = known_settings()
    for obj in overlay[1]:
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == "eldr-config":
            assert set(obj["data"]) <= known, sorted(set(obj["data"]) - known)
    for _, _, c in eldr_workloads(overlay[1]):
        names = {e["name"] for e in c.get("env", [])}
        assert names <= known, sorted(names - known)


def test_the_shared_config_names_the_in_cluster_nats(overlay: tuple[str, list[Obj]]) -> None:
    name, objects = overlay
    config = of_kind(objects, "ConfigMap")["eldr-config"]["data"]
    scheme = {"dev": "nats", "prod": "tls"}[name]
    assert config["ELDR_NATS_URL"] == f"{scheme}://eldr-nats:4222"
    assert config["ELDR_MIGRATE_ON_START"] == "false", "the Job migrates"


def test_routers_and_the_trainer_read_one_routing_profile(overlay: tuple[str, list[Obj]]) -> None:
    """The trainer's shadow gate judges a refit by routing as the routers do: both take the
    routing profile from the shared ConfigMap, and neither overrides it."""
    objects = overlay[1]
    config = of_kind(objects, "ConfigMap")["eldr-config"]["data"]
    routing = {"ELDR_ROUTING_PROFILE", "ELDR_POLICY", "ELDR_TAU", "ELDR_LOAD_MEASURE"}
    assert "ELDR_ROUTING_PROFILE" in config
    env = {k: v for k, v in config.items() if k in routing}
    router = RouterSettings(**{k.removeprefix("ELDR_").lower(): v for k, v in env.items()})
    trainer = TrainerSettings(**{k.removeprefix("ELDR_").lower(): v for k, v in env.items()})
    assert router.routing_profile == trainer.routing_profile
    seen = set()
    for obj, _, c in eldr_workloads(objects):
        name = obj["metadata"]["name"]
        if name.endswith(("router", "trainer")):
            seen.add(name.rsplit("-", 1)[-1])
            refs = [r["configMapRef"]["name"] for r in c.get("envFrom", []) if "configMapRef" in r]
            assert "eldr-config" in refs, name
            assert not {e["name"] for e in c.get("env", [])} & routing, name
    assert seen == {"router", "trainer"}


def test_prod_requires_tls_and_authentication_to_nats_by_default(prod: list[Obj]) -> None:
    """Issue 15, finding 12: TLS to NATS (CA from a Secret) and NATS users required by
    default in the production overlay; the NATS values serve TLS from a Secret."""
    config = of_kind(prod, "ConfigMap")["eldr-config"]["data"]
    assert config["ELDR_NATS_URL"].startswith("tls://")
    assert config["ELDR_REQUIRE_AUTH"] == "true"
    ca_file = Path(config["ELDR_TLS_CA_FILE"])
    for obj, pod, c in eldr_workloads(prod):
        if obj["kind"] == "Job":
            continue  # migrations talk to the database only
        mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
        assert str(ca_file.parent) in mounts, obj["metadata"]["name"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == mounts[str(ca_file.parent)]]
        assert volume["secret"]["secretName"] == "eldr-nats-ca"
        assert {i["path"] for i in volume["secret"]["items"]} == {ca_file.name}
    values = yaml.safe_load((DEPLOY / "nats" / "values.yaml").read_text())
    tls = values["config"]["nats"]["tls"]
    assert tls["enabled"] is True
    docs = (REPO / "docs" / "DEPLOY.md").read_text()
    for secret in ("eldr-nats-ca", tls["secretName"]):
        assert f"`{secret}`" in docs, f"docs/DEPLOY.md does not say how to create {secret}"


def test_each_service_connects_with_its_users_inbox_prefix(overlay: tuple[str, list[Obj]]) -> None:
    """Issue 15, finding 6: the generated permissions allow each user its role's inbox
    prefix only; every Deployment sets that prefix."""
    from eldr.bus.permissions import NatsUser, command_of

    objects = overlay[1]
    namespace = of_kind(objects, "ConfigMap")["eldr-config"]["data"]["ELDR_NAMESPACE"]
    auth = (OVERLAYS["dev"] / "auth.conf").read_text()
    users = {u.name: u for u in (NatsUser.parse(a) for a in command_of(auth) if "=" in a)}
    for obj, _, c in eldr_workloads(objects):
        if obj["kind"] == "Job":
            continue
        env = {e["name"]: e for e in c["env"]}
        secret = env["ELDR_USER"]["valueFrom"]["secretKeyRef"]["name"]
        user = users[secret.removeprefix("nats-")]
        assert env["ELDR_INBOX_PREFIX"]["value"] == user.inbox_prefix(namespace), secret


def test_network_policies_deny_by_default_and_admit_the_database_clients(
    overlay: tuple[str, list[Obj]],
) -> None:
    policies = of_kind(overlay[1], "NetworkPolicy")
    deny = policies["eldr-default-deny"]["spec"]
    assert deny["policyTypes"] == ["Ingress", "Egress"]
    assert "ingress" not in deny
    assert "egress" not in deny
    database = policies["eldr-egress-database"]["spec"]["podSelector"]["matchLabels"]
    for obj, _, _ in eldr_workloads(overlay[1]):
        labels = obj["spec"]["template"]["metadata"]["labels"]
        assert selects(policies["eldr-default-deny"]["spec"]["podSelector"]["matchLabels"], labels)
        env = {e["name"] for c in containers(obj) for e in c.get("env", [])}
        assert selects(database, labels) == ("ELDR_DATABASE_URL" in env), obj["metadata"]["name"]


# --- Helm values --------------------------------------------------------------------------------


def test_nats_values_ask_for_a_three_node_jetstream_cluster_with_room_for_the_streams(
    prod: list[Obj],
) -> None:
    values = yaml.safe_load((DEPLOY / "nats" / "values.yaml").read_text())
    config = values["config"]
    assert {k: config["cluster"][k] for k in ("enabled", "replicas")} == {
        "enabled": True,
        "replicas": 3,
    }
    # A frozen peer's routes (and its clients' queue-group subscriptions) are cut within ~3 s.
    assert config["cluster"]["merge"] == {"ping_interval": "<< 1s >>", "ping_max": 2}
    assert config["jetstream"]["enabled"] is True
    assert values["promExporter"]["enabled"] is True
    # JetStream reserves every stream's max_bytes on each node that holds a replica.
    data = of_kind(prod, "ConfigMap")["eldr-config"]["data"]
    defaults = CommonSettings.model_fields
    total = 64 << 20  # PARTITIONS, fixed in eldr.bus.topology
    for key in ("blocks", "prefill", "decisions", "load", "profiles", "partitions", "dlq"):
        name = f"{key}_max_bytes"
        total += int(data.get(f"ELDR_{name.upper()}", defaults[name].default))
    assert int(data["ELDR_STREAM_REPLICAS"]) == 3
    assert quantity(config["jetstream"]["fileStore"]["pvc"]["size"]) >= 1.2 * total


def test_postgresql_values_take_passwords_from_the_documented_secret() -> None:
    values = yaml.safe_load((DEPLOY / "postgresql" / "values.yaml").read_text())
    assert values["auth"]["existingSecret"] == "eldr-postgresql"
    assert values["auth"]["database"] == "eldr"
    assert values["primary"]["persistence"]["enabled"] is True


def test_the_podmonitor_scrapes_the_metrics_port() -> None:
    text = (DEPLOY / "prometheus" / "podmonitor.yaml").read_text()
    (monitor,) = [d for d in yaml.safe_load_all(text) if d is not None]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "eldr"}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


# --- the image ----------------------------------------------------------------------------------


def dockerfile_stages() -> list[list[str]]:
    """Instructions per stage, continuation lines joined."""
    text = (DEPLOY / "Dockerfile").read_text()
    lines = []
    for raw in re.sub(r"\\\n", " ", text).splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            lines.append(line)
    stages: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(line)
    return stages


def instructions(stage: list[str], keyword: str) -> list[str]:
    return [line[len(keyword) + 1 :] for line in stage if line.upper().startswith(keyword + " ")]


def env_of(stage: list[str]) -> dict[str, str]:
    env = {}
    for line in instructions(stage, "ENV"):
        for part in shlex.split(line):
            key, _, value = part.partition("=")
            env[key] = value
    return env


def test_the_image_builds_wheels_in_one_stage_and_runs_unprivileged_in_another() -> None:
    builder, runtime = dockerfile_stages()
    assert builder[0].endswith("AS builder")
    assert env_of(builder)["HNSWLIB_NO_NATIVE"] == "1", "-march=native would tie it to one CPU"
    assert any("--no-binary hnswlib" in line for line in instructions(builder, "RUN"))
    (user,) = instructions(runtime, "USER")
    assert not user.startswith(("0", "root"))
    assert instructions(runtime, "ENTRYPOINT") == ['["eldr"]']
    installs = [line for line in instructions(runtime, "RUN") if "pip install" in line]
    assert installs
    assert all("--no-index" in line for line in installs), "nothing downloaded in the image"


def test_the_image_carries_the_migrations_where_eldr_looks_for_them() -> None:
    _, runtime = dockerfile_stages()
    copies = {src: dst for src, dst in (c.split() for c in instructions(runtime, "COPY"))}
    assert copies["migrations"] == env_of(runtime)["ELDR_MIGRATIONS_DIR"]
    assert (REPO / "migrations" / "env.py").is_file()


def test_the_build_context_filter_keeps_what_the_dockerfile_copies() -> None:
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for stage in dockerfile_stages():
        for copy in instructions(stage, "COPY"):
            if copy.startswith("--from"):
                continue
            for source in copy.split()[:-1]:
                assert source.rstrip("/") in kept, f"{source} is filtered out of the context"
