"""URLs shown in logs and errors carry no credentials."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest

from eldr.bus.connection import redact_url


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("nats://127.0.0.1:4222", "nats://127.0.0.1:4222"),
        ("nats://user:s3cret@host:4222", "nats://***@host:4222"),
        ("tls://token@host:4222", "tls://***@host:4222"),
        (
            "nats://a:b@h1:1, nats://h2:2,tls://c:d@h3:3",
            "nats://***@h1:1,nats://h2:2,tls://***@h3:3",
        ),
        ("nats://u:p%40ss@host:1/path@x", "nats://***@host:1/path@x"),
    ],
)
def test_credentials_are_removed(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_a_parsed_url_is_redacted_too() -> None:
    # nats-py hands out the connected server as a ParseResult.
    assert redact_url(urlparse("nats://router:pw@127.0.0.1:4222")) == "nats://***@127.0.0.1:4222"
