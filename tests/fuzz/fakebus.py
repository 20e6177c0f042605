"""An in-memory stand-in for the NATS connection under a real `eldr.bus.Bus`.

The fuzz tests drive the bus's own inbound paths (`Subscription.on_msg`, `Service._handle`,
`Consumer._process`, `ReadBack.on_msg`: size check, validated decode, dead-lettering, metrics,
ack/nak/term) and the services' real handlers, without sockets, so that tens of thousands
of cases run in seconds. What the bus and the handlers send goes to `FakeNats.published`
(core publishes, acks included) and `FakeJetStream.stored` (JetStream publishes, e.g. dead
letters and decisions); requests get no responder.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api
from prometheus_client import CollectorRegistry

from eldr.bus import Bus
from eldr.bus.metrics import BusMetrics
from eldr.settings import BusSettings


@dataclass
class FakeJetStream:
    """JetStream publishes and direct gets, with `Nats-Expected-Last-Subject-Sequence`."""

    _prefix: str = "$JS.API"
    stored: dict[str, list[bytes]] = field(default_factory=lambda: defaultdict(list))
    _seq: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,  # noqa: ASYNC109 - nats-py's signature
        stream: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> api.PubAck:
        expected = (headers or {}).get(api.Header.EXPECTED_LAST_SUBJECT_SEQUENCE)
        if expected == "0" and self.stored.get(subject):
            raise nats.js.errors.APIError(
                code=400, err_code=10071, description="wrong last sequence"
            )
        self.stored[subject].append(payload)
        return api.PubAck(stream="FAKE", seq=next(self._seq))

    async def get_last_msg(
        self, stream_name: str, subject: str, direct: bool = False
    ) -> api.RawStreamMsg:
        messages = self.stored.get(subject)
        if not messages:
            raise nats.js.errors.NotFoundError()
        return api.RawStreamMsg(subject=subject, data=messages[-1])

    def count(self, prefix: str) -> int:
        return sum(len(v) for k, v in self.stored.items() if k.startswith(prefix))


@dataclass
class FakeNats:
    """Enough of `nats.aio.client.Client` for `Bus` and `Msg.ack`."""

    js: FakeJetStream = field(default_factory=FakeJetStream)
    published: list[tuple[str, bytes]] = field(default_factory=list)
    is_connected: bool = True
    is_closed: bool = False
    is_draining: bool = False
    _inboxes: itertools.count[int] = field(default_factory=itertools.count)

    def jetstream(self, timeout: float = 5.0) -> FakeJetStream:
        return self.js

    def new_inbox(self) -> str:
        return f"_INBOX.fake.{next(self._inboxes)}"

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        reply: str = "",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.published.append((subject, payload))
        if len(self.published) > 10_000:
            del self.published[:5_000]

    async def request(self, subject: str, payload: bytes = b"", timeout: float = 1.0) -> Msg:  # noqa: ASYNC109
        raise nats.errors.NoRespondersError

    async def close(self) -> None:
        self.is_closed = True


def fake_bus(namespace: str = "fuzz", **settings: Any) -> tuple[Bus, FakeNats, CollectorRegistry]:
    nc = FakeNats()
    registry = CollectorRegistry()
    bus = Bus(
        nc,  # type: ignore[arg-type]
        BusSettings(namespace=namespace, **settings),
        BusMetrics(registry),
    )
    return bus, nc, registry


_delivery = itertools.count(1)


def core_msg(nc: FakeNats, subject: str, data: bytes, reply: str = "") -> Msg:
    return Msg(_client=nc, subject=subject, reply=reply, data=data)  # type: ignore[arg-type]


def js_msg(
    nc: FakeNats, stream: str, consumer: str, subject: str, data: bytes, delivered: int = 1
) -> Msg:
    """A message as a JetStream consumer delivers it (metadata in the reply subject)."""
    seq = next(_delivery)
    reply = f"$JS.ACK.{stream}.{consumer}.{delivered}.{seq}.{seq}.{time.time_ns()}.0"
    return Msg(_client=nc, subject=subject, reply=reply, data=data)  # type: ignore[arg-type]
