"""The local stack's service list and configuration checks (no processes)."""

from __future__ import annotations

import pytest

from eldr.dev.stack import (
    SERVICES,
    ServiceSpec,
    Stack,
    StackConfig,
    StackError,
    missing_services,
    serve_command,
)
from eldr.serve import service_names


def test_every_listed_service_is_servable() -> None:
    assert {s.name for s in SERVICES} <= set(service_names())


def test_default_list_starts_dependencies_first() -> None:
    Stack(StackConfig(echo=False))  # validates the order; raises otherwise


def test_dependency_listed_after_its_dependent_is_rejected() -> None:
    services = (ServiceSpec("router", after=("signature",)), ServiceSpec("signature"))
    with pytest.raises(StackError, match="before its dependencies"):
        Stack(StackConfig(services=services, echo=False))


def test_replicas_for_an_unknown_service_are_rejected() -> None:
    with pytest.raises(StackError, match="unknown services"):
        Stack(StackConfig(replicas={"nope": 1}, echo=False))


def test_missing_service_stops_the_start_unless_skipped() -> None:
    services = (ServiceSpec("simdecode"), ServiceSpec("not_written_yet"))
    assert missing_services(services) == ["not_written_yet"]
    with pytest.raises(StackError, match="not_written_yet"):
        Stack(StackConfig(services=services, echo=False)).planned()
    stack = Stack(StackConfig(services=services, skip_missing=True, echo=False))
    assert [s.name for s, _ in stack.planned()] == ["simdecode"]
    assert stack.skipped == ["not_written_yet"]


def test_replica_override_zero_leaves_a_service_out() -> None:
    stack = Stack(
        StackConfig(replicas={"router": 0, "signature": 3}, echo=False, skip_missing=True)
    )
    planned = dict((s.name, n) for s, n in stack.planned())
    assert "router" not in planned
    assert "simprefill" not in planned  # 0 replicas by default
    assert planned["signature"] == 3


def test_service_environment_names_nats_namespace_port_instance_and_workers() -> None:
    stack = Stack(
        StackConfig(
            namespace="ns1",
            decoders=3,
            env={"ELDR_X": "1"},
            service_env={"simdecode": {"ELDR_Y": "2"}},
            echo=False,
        )
    )
    stack.nats_url = "nats://127.0.0.1:1"
    stack.database_url = "sqlite:///x.db"
    spec = next(s for s in SERVICES if s.name == "simdecode")
    env = stack.service_env(spec, 0, 9999)
    assert env["ELDR_NATS_URL"] == "nats://127.0.0.1:1"
    assert env["ELDR_NAMESPACE"] == "ns1"
    assert env["ELDR_METRICS_PORT"] == "9999"
    assert env["ELDR_INSTANCE_ID"] == "simdecode-0"
    assert env["ELDR_SIMDECODE_WORKERS"] == "3"
    assert env["ELDR_X"] == "1"
    assert env["ELDR_Y"] == "2"
    assert "ELDR_DATABASE_URL" not in env
    trainer = next(s for s in SERVICES if s.name == "trainer")
    assert stack.service_env(trainer, 0, 1)["ELDR_DATABASE_URL"] == "sqlite:///x.db"


def test_serve_command_runs_eldr_serve() -> None:
    assert serve_command("router")[-2:] == ["serve", "router"]
