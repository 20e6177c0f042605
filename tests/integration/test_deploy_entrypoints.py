"""The container image's entry points, exercised without Docker (no engine runs here).

The test lays out what the image holds: the `eldr` and `eldr_services` packages as a wheel
installs them (no migrations/ next to them), migrations/ where deploy/Dockerfile copies it,
the runtime stage's ENV. It then runs the commands of the dev overlay's containers, each
with that container's environment (its ConfigMap, Secrets and pod-name fields as Kubernetes
would resolve them), against a nats-server configured like the overlay's (the generated
per-service users and permissions) and the test PostgreSQL:

- the migration Job (`eldr db upgrade`) must finish with status 0;
- each Deployment (`eldr serve signature|trainer|simdecode|router|simprefill`) must answer
  its readiness and liveness probes and /metrics on its metrics port;
- the simulated workload must be routed; `eldr refit` and `eldr partitions activate` (a
  rollback), run with the operator's NATS user, must reach the routers;
- every metric the dashboard, the alert rules and the adapter rules use (other than the
  NATS exporter's and Prometheus's own) must be on the running services' /metrics;
- every process must exit 0 on SIGTERM within its termination grace period, and
  nats-server must log no permission violation.

Only what cannot be the same outside a cluster is replaced: the NATS and database URLs
(in-cluster DNS names), the metrics port (pods have a network namespace each) and the NATS
store directory (the pod's volume).
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from eldr.bus.permissions import inbox_prefix
from eldr.cli import COMMAND_MODULES
from eldr.dev.metricrefs import (
    NATS_EXPORTER_METRICS,
    PROMETHEUS_SERIES,
    adapter_metric_names,
    dashboard_metric_names,
    rules_metric_names,
)
from eldr.dev.natsserver import EmbeddedNats, free_port
from support.kustomize import render

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DEV_OVERLAY = DEPLOY / "k8s" / "overlays" / "dev"
READY_TIMEOUT_S = 60.0

Obj = dict[str, Any]


@dataclass(frozen=True)
class Image:
    root: Path
    site: Path
    env: dict[str, str]


def runtime_env(dockerfile: Path) -> dict[str, str]:
    """ENV of the Dockerfile's last stage."""
    text = dockerfile.read_text().replace("\\\n", " ")
    stages = text.split("\nFROM ")
    env: dict[str, str] = {}
    for line in stages[-1].splitlines():
        if line.strip().startswith("ENV "):
            for part in shlex.split(line.strip()[4:]):
                key, _, value = part.partition("=")
                env[key] = value
    return env


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Image:
    root = tmp_path_factory.mktemp("image")
    site = root / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "libs" / "eldr", site / "eldr", ignore=ignore)
    shutil.copytree(REPO / "services", site / "eldr_services", ignore=ignore)
    env = runtime_env(REPO / "deploy" / "Dockerfile")
    migrations = root / env["ELDR_MIGRATIONS_DIR"].lstrip("/")
    shutil.copytree(REPO / "migrations", migrations, ignore=ignore)
    env["ELDR_MIGRATIONS_DIR"] = str(migrations)
    env["MPLCONFIGDIR"] = str(root / "tmp")
    (root / "home").mkdir()
    # Like a wheel install: the packages' own repository root holds no migrations/.
    assert not (site.parent / "migrations").exists()
    return Image(root, site, env)


@pytest.fixture(scope="module")
def overlay() -> list[Obj]:
    return render(DEV_OVERLAY)


def by_name(objects: list[Obj], kind: str, name: str) -> Obj:
    for obj in objects:
        if obj["kind"] == kind and obj["metadata"]["name"] == name:
            return obj
    raise LookupError(f"{kind} {name}")


def secret_value(objects: list[Obj], ref: dict[str, str]) -> str:
    return str(by_name(objects, "Secret", ref["name"])["stringData"][ref["key"]])


def container_env(objects: list[Obj], pod_name: str, container: Obj) -> dict[str, str]:
    """The environment Kubernetes gives the container (envFrom, then env)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(by_name(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = entry["value"]
        elif "secretKeyRef" in entry["valueFrom"]:
            env[entry["name"]] = secret_value(objects, entry["valueFrom"]["secretKeyRef"])
        else:
            assert entry["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env[entry["name"]] = pod_name
    return env


@pytest.fixture(scope="module")
def nats(overlay: list[Obj], tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """nats-server with the dev overlay's configuration (users, permissions); the
    passwords reach it through its environment, as in the overlay's StatefulSet."""
    conf_dir = tmp_path_factory.mktemp("nats-conf")
    (conf_dir / "auth.conf").write_text((DEV_OVERLAY / "auth.conf").read_text())
    # The store directory is the pod's volume; EmbeddedNats gives its own (-sd).
    conf = (DEV_OVERLAY / "nats.conf").read_text()
    assert "store_dir: /data" in conf
    (conf_dir / "nats.conf").write_text(conf.replace("store_dir: /data", ""))
    (container,) = by_name(overlay, "StatefulSet", "eldr-nats")["spec"]["template"]["spec"][
        "containers"
    ]
    passwords = container_env(overlay, "eldr-nats-0", container)
    saved = {k: os.environ.get(k) for k in passwords}
    os.environ.update(passwords)  # the server process inherits them
    server = EmbeddedNats(config_file=conf_dir / "nats.conf")
    try:
        with server:
            yield server
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def command_env(
    image: Image, overlay: list[Obj], obj: Obj, nats: EmbeddedNats, pg_url: str
) -> tuple[list[str], dict[str, str], int | None]:
    """(argv, environment, metrics port) of the object's ELDR container, as the image
    runs it: ENTRYPOINT ["eldr"] + args."""
    (container,) = obj["spec"]["template"]["spec"]["containers"]
    env = {"PATH": os.environ["PATH"], "HOME": str(image.root / "home")}
    env.update(image.env)
    env.update(container_env(overlay, f"{obj['metadata']['name']}-test", container))
    env["PYTHONPATH"] = str(image.site)
    # What differs outside a cluster: service DNS names and a shared network namespace.
    env["ELDR_NATS_URL"] = nats.url
    if "ELDR_DATABASE_URL" in env:
        env["ELDR_DATABASE_URL"] = pg_url
    port = None
    if "ELDR_METRICS_PORT" in env:
        port = free_port()
        env["ELDR_METRICS_PORT"] = str(port)
    argv = [sys.executable, "-m", "eldr.cli", *container["args"]]
    return argv, env, port


def http_status(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


@dataclass
class Running:
    service: str
    process: subprocess.Popen[str]
    port: int
    deployment: Obj
    returncode: int | None = None
    output: str = ""
    stopped: bool = False


@dataclass
class Stack:
    image: Image
    overlay: list[Obj]
    nats: EmbeddedNats
    pg_url: str
    services: dict[str, Running]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`eldr ARGS` as an operator would run it: the operator's NATS user, the database."""
        env = {"PATH": os.environ["PATH"], "HOME": str(self.image.root / "home")}
        env.update(self.image.env)
        env["PYTHONPATH"] = str(self.image.site)
        config = by_name(self.overlay, "ConfigMap", "eldr-config")["data"]
        env["ELDR_NAMESPACE"] = config["ELDR_NAMESPACE"]
        env["ELDR_INBOX_PREFIX"] = inbox_prefix(config["ELDR_NAMESPACE"], "operator")
        env["ELDR_NATS_URL"] = self.nats.url
        env["ELDR_USER"] = secret_value(self.overlay, {"name": "nats-eldr-operator", "key": "user"})
        env["ELDR_PASSWORD"] = secret_value(
            self.overlay, {"name": "nats-eldr-operator", "key": "password"}
        )
        env["ELDR_DATABASE_URL"] = self.pg_url
        return subprocess.run(
            [sys.executable, "-m", "eldr.cli", *args],
            env=env,
            cwd=self.image.root / "home",
            capture_output=True,
            text=True,
            timeout=180,
        )

    def metric(self, service: str, name: str) -> float:
        """Sum of a metric's samples on a service's /metrics."""
        status, body = http_status(self.services[service].port, "/metrics")
        assert status == 200
        total = 0.0
        for line in body.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_for(self, service: str, name: str, at_least: float, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while self.metric(service, name) < at_least:
            assert time.monotonic() < deadline, f"{service} {name} < {at_least}"
            time.sleep(0.2)


REQUESTS = 200
RATE_PER_S = "100"
"""simprefill's workload in this test (the overlay's replays without end): enough for the
dev ConfigMap's ELDR_MIN_SAMPLES, at a rate a shared CI machine keeps up with."""
LOCAL_SUMMARY_BLOCKS = "8"


@pytest.fixture(scope="module")
def stack(
    image: Image, overlay: list[Obj], nats: EmbeddedNats, module_pg_url: str
) -> Iterator[Stack]:
    pg_url = module_pg_url  # versions are counted from 1: a database of this module's own
    job = by_name(overlay, "Job", "eldr-db-migrate")
    argv, env, _ = command_env(image, overlay, job, nats, pg_url)
    migrated = subprocess.run(
        argv, env=env, cwd=image.root / "home", capture_output=True, text=True, timeout=120
    )
    assert migrated.returncode == 0, migrated.stderr[-3000:]
    assert "at revision" in migrated.stdout

    running: dict[str, Running] = {}

    def start(service: str) -> Running:
        deployment = by_name(overlay, "Deployment", f"eldr-{service}")
        argv, env, port = command_env(image, overlay, deployment, nats, pg_url)
        assert port is not None
        if service == "simprefill":
            env["ELDR_SIMPREFILL_COUNT"] = str(REQUESTS)
            env["ELDR_SIMPREFILL_RATE_PER_S"] = RATE_PER_S
            # A small store of its own block summaries: most prefix hits then go to the
            # signature service, so the router's request to it runs under the per-service
            # users too (with every block held, none would).
            env["ELDR_SIMPREFILL_LOCAL_SUMMARY_BLOCKS"] = LOCAL_SUMMARY_BLOCKS
        process = subprocess.Popen(
            argv,
            env=env,
            cwd=image.root / "home",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        running[service] = Running(service, process, port, deployment)
        return running[service]

    try:
        # The ELDR services create the JetStream topology (their NATS users may); the
        # simulated workers' users only read it, so they start once it exists.
        for r in [start(service) for service in ("signature", "trainer", "router")]:
            wait_ready(r)
        wait_ready(start("simdecode"))
        wait_ready(start("simprefill"))
        yield Stack(image, overlay, nats, pg_url, running)
    finally:
        stop_all(running)


def wait_ready(r: Running) -> None:
    (container,) = r.deployment["spec"]["template"]["spec"]["containers"]
    path = container["readinessProbe"]["httpGet"]["path"]
    deadline = time.monotonic() + READY_TIMEOUT_S
    while http_status(r.port, path)[0] != 200:
        if r.process.poll() is not None or time.monotonic() > deadline:
            r.process.kill()
            r.returncode, r.output, r.stopped = r.process.wait(), r.process.communicate()[0], True
            pytest.fail(f"{r.service} did not become ready:\n{r.output[-3000:]}")
        time.sleep(0.2)


def stop_all(running: dict[str, Running]) -> None:
    """SIGTERM every process (in reverse start order), then collect exit codes; once."""
    pending = [r for r in reversed(list(running.values())) if not r.stopped]
    for r in pending:
        if r.process.poll() is None:
            r.process.send_signal(signal.SIGTERM)
    for r in pending:
        r.stopped = True
        grace_s = r.deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        try:
            r.returncode = r.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            r.process.kill()
            r.returncode = None
        r.output = r.process.communicate()[0]


def test_every_service_answers_its_probes_and_metrics(stack: Stack) -> None:
    for r in stack.services.values():
        (container,) = r.deployment["spec"]["template"]["spec"]["containers"]
        assert http_status(r.port, container["readinessProbe"]["httpGet"]["path"])[0] == 200
        assert http_status(r.port, container["livenessProbe"]["httpGet"]["path"])[0] == 200
        status, body = http_status(r.port, "/metrics")
        assert status == 200
        assert f'eldr_service_info{{service="{r.service}"}} 1.0' in body


def test_requests_are_routed_with_the_per_service_users(stack: Stack) -> None:
    stack.wait_for("router", "eldr_router_decisions_total", REQUESTS)
    stack.wait_for("simprefill", "eldr_simprefill_requests_total", REQUESTS)
    assert stack.metric("router", "eldr_router_worker_requests") >= 0
    assert stack.metric("router", 'eldr_router_signature_source_total{source="service"}') > 0
    assert stack.metric("signature", "eldr_signature_assemblies_total") > 0


def test_refit_then_roll_back_with_the_operator_user(stack: Stack) -> None:
    config = by_name(stack.overlay, "ConfigMap", "eldr-config")["data"]
    stack.wait_for("trainer", "eldr_trainer_window_samples", int(config["ELDR_MIN_SAMPLES"]))
    for expected in (1, 2):
        refit = stack.cli("refit", "--reason", "test", "--timeout", "120")
        assert refit.returncode == 0, refit.stdout + refit.stderr
        assert f"version: {expected}" in refit.stdout
        stack.wait_for("router", "eldr_router_partition_loads_total", expected)
    assert stack.metric("router", "eldr_router_partition_version") == 2

    assert "eldr.partitions.cli" in COMMAND_MODULES, "register eldr.partitions.cli in eldr.cli"
    rollback = stack.cli("partitions", "activate", "1", "--note", "rollback test")
    assert rollback.returncode == 0, rollback.stdout + rollback.stderr
    assert "retired version 2" in rollback.stdout
    stack.wait_for("router", "eldr_router_partition_loads_total", 3)
    assert stack.metric("router", "eldr_router_partition_version") == 1
    versions = stack.cli("db", "versions")
    assert versions.returncode == 0
    statuses = {line.split()[0]: line.split()[2] for line in versions.stdout.splitlines()[1:]}
    assert statuses == {"1": "active", "2": "retired"}


def live_series(stack: Stack) -> set[str]:
    """Every series name the running services can write: their `# TYPE` lines expanded
    the way Prometheus names a family's series (labelled families without samples yet
    still announce themselves)."""
    names: set[str] = set()
    for r in stack.services.values():
        status, body = http_status(r.port, "/metrics")
        assert status == 200
        for line in body.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                if kind == "counter":  # written as name_total, and name_created
                    base = name.removesuffix("_total")
                    names.update({base + "_total", base + "_created"})
                elif kind in ("histogram", "summary"):
                    names.update({name + s for s in ("", "_bucket", "_sum", "_count", "_created")})
                else:
                    names.add(name)
            elif line and not line.startswith("#"):
                names.add(line.split("{")[0].split(" ")[0])
    return names


def test_dashboard_and_rules_use_metrics_the_running_services_export(stack: Stack) -> None:
    referenced = (
        dashboard_metric_names(DEPLOY / "grafana" / "eldr-overview.json")
        | rules_metric_names(DEPLOY / "prometheus" / "alerts.yaml")
        | adapter_metric_names(DEPLOY / "prometheus" / "adapter-values.yaml")
    )
    external = NATS_EXPORTER_METRICS | PROMETHEUS_SERIES
    assert sorted(referenced - external - live_series(stack)) == []


def test_services_stop_on_sigterm_and_nats_saw_no_permission_violation(stack: Stack) -> None:
    stop_all(stack.services)
    for r in stack.services.values():
        assert r.returncode == 0, f"{r.service} exited {r.returncode}:\n{r.output[-3000:]}"
    log = stack.nats.log_file.read_text()
    assert "Violation" not in log, [line for line in log.splitlines() if "Violation" in line]
