"""The gateway's HTTP front door, apart from the request flow: errors in vLLM's shape,
optional API keys, and the writes to a client that may have gone away.

- `error_response`: an error body in vLLM's shape (`eldr.vllm.pd.openai_error`);
- `vllm_shaped_errors`: aiohttp's own 404 / 405 / 413 answers (plain text) in that shape;
- `api_key_check`: `Authorization: Bearer <key>` on /v1/* when keys are configured,
  answered as vLLM's `--api-key` answers (401 `{"error": "Unauthorized"}`);
- `ClientAnswer`: an upstream's 4xx passed back as it came;
- `to_client` / `ClientGone`: a write to a client that disconnected;
- `client_gone` / `unless_client_leaves`: the client's connection watched directly, where
  nothing is written to it for a while (a whole answer comes only at its end).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from http import HTTPStatus
from typing import Any, TypeVar

from aiohttp import web

from eldr.vllm.pd import openai_error

JSON = "application/json"
GUARDED_PREFIX = "/v1"
"""Paths that need a key when keys are configured (vLLM guards /v1 as well; /health,
/version and /tokenize stay open)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    error_type: str | None = None,
) -> web.Response:
    return web.json_response(
        openai_error(message, status, param=param, error_type=error_type),
        status=status,
        headers=headers,
    )


@web.middleware
async def vllm_shaped_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp answers an unknown path, a wrong method or an oversized body in plain text;
    vLLM (FastAPI) answers them as JSON errors whose message and type are the status's
    phrase. So does the gateway."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        phrase = HTTPStatus(exc.status).phrase
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return error_response(exc.status, phrase, headers=headers, error_type=phrase)


def api_key_check(keys: Iterable[str], on_refused: Callable[[], None]) -> Any:
    """Middleware refusing /v1/* requests without one of `keys` (compared by digest, in
    constant time, as vLLM does); `on_refused` counts each refusal."""
    digests = [hashlib.sha256(k.encode()).digest() for k in keys]

    def allowed(header: str | None) -> bool:
        if not header:
            return False
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        match = False
        for known in digests:
            match |= secrets.compare_digest(digest, known)
        return match

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            request.method != "OPTIONS"
            and request.path.startswith(GUARDED_PREFIX)
            and not allowed(request.headers.get("Authorization"))
        ):
            on_refused()
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    return check


class ClientGone(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Writing to the client failed: it disconnected."""


async def to_client(write: Awaitable[Any]) -> None:
    """Await a write to the client, turning its disconnection into `ClientGone` (which
    the upstream-read handlers do not catch: aiohttp's reset error is also a
    ClientConnectionError)."""
    try:
        await write
    except ConnectionResetError as exc:
        raise ClientGone(str(exc)) from exc


T = TypeVar("T")

CLIENT_POLL_S = 0.25
"""How often a wait that writes nothing to the client looks at its connection."""


def client_gone(request: web.Request) -> bool:
    """Whether the client's connection is closed (aiohttp drops the transport then)."""
    transport = request.transport
    return transport is None or transport.is_closing()


async def unless_client_leaves(
    request: web.Request, work: Coroutine[Any, Any, T], poll_s: float = CLIENT_POLL_S
) -> T:
    """Await `work` (whose cancellation releases what it holds: a cancelled upstream
    request closes its connection, and vLLM aborts it); when the client's connection
    closes first, cancel it and raise `ClientGone`.

    A client that disconnects cancels its handler, which does the same; this check does
    not depend on that one cancellation, which an await that completes as it arrives can
    lose (Python 3.11's `asyncio.wait_for` returns the result then)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if client_gone(request):
                raise ClientGone("the client closed its connection")
    finally:
        if not task.done():
            task.cancel()
            # Wait for the cancelled work to let go; what it ended with is not ours.
            await asyncio.wait({task})
            if not task.cancelled():
                task.exception()


class ClientAnswer(Exception):  # noqa: N818 - a control-flow signal, not an error
    """An upstream's non-5xx error answer, passed back to the client as it is (a body
    that is not JSON is wrapped in vLLM's error shape)."""

    def __init__(self, status: int, payload: bytes, content_type: str) -> None:
        super().__init__(status)
        self.status = status
        self.payload = payload
        self.content_type = content_type

    def response(self, headers: dict[str, str]) -> web.Response:
        if self.content_type == JSON:
            return web.Response(
                body=self.payload, status=self.status, headers=headers, content_type=JSON
            )
        message = self.payload[:1000].decode("utf-8", "replace")
        return error_response(self.status, message, headers=headers)
