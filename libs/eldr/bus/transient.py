"""Expected faults of a clustered bus: told apart, retried with backoff, counted, said once.

While a JetStream stream or consumer elects a leader (its node was killed, hangs, or a
quorum is lost for a while), or a client reconnects to another node, publishes time out,
requests find no responders, the JetStream API answers 503 and pull requests come back
with status 503 or 409. None of that is a bug: it is what a cluster does for a few
seconds. Such an error is told apart from a real failure (`transient_kind`), retried
after a jittered exponential backoff (`Backoff`), counted
(`eldr_bus_transient_errors_total{op, kind}`) and said in at most one log line per
operation and kind per `interval_s`, with the number left unsaid, plus one line when the
operation works again (`FaultLog`): a leader election is a few log lines, not hundreds of
tracebacks. Anything else (a permission violation, a bad request, a bug) is not retried
here and keeps its traceback.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from eldr.bus.errors import (
    BusTimeoutError,
    DisconnectedError,
    NoRespondersError,
    UnavailableError,
)

TRANSIENT_KINDS = (
    "timeout",
    "no_responders",
    "unavailable",
    "disconnected",
    "status_503",
    "status_409",
    "status_other",
)
"""`kind` label values: `timeout` (no answer in time: a hung or dead node, an election);
`no_responders` (nobody serves the subject now: a stream without a leader); `unavailable`
(JetStream answered 503: no quorum, cluster not ready); `disconnected` (the client is
between servers); `status_503` / `status_409` / `status_other`: a pull request's status
(503: the consumer has no leader; 409: leadership change, too many waiting pulls)."""

OPS = ("commit", "publish", "read", "pull", "request", "handler")
"""`op` label values: `commit` (a first-write-wins decision), `publish` (a JetStream
publish), `read` (a stream read: last message, info), `pull` (a pull consumer's fetch),
`request` (core request/reply), `handler` (a consumer's handler failed with one)."""

FAULT_LOG_INTERVAL_S = 10.0
"""At most one log line per operation and kind per this many seconds."""


def transient_kind(exc: BaseException) -> str | None:
    """The kind of an expected, retryable bus fault, or None for anything else."""
    if isinstance(exc, BusTimeoutError):
        return "timeout"
    if isinstance(exc, NoRespondersError):
        return "no_responders"
    if isinstance(exc, UnavailableError):
        return "unavailable"
    if isinstance(exc, DisconnectedError):
        return "disconnected"
    return None


def pull_status_kind(status: str) -> str:
    """The `kind` of a pull request's status (503, 409, other)."""
    return f"status_{status}" if status in ("503", "409") else "status_other"


@dataclass
class Backoff:
    """Exponential backoff with jitter: attempt n (from 1) waits a random time between half
    and all of `min(max_s, first_s * 2**(n-1))`, so clients that failed together (every
    router at the same election) do not retry together."""

    first_s: float = 0.05
    max_s: float = 1.0
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s:
            raise ValueError(f"need 0 < first_s <= max_s, got {self.first_s}, {self.max_s}")

    def delay_s(self, attempt: int) -> float:
        cap = min(self.max_s, self.first_s * 2 ** max(0, attempt - 1))
        return float(cap * (0.5 + 0.5 * self.rng.random()))


@dataclass
class _Episode:
    """One run of failures of one operation, from its first failure to its recovery."""

    started_s: float
    failures: dict[str, int] = field(default_factory=dict)


class FaultLog:
    """Say transient faults once per interval per operation and kind, and say when the
    operation works again (see the module docstring).

    Many calls of one operation retry at once (every event a router holds during an
    election), and they recover one after another, some failing again meanwhile: both
    kinds of line are rate-limited per operation across episodes, so a flapping operation
    still says at most one failure line per kind and one recovery line per interval (a
    recovery not said then is summed into the next one)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = FAULT_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self.interval_s = interval_s
        self._clock = clock
        self._episodes: dict[str, _Episode] = {}
        self._logged_s: dict[tuple[str, str], float] = {}
        self._unsaid: dict[tuple[str, str], int] = {}
        self._recovered_s: dict[str, float] = {}

    def failed(self, op: str, kind: str, detail: str) -> bool:
        """Count a failure of `op`; log it unless a line for (`op`, `kind`) was logged
        within the interval. True if a line was logged."""
        now = self._clock()
        episode = self._episodes.setdefault(op, _Episode(started_s=now))
        episode.failures[kind] = episode.failures.get(kind, 0) + 1
        key = (op, kind)
        if now - self._logged_s.get(key, -math.inf) < self.interval_s:
            self._unsaid[key] = self._unsaid.get(key, 0) + 1
            return False
        unsaid = self._unsaid.pop(key, 0)
        self._logged_s[key] = now
        self._log.warning(
            "%s: %s (%s%s; expected while a NATS node restarts or a stream elects a leader: "
            "retrying with backoff)",
            op,
            " ".join(detail.split())[:300],
            kind,
            f", {unsaid} more since the last report" if unsaid else "",
        )
        return True

    def recovered(self, op: str) -> bool:
        """`op` succeeded: if it had failed since it last worked, log one line with what
        failed and for how long (at most one per interval: else the failures are kept for
        the next). True if a line was logged."""
        episode = self._episodes.get(op)
        if episode is None:
            return False
        now = self._clock()
        if now - self._recovered_s.get(op, -math.inf) < self.interval_s:
            return False
        del self._episodes[op]
        self._recovered_s[op] = now
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(episode.failures.items()))
        self._log.info("%s works again after %.1f s (%s)", op, now - episode.started_s, counts)
        return True

    def failing(self, op: str) -> bool:
        """Whether `op` has failed since it last worked."""
        return op in self._episodes
