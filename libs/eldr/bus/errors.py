"""Exceptions of the bus library. Services catch these, never `nats` exceptions."""

from __future__ import annotations


class BusError(Exception):
    """A NATS operation failed (connection, JetStream API, protocol)."""


class BusTimeoutError(BusError, TimeoutError):
    """A request, JetStream publish or API call got no answer in time."""


class NoRespondersError(BusError):
    """Nobody is subscribed to the subject of a request (or no stream for a publish)."""


class UnavailableError(BusError):
    """JetStream answered 503: the stream or the cluster has no leader or quorum now
    (an election, a node down). Retryable (`eldr.bus.transient`)."""


class DisconnectedError(BusError):
    """The client is between servers (reconnecting): the operation was not sent.
    Retryable (`eldr.bus.transient`)."""


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


REFUSAL_REASONS = (
    "identity_mismatch",
    "geometry_mismatch",
    "inconsistent",
    "over_limit",
)
"""Why a handler refuses a well-formed message (`Reject.reason`, a bounded metric label):
`identity_mismatch`: the id it names is not the subject token its sender may publish on;
`geometry_mismatch`: a model shape other than the one configured or served;
`inconsistent`: its numbers contradict each other (counts that no real block can have);
`over_limit`: more than a configured bound (workers, cells, samples)."""


class Reject(Exception):  # noqa: N818 - it is a verdict, not an error
    """Raise from any handler to refuse a well-formed message for what it claims.

    Every receive path of the bus (`subscribe`, `consume`, `replay`, `serve`) turns it into
    the same outcome: counted in `eldr_bus_messages_rejected_total{family, reason}`,
    logged (rate-limited), dead-lettered with the reason, and for a JetStream consumer
    terminated (never redelivered: the same bytes would be refused again); a request gets
    an error answer with code 403. `reason` is one of `REFUSAL_REASONS`.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"refusal reason {reason!r} is not one of {REFUSAL_REASONS}")
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail
