"""Exceptions of the bus library. Services catch these, never `nats` exceptions."""

from __future__ import annotations


class BusError(Exception):
    """A NATS operation failed (connection, JetStream API, protocol)."""


class BusTimeoutError(BusError, TimeoutError):
    """A request, JetStream publish or API call got no answer in time."""


class NoRespondersError(BusError):
    """Nobody is subscribed to the subject of a request (or no stream for a publish)."""


class NotFoundError(BusError):
    """The stream, consumer, message or object does not exist."""


class AlreadyExists(BusError):  # noqa: N818 - the name the services use
    """A conditional JetStream publish lost: the subject already has a message.

    Raised by `Bus.js_publish(..., expected_last_subject_seq=...)` when the subject's last
    sequence is not the expected one (JetStream error 10071, "wrong last sequence").
    """


class RemoteError(BusError):
    """A `serve` handler answered a request with an error instead of a reply."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"remote error {code}: {message}")
        self.code = code
        self.message = message


class TopologyError(BusError):
    """The server's streams or consumers cannot be brought in line with the topology."""


class Retry(Exception):  # noqa: N818 - it is a signal, not an error
    """Raise from a `consume` handler to have the message redelivered after `delay_s`."""

    def __init__(self, reason: str = "", delay_s: float = 1.0) -> None:
        super().__init__(reason or "retry requested")
        self.reason = reason
        self.delay_s = delay_s
