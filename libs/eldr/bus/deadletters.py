"""Dead letters and refusals: what the receive paths do with a message they cannot or
will not handle. A refused message (`Reject`) is counted, logged at most once per
`REFUSAL_LOG_INTERVAL_S` per family and reason (with the number left unsaid) and
dead-lettered; so is an undecodable one. A dead letter (`DeadLetter`) keeps the subject,
the error, the headers and the first bytes of the payload, on the DLQ subject of the stream
it came from (`CORE_DLQ_TOKEN` for core messages)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from nats.aio.msg import Msg

from eldr.bus.errors import BusError, Reject
from eldr.bus.publishing import Publishing
from eldr.wire import DeadLetter, WireError
from eldr.wire.base import MAX_DEAD_LETTER_PAYLOAD_BYTES, MAX_HEADERS, MAX_TEXT_LEN

log = logging.getLogger(__name__)

CORE_DLQ_TOKEN = "core"
"""DLQ subject token for messages that did not come from a stream."""
_MAX_ERROR_HEADER_LEN = 1000
REFUSAL_LOG_INTERVAL_S = 10.0
"""At most one log line per subject family and refusal reason per this many seconds (a
misbehaving worker refused at 10 reports/s must not flood the log)."""


def one_line(text: str, limit: int = _MAX_ERROR_HEADER_LEN) -> str:
    return " ".join(text.split())[:limit]


class DeadLettering(Publishing):
    """The bus's dead letters, refusals and the rate-limited logs of both."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refusal_log: dict[tuple[str, str], list[float]] = {}
        """(family, reason) -> [last logged (monotonic s), refusals not logged since]."""
        self._failure_log: dict[tuple[str, str], list[float]] = {}
        """(family, exception type) -> [last traceback logged, failures not logged since]."""

    async def _dead_letter(
        self,
        msg: Msg,
        *,
        error: str,
        stream: str | None = None,
        stream_seq: int | None = None,
        num_delivered: int = 0,
    ) -> bool:
        """Publish a DeadLetter for `msg`; False if that failed."""
        family = self.subjects.family(msg.subject)
        headers = {
            str(k)[:256]: one_line(str(v), MAX_TEXT_LEN)
            for k, v in list((msg.headers or {}).items())[:MAX_HEADERS]
        }
        letter = DeadLetter(
            subject=msg.subject[:512],
            stream=stream,
            error=one_line(error, MAX_TEXT_LEN),
            received_ts_s=time.time(),
            payload=msg.data[:MAX_DEAD_LETTER_PAYLOAD_BYTES],
            headers=headers,
            payload_size_bytes=len(msg.data),
            stream_seq=stream_seq,
            num_delivered=num_delivered,
        )
        # Several replicas may dead-letter the same stored message: de-duplicate.
        msg_id = f"{stream}-{stream_seq}" if stream and stream_seq else None
        try:
            await self.js_publish(
                self.subjects.dlq(stream or CORE_DLQ_TOKEN), letter, msg_id=msg_id
            )
        except (BusError, WireError) as exc:
            log.error("could not dead-letter a message from %s: %s", msg.subject, exc)
            self.metrics.rejected.labels(family, "dead_letter_failed").inc()
            return False
        self.metrics.dead_letters.labels(family).inc()
        return True

    async def _refuse(
        self,
        msg: Msg,
        family: str,
        refusal: Reject,
        *,
        stream: str | None = None,
        stream_seq: int | None = None,
        num_delivered: int = 0,
        dead_letter: bool = True,
    ) -> bool:
        """Count, log (rate-limited) and dead-letter a refused message; False if the dead
        letter could not be stored."""
        self.metrics.rejected.labels(family, refusal.reason).inc()
        self._log_refusal(family, refusal, msg.subject)
        if not dead_letter:
            return True
        return await self._dead_letter(
            msg,
            error=f"refused: {refusal}",
            stream=stream,
            stream_seq=stream_seq,
            num_delivered=num_delivered,
        )

    def _log_refusal(self, family: str, refusal: Reject, subject: str) -> None:
        now = time.monotonic()
        state = self._refusal_log.setdefault((family, refusal.reason), [-math.inf, 0.0])
        if now - state[0] < REFUSAL_LOG_INTERVAL_S:
            state[1] += 1
            return
        unsaid = int(state[1])
        state[0], state[1] = now, 0.0
        log.warning(
            "refused a message on %s: %s%s",
            subject[:200],
            one_line(str(refusal), 500),
            f" ({unsaid} more {refusal.reason} refusals on {family} since the last report)"
            if unsaid
            else "",
        )

    def _log_failure(self, family: str, exc: Exception, message: str, *args: object) -> None:
        """Log a handler failure with its traceback, at most once per
        `REFUSAL_LOG_INTERVAL_S` per subject family and exception type (called inside the
        except block); the count left unsaid goes with the next line."""
        now = time.monotonic()
        state = self._failure_log.setdefault((family, type(exc).__name__), [-math.inf, 0.0])
        if now - state[0] < REFUSAL_LOG_INTERVAL_S:
            state[1] += 1
            return
        unsaid = int(state[1])
        state[0], state[1] = now, 0.0
        name = type(exc).__name__
        suffix = f" ({unsaid} more {name} failures on {family} since)" if unsaid else ""
        log.exception(message + suffix, *args)
