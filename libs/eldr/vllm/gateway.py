"""The gateway's bookkeeping that is neither HTTP nor bus wiring (used by
`eldr_services.gateway`).

- `response_sources`: one `ResponseSource` per prefill instance, when the gateway
  publishes the prefill's routing itself (the routed_experts source);
- `CaptureWatch`: what each prefill instance's capture plugin last said it can do, so that
  a request whose prefill cannot be captured is routed load-only at once
  (`unavailable_prefill_done`) instead of waiting for a decision that cannot come;
- `response_outcome`, `StreamTally`: how every decode response ended (stop, length, client
  abort, upstream error), for its `RequestFinished` event (whether or not any capture
  runs);
- `SseRelay`: a decode stream passed on whole events at a time, so that a stream the
  upstream breaks off ends, for the client, on an event boundary followed by vLLM's error
  event;
- `UpstreamHealth`: which vLLM instances answer, so that a dead one leaves the rotation
  (and says so once) instead of failing every request sent to it.

The pure request shaping (bodies, candidate order, headers) is in `eldr.vllm.pd`; the
requester's role (decision waiters, in-flight count, finish events) is
`eldr.roles.requester`, which the simulated gateway plays too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from eldr.core.workload.trace import ModelGeometry
from eldr.vllm.capture import CaptureConfig
from eldr.vllm.sources import LayerMap, ResponseSource
from eldr.wire import CaptureStatus
from eldr.wire.messages import FinishReason


def response_sources(
    prefills: Iterable[str],
    *,
    model_key: str,
    block_size: int,
    geometry: ModelGeometry,
    layers: LayerMap | None = None,
    hash_key: bytes = b"",
) -> dict[str, ResponseSource]:
    """Per prefill instance, the source that turns its responses' routed experts into
    block summaries and a PrefillDone published under that instance's id (block hashes
    keyed with the deployment's `hash_key`)."""
    return {
        name: ResponseSource(
            CaptureConfig(name, model_key, block_size, geometry, hash_key=hash_key), layers
        )
        for name in prefills
    }


# --- capture state of the prefill instances ---------------------------------------------

STALE_INTERVALS = 3.0
"""A capture status older than this many of its own intervals counts as silence."""

CaptureProblem = Literal["capture_off", "capture_failed", "no_capture_status", "capture_stale"]


@dataclass(frozen=True)
class _Heard:
    status: CaptureStatus
    at_s: float


class CaptureWatch:
    """What each prefill instance's capture plugin last said (`CaptureStatus`).

    `problem(instance, now)` is None while the instance's prefill capture is "ok" and its
    status fresh, and also for an instance not heard from yet during `grace_s` after the
    gateway started (a status is due within one interval); otherwise it names why the
    prefill's routing will not come. Times are monotonic seconds passed in.
    """

    def __init__(self, instances: Iterable[str], *, started_s: float, grace_s: float) -> None:
        self.instances = frozenset(instances)
        self.started_s = started_s
        self.grace_s = grace_s
        self._heard: dict[str, _Heard] = {}

    def update(self, status: CaptureStatus, now_s: float) -> bool:
        """Take a status; False for an instance this gateway does not serve."""
        if status.worker_id not in self.instances:
            return False
        self._heard[status.worker_id] = _Heard(status, now_s)
        return True

    def last(self, instance: str) -> CaptureStatus | None:
        heard = self._heard.get(instance)
        return None if heard is None else heard.status

    def problem(self, instance: str, now_s: float) -> CaptureProblem | None:
        heard = self._heard.get(instance)
        if heard is None:
            return None if now_s - self.started_s < self.grace_s else "no_capture_status"
        status = heard.status
        if now_s - heard.at_s > STALE_INTERVALS * max(status.interval_s, 0.1):
            return "capture_stale"
        if status.prefill_capture == "ok":
            return None
        return "capture_off" if status.prefill_capture == "off" else "capture_failed"


def prompt_tokens_of(response: Mapping[str, Any]) -> int:
    """Prompt tokens from a completion response's usage (0 when it does not say)."""
    usage = response.get("usage")
    if isinstance(usage, Mapping):
        value = usage.get("prompt_tokens")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return 0


# --- the end of each request ------------------------------------------------------------


def _reason_of(finish_reason: object) -> FinishReason:
    if finish_reason == "length":
        return "length"
    if finish_reason == "abort":
        return "abort"
    return "stop"


def response_outcome(payload: bytes) -> tuple[FinishReason, int | None]:
    """(reason, output tokens) of a whole (non-streamed) completion response."""
    try:
        body = json.loads(payload)
    except (ValueError, UnicodeDecodeError):
        return "stop", None
    if not isinstance(body, dict):
        return "stop", None
    reason: FinishReason = "stop"
    choices = body.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        reason = _reason_of(choices[0].get("finish_reason"))
    usage = body.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return reason, tokens if isinstance(tokens, int) and tokens >= 0 else None


class StreamTally:
    """Follows an OpenAI server-sent-event stream as it is passed through: the finish
    reason of the last choice that named one, and the output tokens (usage when the
    stream carries it, else token ids, else content chunks)."""

    MAX_LINE_BYTES = 1 << 20
    """A line longer than this is skipped, not buffered (a broken upstream)."""

    def __init__(self) -> None:
        self.finish_reason: FinishReason | None = None
        self.usage_tokens: int | None = None
        self.token_ids = 0
        self.chunks = 0
        self._partial = b""

    @property
    def output_tokens(self) -> int | None:
        if self.usage_tokens is not None:
            return self.usage_tokens
        if self.token_ids:
            return self.token_ids
        return self.chunks or None

    def feed(self, data: bytes) -> None:
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > self.MAX_LINE_BYTES:
            self._partial = b""
        for line in lines:
            self._line(line.strip())

    def _line(self, line: bytes) -> None:
        if not line.startswith(b"data:"):
            return
        payload = line[5:].strip()
        if payload == b"[DONE]" or not payload:
            return
        try:
            event = json.loads(payload)
        except (ValueError, UnicodeDecodeError):
            return
        if not isinstance(event, dict):
            return
        if "error" in event:
            self.finish_reason = "error"  # vLLM's own error event: the decode failed
            return
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        for choice in event.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                self.token_ids += len(ids)
            self.chunks += 1
            if choice.get("finish_reason") is not None:
                self.finish_reason = _reason_of(choice["finish_reason"])


class SseRelay:
    """A server-sent-event stream passed on whole events at a time (`feed` returns what
    may go to the client now), tallied (`tally`) as it goes. When the upstream breaks off
    mid-event, what it sent of that event is held back (`dropped_bytes`), so the client's
    stream can end cleanly with an error event."""

    MAX_HELD_BYTES = 1 << 20
    """An event longer than this is passed on in pieces (a stream that is not SSE)."""

    def __init__(self) -> None:
        self.tally = StreamTally()
        self._held = b""

    @property
    def dropped_bytes(self) -> int:
        return len(self._held)

    def feed(self, data: bytes) -> bytes:
        buffer = self._held + data
        lf, crlf = buffer.rfind(b"\n\n"), buffer.rfind(b"\r\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
        if end == 0 and len(buffer) <= self.MAX_HELD_BYTES:
            self._held = buffer
            return b""
        if end == 0:
            end = len(buffer)
        out, self._held = buffer[:end], buffer[end:]
        self.tally.feed(out)
        return out

    def flush(self) -> bytes:
        """At the upstream's clean end: whatever is held (a last event without its blank
        line), passed on as it is."""
        out, self._held = self._held, b""
        self.tally.feed(out + b"\n")
        return out


class UpstreamHealth:
    """Which upstream instances (role, name) answer. An instance is healthy until a probe
    or a request finds it unreachable; it comes back with the next probe it passes. Each
    change is logged once (`changed` returns True for it)."""

    def __init__(self, instances: Iterable[tuple[str, str]]) -> None:
        self._healthy: dict[tuple[str, str], bool] = {key: True for key in instances}
        self.probed: set[tuple[str, str]] = set()
        """Instances probed at least once (readiness needs a probe, not the default)."""

    def healthy(self, role: str, name: str) -> bool:
        return self._healthy.get((role, name), False)

    def names(self, role: str, *, healthy: bool) -> list[str]:
        return [n for (r, n), ok in self._healthy.items() if r == role and ok == healthy]

    def ready(self, role: str) -> bool:
        """Some instance of `role` passed its last probe."""
        return any(
            ok and (r, n) in self.probed for (r, n), ok in self._healthy.items() if r == role
        )

    def mark(self, role: str, name: str, ok: bool, *, probe: bool = False) -> bool:
        """Record what a probe (or a request) found; True when that changed the state."""
        key = (role, name)
        if probe:
            self.probed.add(key)
        if key not in self._healthy or self._healthy[key] == ok:
            return False
        self._healthy[key] = ok
        return True


__all__ = [
    "CaptureWatch",
    "SseRelay",
    "StreamTally",
    "UpstreamHealth",
    "prompt_tokens_of",
    "response_outcome",
    "response_sources",
]
