"""The Tiltfile mirrors the local stack (local mode) and the dev overlay (k8s mode):
evaluated with a Starlark interpreter and stub Tilt builtins that record what it declares.

starlark_go converts functions, not objects, so Tilt's `os.getenv` cannot be stubbed as an
attribute: the test calls the Tiltfile's one `os.getenv(` a plain function instead."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlark_go import Starlark

from eldr.dev.stack import SERVICES
from support.kustomize import render_yaml, require_kubectl

REPO = Path(__file__).resolve().parents[3]
TILTFILE = REPO / "Tiltfile"


class TiltfileFailError(Exception):
    """The Tiltfile called fail()."""


@dataclass
class Tilt:
    """Stub Tilt API: records resources; probes and links are plain dicts."""

    env: dict[str, str] = field(default_factory=dict)
    context: str = ""
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    k8s_objects: list[dict[str, Any]] = field(default_factory=list)
    k8s_resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    images: dict[str, dict[str, Any]] = field(default_factory=dict)

    def local_resource(self, name: str, **kwargs: Any) -> None:
        assert name not in self.resources, f"resource {name} declared twice"
        self.resources[name] = kwargs

    @staticmethod
    def probe(**kwargs: Any) -> dict[str, Any]:
        return {"probe": kwargs}

    @staticmethod
    def http_get_action(
        port: int, host: str = "localhost", scheme: str = "http", path: str = ""
    ) -> dict[str, Any]:
        return {"port": port, "host": host, "scheme": scheme, "path": path}

    @staticmethod
    def link(url: str, name: str = "") -> dict[str, Any]:
        return {"url": url, "name": name}

    def os_getenv(self, name: str, default: str = "") -> str:
        return self.env.get(name, default)

    @staticmethod
    def fail(message: str) -> None:
        raise TiltfileFailError(message)

    def k8s_context(self) -> str:
        return self.context

    def docker_build(self, ref: str, context: str, **kwargs: Any) -> None:
        self.images[ref] = {"context": context, **kwargs}

    @staticmethod
    def kustomize(path: str) -> str:
        return render_yaml(REPO / path)

    def k8s_yaml(self, text: str) -> None:
        self.k8s_objects.extend(d for d in yaml.safe_load_all(text) if d)

    def k8s_resource(self, workload: str, **kwargs: Any) -> None:
        assert workload not in self.k8s_resources, f"k8s_resource {workload} declared twice"
        self.k8s_resources[workload] = kwargs

    def globals(self) -> dict[str, Any]:
        return {
            "local_resource": self.local_resource,
            "probe": self.probe,
            "http_get_action": self.http_get_action,
            "link": self.link,
            "os_getenv": self.os_getenv,
            "fail": self.fail,
            "k8s_context": self.k8s_context,
            "docker_build": self.docker_build,
            "kustomize": self.kustomize,
            "k8s_yaml": self.k8s_yaml,
            "k8s_resource": self.k8s_resource,
        }


def evaluate(stub: Tilt) -> Tilt:
    source = TILTFILE.read_text(encoding="utf-8")
    assert source.count("os.getenv(") == 1, "the stub maps exactly one os.getenv call"
    interpreter = Starlark(globals=stub.globals())
    interpreter.exec(source.replace("os.getenv(", "os_getenv("), filename=str(TILTFILE))
    return stub


@pytest.fixture(scope="module")
def tilt() -> Tilt:
    return evaluate(Tilt())


@pytest.fixture(scope="module")
def tilt_k8s() -> Tilt:
    require_kubectl()  # Tilt's kustomize() runs it, and so does the stub's
    return evaluate(Tilt(env={"ELDR_TILT_MODE": "k8s"}, context="kind-eldr"))


def command(resource: dict[str, Any]) -> list[str]:
    cmd = resource.get("serve_cmd") or resource.get("cmd")
    assert isinstance(cmd, list), f"commands are argument lists, got {cmd!r}"
    return [str(part) for part in cmd]


def service_resources(tilt: Tilt, service: str) -> dict[str, dict[str, Any]]:
    return {name: r for name, r in tilt.resources.items() if service in (r.get("labels") or [])}


def test_every_stack_service_has_resources(tilt: Tilt) -> None:
    for spec in SERVICES:
        resources = service_resources(tilt, spec.name)
        assert resources, f"no Tilt resource for service {spec.name}"
        assert sorted(resources) == [f"{spec.name}-{i}" for i in range(len(resources))]
        if spec.replicas > 0:
            assert len(resources) == spec.replicas


def test_service_resources_run_eldr_serve(tilt: Tilt) -> None:
    for spec in SERVICES:
        for resource in service_resources(tilt, spec.name).values():
            assert command(resource)[1:] == ["serve", spec.name]


def test_every_command_exists_in_the_virtualenv(tilt: Tilt) -> None:
    for name, resource in tilt.resources.items():
        executable = REPO / command(resource)[0]
        assert executable.parent == REPO / ".venv" / "bin", f"{name}: {executable}"
        assert executable.is_file(), f"{name}: {executable} does not exist"
        assert os.access(executable, os.X_OK), f"{name}: {executable} is not executable"


def test_dependencies_are_defined_resources(tilt: Tilt) -> None:
    for name, resource in tilt.resources.items():
        for dep in resource.get("resource_deps") or []:
            assert dep in tilt.resources, f"{name} depends on undefined {dep}"
            assert dep != name


def test_dependencies_follow_the_stack_order(tilt: Tilt) -> None:
    for spec in SERVICES:
        for name, resource in service_resources(tilt, spec.name).items():
            deps = set(resource.get("resource_deps") or [])
            assert "nats" in deps, name
            for after in spec.after:
                assert set(service_resources(tilt, after)) <= deps, f"{name} before {after}"
            assert ("migrate" in deps) == spec.uses_database, name


def test_services_probe_readyz_on_their_metrics_port(tilt: Tilt) -> None:
    ports = []
    for spec in SERVICES:
        for name, resource in service_resources(tilt, spec.name).items():
            env = resource["serve_env"]
            action = resource["readiness_probe"]["probe"]["http_get"]
            assert action["path"] == "/readyz"
            assert str(action["port"]) == env["ELDR_METRICS_PORT"]
            assert env["ELDR_INSTANCE_ID"] == name
            ports.append(action["port"])
    assert len(ports) == len(set(ports)), "metrics ports collide"


def test_services_reach_the_tilt_nats_and_namespace(tilt: Tilt) -> None:
    nats = command(tilt.resources["nats"])
    port = nats[nats.index("-p") + 1]
    assert "-js" in nats
    for spec in SERVICES:
        for resource in service_resources(tilt, spec.name).values():
            env = resource["serve_env"]
            assert env["ELDR_NATS_URL"].endswith(f":{port}")
            assert env["ELDR_NAMESPACE"]
            assert ("ELDR_DATABASE_URL" in env) == spec.uses_database


def test_services_not_started_by_default_wait_for_a_trigger(tilt: Tilt) -> None:
    for spec in SERVICES:
        for resource in service_resources(tilt, spec.name).values():
            assert resource.get("auto_init", True) == (spec.replicas > 0)


# --- Kubernetes mode ------------------------------------------------------------------------


def workloads(tilt: Tilt) -> dict[str, dict[str, Any]]:
    kinds = ("Deployment", "StatefulSet", "Job")
    return {o["metadata"]["name"]: o for o in tilt.k8s_objects if o["kind"] in kinds}


def test_local_mode_is_the_default_and_declares_no_kubernetes_objects(tilt: Tilt) -> None:
    assert tilt.resources
    assert not tilt.k8s_objects
    assert not tilt.k8s_resources
    assert not tilt.images


def test_k8s_mode_declares_no_local_processes(tilt_k8s: Tilt) -> None:
    assert not tilt_k8s.resources
    assert tilt_k8s.k8s_objects


def test_k8s_mode_needs_a_cluster() -> None:
    with pytest.raises(Exception, match="needs a Kubernetes cluster"):
        evaluate(Tilt(env={"ELDR_TILT_MODE": "k8s"}, context=""))


def test_an_unknown_mode_fails() -> None:
    with pytest.raises(Exception, match="must be local or k8s"):
        evaluate(Tilt(env={"ELDR_TILT_MODE": "swarm"}))


def test_k8s_mode_builds_the_image_the_manifests_use(tilt_k8s: Tilt) -> None:
    assert set(tilt_k8s.images) == {"eldr"}
    build = tilt_k8s.images["eldr"]
    assert (REPO / build["context"] / build["dockerfile"]).is_file()
    for name, obj in workloads(tilt_k8s).items():
        for container in obj["spec"]["template"]["spec"]["containers"]:
            image = container["image"]
            if image.split(":")[0] == "eldr":
                assert image == "eldr:dev", name


def test_every_stack_service_is_a_k8s_resource_with_its_workload(tilt_k8s: Tilt) -> None:
    found = workloads(tilt_k8s)
    for spec in SERVICES:
        name = f"eldr-{spec.name}"
        assert name in tilt_k8s.k8s_resources, f"no k8s_resource for {spec.name}"
        assert name in found, f"{name} is not in the dev overlay"
        args = found[name]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args == ["serve", spec.name]


def test_k8s_resources_name_workloads_of_the_overlay(tilt_k8s: Tilt) -> None:
    found = workloads(tilt_k8s)
    for name, resource in tilt_k8s.k8s_resources.items():
        assert name in found, f"k8s_resource {name} names no workload"
        for dep in resource.get("resource_deps") or []:
            assert dep in tilt_k8s.k8s_resources, f"{name} depends on undefined {dep}"


def test_k8s_dependencies_follow_the_stack_order(tilt_k8s: Tilt) -> None:
    for spec in SERVICES:
        deps = set(tilt_k8s.k8s_resources[f"eldr-{spec.name}"].get("resource_deps") or [])
        assert "eldr-nats" in deps
        assert {f"eldr-{a}" for a in spec.after} <= deps
        assert ("eldr-db-migrate" in deps) == spec.uses_database
        auto_init = tilt_k8s.k8s_resources[f"eldr-{spec.name}"].get("auto_init", True)
        assert auto_init == (spec.replicas > 0)


def test_k8s_port_forwards_reach_the_metrics_port_without_collisions(tilt_k8s: Tilt) -> None:
    local_ports = []
    found = workloads(tilt_k8s)
    for name, resource in tilt_k8s.k8s_resources.items():
        for forward in resource.get("port_forwards") or []:
            local, remote = (int(p) for p in forward.split(":"))
            local_ports.append(local)
            if name in found and found[name]["kind"] == "Deployment":
                ports = found[name]["spec"]["template"]["spec"]["containers"][0]["ports"]
                assert remote in {p["containerPort"] for p in ports}, name
    assert len(local_ports) == len(set(local_ports))
