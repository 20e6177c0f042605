"""The Tiltfile mirrors the local stack: evaluated with a Starlark interpreter and stub Tilt
builtins that record what it declares."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from starlark_go import Starlark

from eldr.dev.stack import SERVICES

REPO = Path(__file__).resolve().parents[2]
TILTFILE = REPO / "Tiltfile"


@dataclass
class Tilt:
    """Stub Tilt API: records resources; probes and links are plain dicts."""

    resources: dict[str, dict[str, Any]] = field(default_factory=dict)

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

    def globals(self) -> dict[str, Any]:
        return {
            "local_resource": self.local_resource,
            "probe": self.probe,
            "http_get_action": self.http_get_action,
            "link": self.link,
        }


@pytest.fixture(scope="module")
def tilt() -> Tilt:
    stub = Tilt()
    interpreter = Starlark(globals=stub.globals())
    interpreter.exec(TILTFILE.read_text(encoding="utf-8"), filename=str(TILTFILE))
    return stub


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
