"""The local stack as processes: embedded NATS, migrations, services started in order,
ready, and stopped cleanly (exit status 0) in reverse order."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from eldr.dev.stack import SERVICES, ServiceSpec, Stack, StackConfig, StackError, missing_services

pytestmark = pytest.mark.e2e


def readyz(url: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/readyz", timeout=5.0) as response:
        assert response.status == 200
        body: dict[str, object] = json.loads(response.read())
        return body


def config(tmp_path: Path, **overrides: object) -> StackConfig:
    fields: dict[str, object] = {
        "namespace": "e2e",  # each Stack here starts its own nats-server
        "state_dir": tmp_path,
        "decoders": 2,
        "echo": False,
        "ready_timeout_s": 60.0,
        "stop_timeout_s": 20.0,
        "env": {"ELDR_SIMDECODE_TIME_SCALE": "0.1"},
    }
    fields.update(overrides)
    return StackConfig(**fields)  # type: ignore[arg-type]


def test_simulated_workers_and_signature_start_ready_and_stop_cleanly(tmp_path: Path) -> None:
    services = tuple(s for s in SERVICES if s.name in ("signature", "simdecode"))
    with Stack(config(tmp_path, services=services, replicas={"signature": 2})) as stack:
        started = [p.instance_id for p in stack.processes]
        assert started == ["signature-0", "signature-1", "simdecode-0"]
        for process in stack.processes:
            assert readyz(process.url)["ready"] is True
    assert stack.exit_codes == {name: 0 for name in started}


def test_every_existing_service_starts_ready_and_stops_cleanly(tmp_path: Path) -> None:
    """The whole default list (one replica each), minus services not written yet."""
    cfg = config(
        tmp_path, skip_missing=True, replicas={"signature": 1, "router": 1}, log_dir=tmp_path
    )
    with Stack(cfg) as stack:
        started = [p.name for p in stack.processes]
        expected = [
            s.name
            for s in SERVICES
            if cfg.replicas_of(s) > 0 and s.name not in missing_services([s])
        ]
        assert started == expected
        assert stack.database_url is not None
        assert (tmp_path / "eldr.db").is_file()
        for process in stack.processes:
            assert readyz(process.url)["ready"] is True
    assert set(stack.exit_codes.values()) == {0}


def test_service_failing_at_start_is_reported_with_its_output(tmp_path: Path) -> None:
    services = (ServiceSpec("simdecode"),)
    bad = config(tmp_path, services=services, env={"ELDR_SIMDECODE_WORKERS": "bad id!"})
    stack = Stack(bad)
    with pytest.raises(StackError, match="simdecode-0 exited") as failure:
        stack.start()
    assert "simdecode_workers" in str(failure.value)
    assert stack.processes == []
    assert stack.nats is None
