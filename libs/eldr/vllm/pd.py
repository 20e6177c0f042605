"""The disaggregated prefill -> decode handoff, as pure functions (used by the gateway).

vLLM's disaggregated flow: the prompt goes to a prefill instance with `max_tokens = 1`
and `kv_transfer_params = {"do_remote_decode": true, ...}`; the prefill's response carries
`kv_transfer_params` naming where its KV cache waits; the request then goes, unchanged
apart from those parameters, to a decode instance, which pulls the KV and generates.

Between the two, ELDR decides the decode instance. Every client request gets its own
request id from the gateway (`new_request_id`), whatever the client sent: it travels with
every hop, as the `X-Request-Id` header (vLLM builds its own request ids from it) and in
`vllm_xargs` (`eldr_request_id`, read by the capture plugin in the prefill engine, which
publishes the `PrefillDone` under that id, with `eldr_reply_to` = the gateway's decision
inbox). The client's own `X-Request-Id` is a label only (`eldr_client_request_id`, carried
into the records as `client_request_id`, and echoed in the response): two requests with the
same client id never share a decision, a commit, a waiter or a finish event.

A client's body is parsed once (`parse_body`) with its prompt left as it came: the
"prompt" and "messages" values stay raw JSON (`msgspec.Raw`), forwarded verbatim to vLLM,
which parses them itself. So a 24 MB token list is never turned into millions of Python
objects on the gateway's event loop (it took about a second there), deep nesting is a 400
rather than a RecursionError (500), and the prompt's size is checked from its bytes
(`BodyLimits`).

No I/O here: bodies in, bodies out.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import msgspec

from eldr.wire import Decision

XARG_REQUEST_ID = "eldr_request_id"
XARG_REPLY_TO = "eldr_reply_to"
XARG_MAX_TOKENS = "eldr_max_tokens"
XARG_DECISION_BUDGET = "eldr_decision_budget_s"
"""How long the gateway waits for the decision after the prefill answered: the capture
plugin turns it into the PrefillDone's deadline."""
XARG_CLIENT_REQUEST_ID = "eldr_client_request_id"
"""The client's own `X-Request-Id`, a label the capture plugin copies into the PrefillDone."""
XARG_PREFIX = "eldr_"
"""`vllm_xargs` keys of this prefix are the gateway's: a client's own are dropped."""
REQUEST_ID_HEADER = "X-Request-Id"
ELDR_REQUEST_ID_HEADER = "X-Eldr-Request-Id"
"""Response header with the gateway's own id of the request (what its records are under)."""
DECODE_WORKER_HEADER = "X-Eldr-Decode-Worker"
"""Response header naming the decode instance that answered."""
MAX_REQUEST_ID_LEN = 200
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,200}$")
_HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "content-encoding"})
"""Headers of the decode's response that describe that hop, not the answer: not forwarded."""

PREFILL_KV_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
"""What a prefill request carries: produce KV for a remote decode (vLLM's PD protocol)."""


DRIVEN_CONNECTORS: Mapping[str, str] = {
    "NixlConnector": "pull: the prefill's kv_transfer_params name its blocks, the decode "
    "instance pulls them (the supported hand-off)",
    "ExampleConnector": "a shared directory (vLLM's example connector: tests, one host)",
}
"""KV connectors whose hand-off is the gateway's: decide after the prefill, then send the
prefill's `kv_transfer_params` with the request to the decode instance it chose."""
UNDRIVEN_CONNECTORS: Mapping[str, str] = {
    "MooncakeConnector": "it needs a transfer id the proxy invents for both legs; without "
    "it the prefill frees its KV and the decode recomputes the whole prompt",
    "LMCacheConnectorV1": "its disaggregated mode pushes the KV to a decode instance named "
    "before the prefill, and ELDR chooses the decode instance after it",
    "MoRIIOConnector": "it names the decode instance before the prefill",
    "P2pNcclConnector": "it is gone from vLLM's connector registry",
}


def connector_problem(connector: str | None) -> str | None:
    """Why the gateway cannot drive an instance running KV connector `connector` (its
    class name from `kv_transfer_config`), or None when it can."""
    if connector in DRIVEN_CONNECTORS:
        return None
    supported = "supported: NixlConnector (pull), ExampleConnector (tests, one host)"
    if connector is None:
        return f"it runs no KV connector (start it with --kv-transfer-config; {supported})"
    why = UNDRIVEN_CONNECTORS.get(connector)
    detail = f": {why}" if why else ""
    return f"it runs {connector}, which the gateway cannot drive{detail} ({supported})"


class BadRequestError(ValueError):
    """The client's request cannot be served; the message goes back in the error body."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


_VLLM_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
"""The `type` vLLM's API server gives its own errors; any other status gets its HTTP
phrase, as vLLM's handler of HTTP exceptions does (vllm/entrypoints/serve/
exception_handling)."""


def openai_error(
    message: str, status: int, *, param: str | None = None, error_type: str | None = None
) -> dict[str, Any]:
    """An error body in vLLM's shape: `{"error": {"message", "type", "param", "code"}}`
    with `code` the HTTP status (an int) and `type` vLLM's name for it (`error_type`
    when given: vLLM types the errors of its HTTP layer, an unknown path or method, by
    the status's phrase)."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Error"
    kind = error_type or _VLLM_ERROR_TYPES.get(status, phrase)
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def stream_error_event(message: str, status: int = 502) -> bytes:
    """How vLLM ends a stream that failed after it started: one `data:` event with the
    error body, then `data: [DONE]` (the HTTP status was 200 already)."""
    body = json.dumps(openai_error(message, status))
    return f"data: {body}\n\ndata: [DONE]\n\n".encode()


def new_request_id() -> str:
    """A fresh id for one client request: the key of all its records (PrefillDone
    de-duplication, the decision commit, the gateway's waiter, finish events, profiles)."""
    return f"eldr-{uuid.uuid4().hex}"


def client_request_id_from(header: str | None) -> str | None:
    """The client's `X-Request-Id`, validated (a label on the records; never a key), or
    None when it sent none."""
    if header is None:
        return None
    if not _REQUEST_ID.match(header):
        raise BadRequestError(
            f"{REQUEST_ID_HEADER} must be 1-{MAX_REQUEST_ID_LEN} characters of [A-Za-z0-9._:@/+=-]",
            param=REQUEST_ID_HEADER,
        )
    return header


def _own_xargs(body: Mapping[str, Any]) -> dict[str, Any]:
    """The client's `vllm_xargs` without the keys the gateway sets (`XARG_PREFIX`)."""
    xargs = body.get("vllm_xargs") or {}
    return {k: v for k, v in xargs.items() if not str(k).startswith(XARG_PREFIX)}


RAW_FIELDS = ("prompt", "messages")
"""Body fields kept as raw JSON (the prompt: by far the largest part, parsed by vLLM)."""
DEFAULT_MAX_BODY_BYTES = 8 << 20
DEFAULT_MAX_PROMPT_BYTES = 4 << 20
DEFAULT_MAX_PROMPT_TOKENS = 262_144

_TOP_LEVEL = msgspec.json.Decoder(dict[str, msgspec.Raw])
_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_ENCODER = msgspec.json.Encoder()


@dataclass(frozen=True)
class BodyLimits:
    """What one client request may hold (the gateway's settings)."""

    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    """Bytes of the prompt ("prompt", or all of "messages") as JSON."""
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    """Token ids of a prompt given as token ids (a list of them, or of lists)."""


def parse_body(data: bytes, *, chat: bool, limits: BodyLimits | None = None) -> dict[str, Any]:
    """The client's JSON body, validated (`check_body`), with its prompt as raw JSON.

    Raises BadRequestError (a 400) for anything that is not a JSON object, nested too
    deeply to parse, or whose prompt is beyond `limits`.
    """
    limits = limits or BodyLimits()
    try:
        top = _TOP_LEVEL.decode(data)
        body: dict[str, Any] = {
            key: raw if key in RAW_FIELDS else msgspec.json.decode(raw) for key, raw in top.items()
        }
    except RecursionError:
        raise BadRequestError("the request body is nested too deeply") from None
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"the request body must be a JSON object: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadRequestError(f"the request body is not JSON: {exc}") from None
    body = check_body(body, chat=chat)
    key = "messages" if chat else "prompt"
    prompt = bytes(body[key])
    if len(prompt) > limits.max_prompt_bytes:
        raise BadRequestError(
            f"'{key}' has {len(prompt):,} bytes, more than the {limits.max_prompt_bytes:,} "
            "this gateway accepts",
            param=key,
        )
    if not chat and prompt.startswith(b"["):
        # Token ids (or a list of prompts): at most one element per comma, plus one.
        elements = prompt.count(b",") + 1
        if elements > limits.max_prompt_tokens:
            raise BadRequestError(
                f"'prompt' lists about {elements:,} token ids, more than the "
                f"{limits.max_prompt_tokens:,} this gateway accepts",
                param="prompt",
            )
    return body


def encode_body(body: Mapping[str, Any]) -> bytes:
    """JSON bytes of a body for an upstream (raw fields verbatim)."""
    return _ENCODER.encode(body)


def check_body(body: Any, *, chat: bool) -> dict[str, Any]:
    """Validate what the gateway itself relies on (vLLM validates the rest). "messages"
    may be a list or, as `parse_body` leaves it, raw JSON."""
    if not isinstance(body, dict):
        raise BadRequestError("the request body must be a JSON object")
    if chat:
        messages = body.get("messages")
        if isinstance(messages, msgspec.Raw):
            try:
                messages = _RAW_LIST.decode(messages)
            except (msgspec.DecodeError, RecursionError):
                messages = None
        if not isinstance(messages, list) or not messages:
            raise BadRequestError("'messages' must be a non-empty list", param="messages")
    elif "prompt" not in body:
        raise BadRequestError("'prompt' is required", param="prompt")
    _check_sampling(body)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequestError("'stream' must be a boolean", param="stream")
    xargs = body.get("vllm_xargs")
    if xargs is not None and not isinstance(xargs, dict):
        raise BadRequestError("'vllm_xargs' must be an object", param="vllm_xargs")
    if "kv_transfer_params" in body:
        raise BadRequestError(
            "'kv_transfer_params' is set by the gateway", param="kv_transfer_params"
        )
    return body


N_UNSUPPORTED = (
    "disaggregated prefill/decode serving does not support `n > 1` (each of the n "
    "sequences would pull the one prefilled KV cache on its own, which the KV connectors "
    "do not support); please set `n` to 1 and send n requests"
)
BEAM_SEARCH_UNSUPPORTED = (
    "disaggregated prefill/decode serving does not support beam search (its beams are "
    "requests of their own, each needing its own prefill); please set `use_beam_search` "
    "to False"
)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_sampling(body: Mapping[str, Any]) -> None:
    """The fields the prefill leg changes (`prefill_body`) are checked here, with vLLM's
    own messages, so that a request vLLM would refuse costs no prefill first: the prefill
    instance never sees the client's `max_tokens`, `min_tokens` or `n`. Every other field
    reaches the prefill instance unchanged, which refuses it before it computes anything."""
    n = body.get("n", 1)
    if n is not None and not _is_int(n):
        raise BadRequestError("`n` must be an integer", param="n")
    if n is not None and n < 1:
        raise BadRequestError(f"n must be at least 1, got {n}.", param="n")
    if n is not None and n > 1:
        raise BadRequestError(N_UNSUPPORTED, param="n")
    if body.get("use_beam_search"):
        raise BadRequestError(BEAM_SEARCH_UNSUPPORTED, param="use_beam_search")
    budget: int | None = None
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if not _is_int(value):
            raise BadRequestError(f"`{key}` must be an integer", param=key)
        if value < 1:
            # vLLM serves `max_tokens = 0` only as an echo of the prompt (no decode at all):
            # nothing for a decode instance to do.
            raise BadRequestError(f"max_tokens must be at least 1, got {value}.", param=key)
        budget = value if budget is None else budget
    for key in ("min_tokens", "min_completion_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if not _is_int(value):
            raise BadRequestError(f"`{key}` must be an integer", param=key)
        if value < 0:
            raise BadRequestError(
                f"min_tokens must be greater than or equal to 0, got {value}.", param=key
            )
        if budget is not None and value > budget:
            raise BadRequestError(
                f"min_tokens must be less than or equal to max_tokens={budget}, got {value}.",
                param=key,
            )


PREFILL_DROPPED = ("stream_options", "min_tokens", "min_completion_tokens")
"""Client fields that cannot apply to the one-token prefill leg (vLLM's own disaggregated
proxy drops the same: `min_tokens` > 1 with `max_tokens` = 1 is a 400); the decode leg
gets them."""


def max_tokens_of(body: Mapping[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None


def prefill_body(
    body: Mapping[str, Any],
    request_id: str,
    reply_to: str,
    decision_budget_s: float | None = None,
    client_request_id: str | None = None,
) -> dict[str, Any]:
    """The request for the prefill instance: one token, no streaming, KV kept for a remote
    decode, the ids the capture plugin publishes the PrefillDone under and how long the
    gateway will wait for the decision (the event's deadline). A shallow copy: nested
    values are replaced, never changed in place."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in PREFILL_DROPPED:
        out.pop(key, None)
    out["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    xargs = _own_xargs(body)
    xargs[XARG_REQUEST_ID] = request_id
    xargs[XARG_REPLY_TO] = reply_to
    budget = max_tokens_of(body)
    if budget is not None:
        xargs[XARG_MAX_TOKENS] = budget
    if decision_budget_s is not None:
        xargs[XARG_DECISION_BUDGET] = float(decision_budget_s)
    if client_request_id is not None:
        xargs[XARG_CLIENT_REQUEST_ID] = client_request_id
    out["vllm_xargs"] = xargs
    return out


def decode_body(
    body: Mapping[str, Any],
    kv_transfer_params: Mapping[str, Any] | None,
    request_id: str | None = None,
) -> dict:
    """The request for the decode instance: the client's, plus the prefill's KV handle
    and (in `vllm_xargs`) the request id its decode summary is published under."""
    out = dict(body)
    if kv_transfer_params is not None:
        out["kv_transfer_params"] = dict(kv_transfer_params)
    if request_id is not None or "vllm_xargs" in out:
        xargs = _own_xargs(body)
        if request_id is not None:
            xargs[XARG_REQUEST_ID] = request_id
        out["vllm_xargs"] = xargs
    return out


def decode_candidates(decision: Decision | None, decoders: Sequence[str]) -> list[str]:
    """Decode workers to try, in order: the decision's worker, then its locality band,
    then the rest by score, then every other configured decoder (a decision names only
    workers the router knew; any configured one can take the KV)."""
    known = set(decoders)
    order: list[str] = []
    if decision is not None:
        ranked: tuple[Iterable[str], ...] = (
            [decision.worker_id],
            decision.band,
            (w for w, _ in decision.scores),
            decision.workers_seen,
        )
        for group in ranked:
            for worker in group:
                if worker in known and worker not in order:
                    order.append(worker)
    order.extend(w for w in decoders if w not in order)
    return order


def id_headers(request_id: str, client_request_id: str | None) -> dict[str, str]:
    """The ids a response carries: `X-Request-Id` is the client's own when it sent one
    (else the gateway's), `X-Eldr-Request-Id` the gateway's (what the records are under)."""
    return {
        REQUEST_ID_HEADER: client_request_id or request_id,
        ELDR_REQUEST_ID_HEADER: request_id,
    }


def response_headers(
    upstream: Iterable[tuple[str, str]],
    request_id: str,
    decode_worker: str,
    client_request_id: str | None = None,
) -> dict[str, str]:
    """Headers for the client's response: the decode instance's, less the hop-by-hop ones,
    plus the request ids (`id_headers`) and the decode instance that answered."""
    ours = id_headers(request_id, client_request_id)
    ours[DECODE_WORKER_HEADER] = decode_worker
    # Case-insensitively: vLLM echoes `x-request-id` (the gateway's id) in its own case.
    replaced = _HOP_HEADERS | {k.lower() for k in ours}
    headers = {k: v for k, v in upstream if k.lower() not in replaced}
    headers.update(ours)
    return headers


CLIENT_GONE_STATUS = 499
"""The status a handler returns for a client that already left (it is never sent)."""


def request_outcome(status: int) -> str:
    """The `outcome` label of a client request answered with HTTP `status` (499: the
    client went away, nginx's code for it; nothing reached the client)."""
    if status == CLIENT_GONE_STATUS:
        return "aborted"
    return "ok" if status < 400 else "client_error" if status < 500 else "upstream_error"


@dataclass
class LeastOutstanding:
    """Pick the instance with the fewest requests in flight; ties go round-robin."""

    names: Sequence[str]
    outstanding: dict[str, int] = field(default_factory=dict)
    _next: int = 0

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("no instances to pick from")
        for name in self.names:
            self.outstanding.setdefault(name, 0)

    def pick(self, exclude: Iterable[str] = ()) -> str | None:
        skip = set(exclude)
        n = len(self.names)
        best: str | None = None
        for i in range(n):
            name = self.names[(self._next + i) % n]
            if name in skip:
                continue
            if best is None or self.outstanding[name] < self.outstanding[best]:
                best = name
        if best is not None:
            self._next = (self.names.index(best) + 1) % n
        return best

    def acquire(self, name: str) -> None:
        self.outstanding[name] += 1

    def release(self, name: str) -> None:
        self.outstanding[name] = max(0, self.outstanding[name] - 1)


def decode_order(decision: Decision | None, picker: LeastOutstanding) -> list[str]:
    """Decode instances to try (`decode_candidates` over the picker's instances); without
    a decision, the one with the fewest requests in flight goes first."""
    candidates = decode_candidates(decision, list(picker.names))
    if decision is None:
        best = picker.pick()
        if best is not None:
            candidates.remove(best)
            candidates.insert(0, best)
    return candidates


def parse_instances(spec: str, what: str) -> dict[str, str]:
    """`"id=url,id=url"` -> {id: url}; ids are subject tokens, urls http(s)://host:port."""
    out: dict[str, str] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        name, sep, url = item.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not sep or not re.match(r"^[A-Za-z0-9_-]{1,128}$", name):
            raise ValueError(f"{what}: expected id=url, got {item!r}")
        if not re.match(r"^https?://[^/\s]+$", url):
            raise ValueError(f"{what}: {url!r} is not http(s)://host:port")
        if name in out:
            raise ValueError(f"{what}: {name!r} given twice")
        out[name] = url
    if not out:
        raise ValueError(f"{what}: no instance given")
    return out
