"""Typed settings: environment prefix, validation, secrets."""

from __future__ import annotations

import pytest
from pydantic import SecretStr, ValidationError

from eldr.settings import BusSettings, CommonSettings


def test_settings_read_the_eldr_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELDR_NATS_URL", "nats://10.0.0.1:4222")
    monkeypatch.setenv("ELDR_NAMESPACE", "prod")
    monkeypatch.setenv("ELDR_DECISIONS_MAX_AGE_S", "60")
    settings = CommonSettings()
    assert (settings.nats_url, settings.namespace) == ("nats://10.0.0.1:4222", "prod")
    assert settings.decisions_max_age_s == 60.0


@pytest.mark.parametrize("namespace", ["Prod", "a.b", "a b", ""])
def test_namespace_must_be_a_lower_case_token(namespace: str) -> None:
    with pytest.raises(ValidationError, match="namespace"):
        BusSettings(namespace=namespace)


def test_secrets_never_print() -> None:
    settings = BusSettings(user="u", password=SecretStr("hunter2"), token=SecretStr("t0ken"))
    assert "hunter2" not in repr(settings)
    assert "t0ken" not in str(settings.model_dump())


def test_client_certificate_needs_its_key(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValidationError, match="together"):
        BusSettings(tls_cert_file=tmp_path / "cert.pem")


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(ValidationError, match="nats_uri"):
        BusSettings(nats_uri="nats://x")  # type: ignore[call-arg]


def test_instance_id_defaults_to_a_token() -> None:
    assert CommonSettings().instance_id.replace("-", "").replace("_", "").isalnum()
