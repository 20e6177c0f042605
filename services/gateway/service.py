"""Gateway: OpenAI-compatible front door doing vLLM's disaggregated prefill -> decode flow.

For each `/v1/completions` or `/v1/chat/completions` request:

1. Give the request its own id (`new_request_id`): it travels with every hop and is the
   id the decision, the finish events and the profile are recorded under. The client's
   `X-Request-Id`, if any, is only a label (`client_request_id` on the records) and comes
   back in the response's `X-Request-Id`; `X-Eldr-Request-Id` carries the gateway's id.
2. Send the prompt to the prefill instance with the fewest requests in flight, with
   `max_tokens = 1`, `kv_transfer_params.do_remote_decode`, and `vllm_xargs` naming the
   request id and this gateway's decision inbox. The capture plugin in that engine
   publishes the block summaries and the `PrefillDone` (with `reply_to` = the inbox); the
   routing service answers there with the `Decision`. (With
   `ELDR_GATEWAY_SIGNATURE_SOURCE=routed_experts` the gateway publishes them itself from
   the prefill's response, see `eldr.vllm.sources`.)
3. Wait for the decision (`gateway_decision_timeout_s`); when it does not come, read it
   from the DECISIONS stream (the reply may have been lost), and only then fall back to
   the decode instance with the fewest requests in flight (counted, logged).
4. Send the client's request, with the prefill's `kv_transfer_params`, to the decided
   decode instance and stream its answer back. A decode instance that fails before the
   first byte reached the client (connection refused, 5xx) is replaced by the next
   candidate: the decision's band, then its scores, then any other configured decoder.

Client errors get OpenAI-style error bodies (`{"error": {...}}`) with the upstream's
status, or 400 / 502 / 503 / 504 from the gateway itself. vLLM's `/health` is 200 while the
gateway can serve. `/healthz`, `/readyz` and `/metrics` are every service's (`eldr.runtime`,
on `ELDR_METRICS_PORT`): ready once the bus is connected and at least one prefill and one
decode instance answer their `/health` (the `upstreams` check).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from eldr.bus import BusError, Delivery, build_topology
from eldr.bus.topology import DECISIONS, IDENTITY
from eldr.core.workload.trace import ModelGeometry
from eldr.roles.prefill import unavailable_prefill_done
from eldr.roles.requester import DecisionWaiters, FinishTracker, InFlight
from eldr.runtime import ServiceContext, service_main
from eldr.vllm.gateway import (
    CaptureWatch,
    SseRelay,
    UpstreamHealth,
    prompt_tokens_of,
    response_outcome,
    response_sources,
)
from eldr.vllm.moe_layers import moe_layer_ids, num_routed_experts, parse_layer_ids, text_config
from eldr.vllm.pd import (
    CLIENT_GONE_STATUS,
    REQUEST_ID_HEADER,
    BadRequestError,
    BodyLimits,
    LeastOutstanding,
    client_request_id_from,
    connector_problem,
    decode_body,
    decode_order,
    encode_body,
    id_headers,
    max_tokens_of,
    new_request_id,
    parse_body,
    prefill_body,
    request_outcome,
    response_headers,
    stream_error_event,
)
from eldr.vllm.sources import RETURN_FIELDS, LayerMap, ResponseSource, SourceError
from eldr.wire import CaptureStatus, Decision, RequestFinished
from eldr.wire.messages import FinishReason

from .front import (
    JSON,
    ClientAnswer,
    ClientGone,
    api_key_check,
    client_gone,
    error_response,
    to_client,
    unless_client_leaves,
    vllm_shaped_errors,
)
from .metrics import GatewayMetrics
from .settings import GatewaySettings

log = logging.getLogger(__name__)

NAME = "gateway"


class UpstreamError(Exception):
    """An upstream instance could not be reached or failed (5xx) before answering.
    `reached`: whether the request may have reached its engine (a decode instance that
    may have pulled the prefill's KV blocks: a retry elsewhere needs a fresh prefill)."""

    def __init__(self, message: str, *, reached: bool = True) -> None:
        super().__init__(message)
        self.reached = reached


class Unavailable(Exception):  # noqa: N818 - a control-flow signal, not an error
    """No instance of a role is healthy: answered 503 at once."""

    def __init__(self, role: str, down: list[str]) -> None:
        super().__init__(f"no {role} instance is healthy ({', '.join(down)} down)")
        self.role = role


class Gateway:
    def __init__(self, ctx: ServiceContext[GatewaySettings], session: aiohttp.ClientSession):
        self.ctx = ctx
        self.settings = s = ctx.settings
        self.session = session
        self.metrics = GatewayMetrics(ctx.registry)
        self.prefills = s.prefill_instances()
        self.decoders = s.decode_instances()
        self.prefill_picker = LeastOutstanding(list(self.prefills))
        self.decode_picker = LeastOutstanding(list(self.decoders))
        self.health = UpstreamHealth(
            [("prefill", n) for n in self.prefills] + [("decode", n) for n in self.decoders]
        )
        self.inbox = ctx.bus.new_inbox()
        self.decisions = DecisionWaiters()
        self.decisions_stream = build_topology(s.namespace, s).stream_name(DECISIONS)
        self.requests = InFlight()
        self.response_sources: dict[str, ResponseSource] = {}
        """Per prefill instance, when the gateway publishes the prefill's routing itself."""
        self.capture = CaptureWatch(
            self.prefills,
            started_s=time.monotonic(),
            grace_s=s.gateway_capture_grace_s,
        )
        self._capture_said: dict[str, str | None] = {}
        self.limits = BodyLimits(
            max_prompt_bytes=s.gateway_max_prompt_bytes,
            max_prompt_tokens=s.gateway_max_prompt_tokens,
        )
        self._probes: dict[tuple[str, str], asyncio.Task[None]] = {}
        self.refused: dict[tuple[str, str], str] = {}
        """Instances whose KV connector the gateway cannot drive (from their status)."""
        key = s.gateway_upstream_api_key
        self._upstream_auth = None if key is None else f"Bearer {key.get_secret_value()}"

    # --- decisions ------------------------------------------------------------------------

    async def on_decision(self, decision: Decision, _: Delivery) -> None:
        self.decisions.deliver(decision)

    async def read_decision(self, request_id: str) -> Decision | None:
        """The decision recorded on the DECISIONS stream (when the inbox reply is late);
        None also when the stream cannot be read (the request falls back)."""
        bus = self.ctx.bus
        try:
            return await bus.get_last(
                self.decisions_stream, bus.subjects.decision(request_id), Decision
            )
        except BusError as exc:
            log.warning("decision of %s: stream read failed: %s", request_id, exc)
            return None

    # --- upstream calls -------------------------------------------------------------------

    def _timeout(self, *, streamed: bool = False) -> aiohttp.ClientTimeout:
        """A streamed decode is bounded by its silences only (a long healthy stream is
        never cut); any other upstream answer as a whole."""
        s = self.settings
        if streamed:
            return aiohttp.ClientTimeout(
                total=None,
                sock_connect=s.gateway_connect_timeout_s,
                sock_read=s.gateway_upstream_idle_timeout_s,
            )
        return aiohttp.ClientTimeout(
            total=s.gateway_upstream_timeout_s, sock_connect=s.gateway_connect_timeout_s
        )

    def upstream_headers(self, request: web.Request, request_id: str | None) -> dict[str, str]:
        """Headers of a request to a vLLM instance: its id, and the key (the gateway's own
        upstream key, else the client's Authorization header as it came)."""
        headers = {"Content-Type": JSON}
        if request_id is not None:
            headers[REQUEST_ID_HEADER] = request_id
        auth = self._upstream_auth or request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        return headers

    def _healthy(self, role: str, names: list[str]) -> list[str]:
        """`names` less the instances known to be down; Unavailable when none is left."""
        healthy = [n for n in names if self.health.healthy(role, n)]
        if not healthy and names:
            self.metrics.no_healthy_upstream.labels(role).inc()
            raise Unavailable(role, names)
        return healthy

    def _down(self, role: str, name: str, why: str) -> None:
        """A request found the instance unreachable: out of rotation until a probe passes."""
        if self.health.mark(role, name, False):
            self._say_health(role, name, False, why)

    async def prefill(
        self, request: web.Request, path: str, body: dict[str, Any], request_id: str
    ) -> tuple[str, dict[str, Any]]:
        """Run the prefill on one healthy instance (another one if the first cannot be
        reached). Returns (instance id, response JSON); raises `UpstreamError`,
        `Unavailable`, or `ClientAnswer` (the upstream's 4xx, passed back as it is)."""
        tried: list[str] = []
        reconnected: set[str] = set()
        headers = self.upstream_headers(request, request_id)
        while True:
            down = [n for n in self.prefills if not self.health.healthy("prefill", n)]
            name = self.prefill_picker.pick(exclude=[*tried, *down])
            if name is None:
                if not tried:
                    self.metrics.no_healthy_upstream.labels("prefill").inc()
                    raise Unavailable("prefill", down)
                raise UpstreamError(f"no prefill instance reachable (tried {', '.join(tried)})")
            tried.append(name)
            self.prefill_picker.acquire(name)
            started = time.perf_counter()
            try:
                async with self.session.post(
                    self.prefills[name] + path,
                    data=encode_body(body),
                    headers=headers,
                    timeout=self._timeout(),
                ) as resp:
                    payload = await resp.read()
                    if resp.status >= 500:
                        log.warning(
                            "prefill %s failed for %s: HTTP %d", name, request_id, resp.status
                        )
                        self._probe_soon("prefill", name)
                        continue
                    if resp.status != 200:
                        raise ClientAnswer(resp.status, payload, resp.content_type)
                    self.metrics.prefill_seconds.observe(time.perf_counter() - started)
                    return name, json.loads(payload)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # Most often a kept-alive connection the server closed as we sent on it:
                # nothing reached the engine, so the same instance is asked once more.
                if name not in reconnected and not isinstance(exc, aiohttp.ClientConnectorError):
                    reconnected.add(name)
                    tried.remove(name)
                    self.metrics.prefill_reconnects.inc()
                    log.info(
                        "prefill %s dropped the connection for %s (%s); again",
                        name,
                        request_id,
                        exc,
                    )
                else:
                    log.warning("prefill %s unreachable for %s: %s", name, request_id, exc)
                    self._down("prefill", name, str(exc))
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                log.warning("prefill %s unreachable for %s: %s", name, request_id, exc)
                if isinstance(exc, aiohttp.ClientConnectorError):
                    self._down("prefill", name, str(exc))
            finally:
                self.prefill_picker.release(name)

    async def decode(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        kv_transfer_params: Any,
        candidates: list[str],
        finish: FinishTracker,
        prefill_again: Callable[[], Awaitable[Any]],
    ) -> web.StreamResponse:
        """Send the request to the first candidate that answers; stream its answer. A
        candidate that failed after the request may have reached it (it may have pulled
        the prefill's KV blocks) makes the next one get a fresh prefill first
        (`prefill_again`, which returns its `kv_transfer_params`). Every move to the next
        candidate and the end of the request become finish events."""
        attempts = candidates[: self.settings.gateway_max_decode_attempts]
        last_error = "no decode instance"
        previous: str | None = None
        fresh_kv_needed = False
        for n, name in enumerate(attempts):
            if n:
                self.metrics.decode_retries.inc()
            if previous is not None:
                await self._publish_finish(finish.moved(previous, name))
            if fresh_kv_needed:
                self.metrics.reprefills.inc()
                kv_transfer_params = await prefill_again()
            previous = name
            self.decode_picker.acquire(name)
            try:
                return await self._decode_once(
                    request,
                    path,
                    decode_body(body, kv_transfer_params, finish.request_id),
                    name,
                    finish,
                )
            except UpstreamError as exc:
                last_error = str(exc)
                fresh_kv_needed = exc.reached
                log.warning(
                    "decode %s failed for %s before streaming: %s", name, finish.request_id, exc
                )
            finally:
                self.decode_picker.release(name)
        await self._publish_finish(finish.finished(previous, "error"))
        raise UpstreamError(last_error)

    async def _decode_once(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        name: str,
        finish: FinishTracker,
    ) -> web.StreamResponse:
        started = time.perf_counter()
        request_id = finish.request_id
        streamed = bool(body.get("stream"))
        try:
            # Nothing reaches the client until the headers come (for a whole answer, at
            # its end), so its connection is watched meanwhile.
            resp = await unless_client_leaves(
                request,
                self.session.post(
                    self.decoders[name] + path,
                    data=encode_body(body),
                    headers=self.upstream_headers(request, request_id),
                    timeout=self._timeout(streamed=streamed),
                ),
            )
        except aiohttp.ClientConnectorError as exc:
            self._down("decode", name, str(exc))
            raise UpstreamError(f"{name}: {exc}", reached=False) from exc
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise UpstreamError(f"{name}: {exc}") from exc
        except (asyncio.CancelledError, ClientGone) as gone:
            # The client went away while this instance worked on the request: the
            # connection is closed, vLLM aborts it, and the abort is this worker's (its
            # adapter counts it).
            # Counted, not logged above debug: a hang-up is a client's right
            # (eldr_gateway_client_aborts_total; its finish event says "abort").
            self.metrics.client_aborts.inc()
            await self._publish_finish(
                finish.finished(name, "abort", decode_s=time.perf_counter() - started)
            )
            if isinstance(gone, asyncio.CancelledError):
                raise
            log.debug("client of %s went away during the decode", request_id)
            return web.Response(status=CLIENT_GONE_STATUS)  # reaches nobody
        reason: FinishReason = "error"
        tokens: int | None = None
        out: web.StreamResponse | None = None
        answered = False
        """Set once this worker took the request (no 5xx, no failure before the first
        byte): from then on its end is this request's final finish event."""
        try:
            async with resp:
                if resp.status >= 500:
                    text = (await resp.read())[:500].decode("utf-8", "replace")
                    self._probe_soon("decode", name)
                    raise UpstreamError(f"{name}: HTTP {resp.status}: {text}")
                headers = response_headers(
                    resp.headers.items(), request_id, name, finish.client_request_id
                )
                if not streamed or resp.status != 200:
                    try:
                        payload = await resp.read()
                    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                        raise UpstreamError(f"{name}: {exc}") from exc
                    answered = True
                    if resp.status == 200:
                        reason, tokens = response_outcome(payload)
                    return web.Response(body=payload, status=resp.status, headers=headers)
                out = stream = web.StreamResponse(status=resp.status, headers=headers)
                relay = SseRelay()
                try:
                    async for chunk in resp.content.iter_any():
                        forward = relay.feed(chunk)
                        if not forward:
                            continue
                        if not answered:
                            answered = True
                            await to_client(stream.prepare(request))
                        await to_client(stream.write(forward))
                    rest = relay.flush()
                    if not answered:
                        answered = True
                        await to_client(stream.prepare(request))
                    if rest:
                        await to_client(stream.write(rest))
                    reason = relay.tally.finish_reason or "stop"
                    tokens = relay.tally.output_tokens
                    if reason == "error":
                        self.metrics.stream_errors.labels("upstream_error").inc()
                    await to_client(stream.write_eof())
                except (
                    aiohttp.ClientPayloadError,
                    aiohttp.ClientConnectionError,
                    TimeoutError,
                ) as exc:
                    # Reading the upstream failed (writes to the client raise ClientGone).
                    if not answered:
                        raise UpstreamError(f"{name}: {exc}") from exc
                    resp.close()  # the decode is aborted: nobody reads it any more
                    idle = isinstance(exc, TimeoutError)
                    self.metrics.stream_errors.labels(
                        "idle_timeout" if idle else "upstream_broken"
                    ).inc()
                    tokens = relay.tally.output_tokens
                    message = (
                        f"the decode instance was silent for "
                        f"{self.settings.gateway_upstream_idle_timeout_s:g} s"
                        if idle
                        else f"the decode instance broke off the stream: {exc}"
                    )
                    log.warning(
                        "decode %s, request %s: %s; the stream ends with an error event",
                        name,
                        request_id,
                        message,
                    )
                    with contextlib.suppress(ClientGone):
                        await to_client(stream.write(stream_error_event(message, 502)))
                        await to_client(stream.write_eof())
                return stream
        except (ClientGone, asyncio.CancelledError) as gone:
            # The client went away (the handler is cancelled, or a write failed): close
            # the upstream connection, which makes vLLM abort the request.
            resp.close()
            if reason == "error":  # not after the upstream had finished
                reason = "abort"
            answered = True
            self.metrics.client_aborts.inc()
            if isinstance(gone, asyncio.CancelledError):
                raise
            log.debug("client of %s went away mid-stream", request_id)
            # The client is gone: what is returned reaches nobody.
            return out if out is not None else web.Response(status=CLIENT_GONE_STATUS)
        finally:
            if answered:
                await self._publish_finish(
                    finish.finished(
                        name, reason, output_tokens=tokens, decode_s=time.perf_counter() - started
                    )
                )

    async def _publish_finish(self, event: RequestFinished | None) -> None:
        """Core publish of a finish event (never raises: a lost event only delays the
        routers' bookkeeping until their bounds catch it)."""
        if event is None:
            return
        bus = self.ctx.bus
        try:
            await bus.publish(bus.subjects.finished(event.gateway_id), event)
            self.metrics.finish_events.labels(event.reason).inc()
        except BusError as exc:
            self.metrics.finish_events.labels("unpublished").inc()
            log.warning("finish event of %s not published: %s", event.request_id, exc)

    # --- handlers -------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/completions", chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/chat/completions", chat=True)

    async def _serve(self, request: web.Request, path: str, *, chat: bool) -> web.StreamResponse:
        endpoint = "chat" if chat else "completions"
        if not self.requests.enter():
            self.metrics.requests.labels(endpoint, "unavailable").inc()
            return error_response(503, "the gateway is shutting down")
        self.metrics.in_flight.set(self.requests.count)
        outcome = "aborted"
        try:
            response = await self._serve_one(request, path, chat=chat)
            outcome = "unavailable" if response.status == 503 else request_outcome(response.status)
            return response
        finally:
            self.metrics.requests.labels(endpoint, outcome).inc()
            self.requests.leave()
            self.metrics.in_flight.set(self.requests.count)

    async def _serve_one(
        self, request: web.Request, path: str, *, chat: bool
    ) -> web.StreamResponse:
        s = self.settings
        request_id = new_request_id()
        ids = id_headers(request_id, None)
        try:
            client_id = client_request_id_from(request.headers.get(REQUEST_ID_HEADER))
            ids = id_headers(request_id, client_id)
            try:
                async with asyncio.timeout(s.gateway_body_timeout_s):
                    data = await request.read()
            except TimeoutError:
                self.metrics.refused_bodies.labels("timeout").inc()
                return error_response(
                    408,
                    f"the request body did not arrive within {s.gateway_body_timeout_s:g} s",
                    headers=ids,
                )
            except web.HTTPRequestEntityTooLarge:
                self.metrics.refused_bodies.labels("too_large").inc()
                return error_response(
                    413,
                    f"the request body is larger than {s.gateway_max_body_bytes:,} bytes",
                    headers=ids,
                )
            if len(data) > s.gateway_parse_inline_bytes:
                body = await asyncio.to_thread(parse_body, data, chat=chat, limits=self.limits)
            else:
                body = parse_body(data, chat=chat, limits=self.limits)
        except BadRequestError as exc:
            self.metrics.refused_bodies.labels("invalid").inc()
            return error_response(400, str(exc), param=exc.param, headers=ids)
        finish = FinishTracker(request_id, self.settings.instance_id, time.time, client_id)
        outcome: FinishReason = "error"
        try:
            return await self._route_and_decode(request, path, body, finish, ids)
        except Unavailable as exc:
            return error_response(503, str(exc), headers=ids)
        except (asyncio.CancelledError, ClientGone) as gone:
            # The client went away before a decode instance answered (during the prefill,
            # the decision wait): the prefill request was closed with it (vLLM aborts it).
            outcome = "abort"
            if finish.final is None:
                self.metrics.client_aborts.inc()
            if isinstance(gone, asyncio.CancelledError):
                raise
            log.debug("client of %s went away before the decode", request_id)
            return web.Response(status=CLIENT_GONE_STATUS, headers=ids)  # reaches nobody
        finally:
            # Whatever happened before a decode worker took the request (prefill failed,
            # the client went away, no decoder answered), it ends in one finish event.
            if finish.final is None:
                await self._publish_finish(finish.finished(None, outcome))

    async def _route_and_decode(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any],
        finish: FinishTracker,
        ids: dict[str, str],
    ) -> web.StreamResponse:
        request_id = finish.request_id
        pre = prefill_body(
            body,
            request_id,
            self.inbox,
            decision_budget_s=self.settings.gateway_decision_timeout_s,
            client_request_id=finish.client_request_id,
        )
        if self.response_sources:
            pre.update(RETURN_FIELDS)
        # Fail fast when no decode instance is up: before the prefill costs anything.
        self._healthy("decode", list(self.decoders))
        with self.decisions.expecting(request_id) as waiter:
            try:
                prefill_name, prefill_response = await self.prefill(request, path, pre, request_id)
            except ClientAnswer as answer:
                return answer.response(ids)
            except UpstreamError as exc:
                return error_response(502, f"prefill failed: {exc}", headers=ids)
            answered = time.perf_counter()
            if self.response_sources:
                await self._publish_from_response(prefill_response, prefill_name, finish, body)
            else:
                await self._fall_back_if_uncaptured(prefill_name, prefill_response, finish, body)
            decided = await self.decisions.wait(
                request_id,
                waiter,
                timeout_s=self.settings.gateway_decision_timeout_s,
                read_late=self.read_decision,
            )
            # An expired record names no worker: the same fallback as no decision.
            decision = decided.decision if decided and decided.decision.assigned else None
            if decided is not None and decision is not None:
                self.metrics.decisions.labels(decided.source).inc()
            else:
                self.metrics.decisions.labels("fallback").inc()
                log.warning(
                    "no decision for %s within %.3f s; least-loaded decoder instead",
                    request_id,
                    self.settings.gateway_decision_timeout_s,
                )
            self.metrics.decision_wait.observe(time.perf_counter() - answered)
        if client_gone(request):
            # Its handler's cancellation should have ended it already; whatever lost that,
            # no decode starts for a client that has left.
            raise ClientGone("the client left before the decode")
        candidates = self._healthy("decode", decode_order(decision, self.decode_picker))

        async def prefill_again() -> Any:
            _, response = await self.prefill(request, path, pre, request_id)
            return response.get("kv_transfer_params")

        try:
            return await self.decode(
                request,
                path,
                body,
                prefill_response.get("kv_transfer_params"),
                candidates,
                finish,
                prefill_again,
            )
        except ClientAnswer as answer:  # the prefill run again for a retry refused it
            return answer.response(ids)
        except UpstreamError as exc:
            return error_response(502, f"decode failed: {exc}", headers=ids)

    async def _fall_back_if_uncaptured(
        self,
        prefill_name: str,
        response: dict[str, Any],
        finish: FinishTracker,
        body: dict[str, Any],
    ) -> None:
        """When the prefill instance's capture cannot produce this request's PrefillDone
        (its plugin says it is off or failed, or it never said anything), publish one
        without a signature so that a router decides load-only now."""
        problem = self.capture.problem(prefill_name, time.monotonic())
        self._note_capture(prefill_name, problem)
        if problem is None:
            return
        self.metrics.capture_fallbacks.labels(problem).inc()
        status = self.capture.last(prefill_name)
        geometry = None
        if status is not None and status.num_moe_layers and status.num_experts:
            geometry = (status.num_moe_layers, status.num_experts)
        request_id = finish.request_id
        event = unavailable_prefill_done(
            request_id=request_id,
            model=str(body.get("model") or ""),
            prefill_worker=prefill_name,
            n_prompt_tokens=prompt_tokens_of(response),
            reply_to=self.inbox,
            max_tokens=max_tokens_of(body),
            block_size=self.settings.gateway_block_size,
            geometry=geometry,
            problem=problem,
            wall_s=time.time(),
            decision_budget_s=self.settings.gateway_decision_timeout_s,
            client_request_id=finish.client_request_id,
        )
        bus = self.ctx.bus
        try:
            await bus.js_publish(bus.subjects.prefill_done(prefill_name), event, msg_id=request_id)
        except BusError as exc:
            log.warning("could not publish the load-only PrefillDone of %s: %s", request_id, exc)

    def _note_capture(self, instance: str, problem: str | None) -> None:
        """Say once, per change, whether an instance's prompts can be captured."""
        if self._capture_said.get(instance, "?") == problem:
            return
        self._capture_said[instance] = problem
        self.metrics.prefill_capture.labels(instance).set(0 if problem else 1)
        if problem is None:
            log.info("prefill %s: capture ok, routing by expert locality", instance)
            return
        status = self.capture.last(instance)
        if status is not None and status.reason:
            detail = f": {status.reason}"
        elif problem == "no_capture_status":
            detail = " (is ELDR_VLLM_CAPTURE=1 set and the eldr plugin installed in that vLLM?)"
        else:
            detail = ""
        log.error(
            "prefill %s: %s%s; its requests are routed load-only until that changes",
            instance,
            problem,
            detail,
        )

    async def on_capture_status(self, status: CaptureStatus, _: Delivery) -> None:
        # Its worker id is the subject's token: the bus refuses any other (IDENTITY).
        self._check_connector(status)
        taken = self.capture.update(status, time.monotonic())
        self.metrics.capture_status.labels("ok" if taken else "other_instance").inc()
        if taken:
            self._note_capture(
                status.worker_id, self.capture.problem(status.worker_id, time.monotonic())
            )

    async def _publish_from_response(
        self, response: dict[str, Any], prefill_name: str, finish: FinishTracker, body: dict
    ) -> None:
        """The routed_experts source: publish blocks and PrefillDone ourselves."""
        request_id = finish.request_id
        try:
            result = self.response_sources[prefill_name].from_response(
                response,
                request_id,
                time.monotonic(),
                time.time(),
                reply_to=self.inbox,
                max_tokens=max_tokens_of(body),
                decision_budget_s=self.settings.gateway_decision_timeout_s,
                client_request_id=finish.client_request_id,
            )
        except SourceError as exc:
            log.warning("no signature for %s from %s: %s", request_id, prefill_name, exc)
            return
        bus = self.ctx.bus
        try:
            for batch in result.batches:
                await bus.js_publish(bus.subjects.blocks(prefill_name), batch)
            for done in result.done:
                await bus.js_publish(
                    bus.subjects.prefill_done(prefill_name), done, msg_id=done.request_id
                )
        except BusError as exc:
            log.warning("could not publish the prefill of %s: %s", request_id, exc)

    def _check_connector(self, status: CaptureStatus) -> None:
        """Refuse (out of rotation, said once, `eldr_gateway_connector_refused`) an
        instance whose KV connector the gateway cannot drive; take it back once its status
        says it runs one it can. Statuses before v2 do not say (nothing is refused)."""
        name = status.worker_id
        roles = [
            r
            for r, known in (("prefill", self.prefills), ("decode", self.decoders))
            if name in known
        ]
        if not roles or status.v < 2:
            return
        problem = connector_problem(status.kv_connector)
        for role in roles:
            key = (role, name)
            before = self.refused.get(key)
            if problem == before:
                continue
            self.metrics.connector_refused.labels(role, name).set(1 if problem else 0)
            if problem is None:
                del self.refused[key]
                log.info("%s instance %s runs %s: in rotation", role, name, status.kv_connector)
                self._probe_soon(role, name)
                continue
            self.refused[key] = problem
            log.error("%s instance %s refused: %s", role, name, problem)
            if self.health.mark(role, name, False):
                self._say_health(role, name, False, problem)

    # --- other endpoints ------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.StreamResponse:
        return await self._pass_through(request, "models", "GET", "/v1/models")

    async def version(self, request: web.Request) -> web.StreamResponse:
        return await self._pass_through(request, "version", "GET", "/version")

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._pass_through(request, "tokenize", "POST", "/tokenize")

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        return await self._pass_through(request, "detokenize", "POST", "/detokenize")

    async def _pass_through(
        self, request: web.Request, endpoint: str, method: str, path: str
    ) -> web.StreamResponse:
        """Ask a healthy instance (prefill first: every instance serves the same model and
        tokenizer) and answer as it answered. `vllm bench serve` and the `openai` SDK call
        these (/v1/models, /tokenize, /detokenize); /version says the engines' version."""
        data = await request.read() if method == "POST" else None
        headers = self.upstream_headers(request, None)
        order = [("prefill", n, u) for n, u in self.prefills.items()] + [
            ("decode", n, u) for n, u in self.decoders.items()
        ]
        order.sort(key=lambda item: not self.health.healthy(item[0], item[1]))
        for role, name, url in order:
            try:
                async with self.session.request(
                    method, url + path, data=data, headers=headers, timeout=self._timeout()
                ) as resp:
                    payload = await resp.read()
                    if resp.status >= 500:
                        continue
                    self.metrics.requests.labels(endpoint, request_outcome(resp.status)).inc()
                    return web.Response(
                        body=payload,
                        status=resp.status,
                        content_type=resp.content_type,
                    )
            except (aiohttp.ClientConnectionError, TimeoutError) as exc:
                log.debug("%s from %s %s: %s", path, role, name, exc)
        self.metrics.requests.labels(endpoint, "unavailable").inc()
        return error_response(503, f"no upstream instance answered {path}")

    async def health_endpoint(self, _: web.Request) -> web.Response:
        """vLLM's /health on the OpenAI port, for clients that probe a vLLM server: 200
        (empty) while the runtime's /readyz would be 200 (a healthy prefill and a healthy
        decode instance, the bus connected), else 503."""
        ok, _detail = self.ctx.readiness()
        return web.Response(status=200 if ok else 503)

    # --- upstream health ------------------------------------------------------------------

    async def _probe(self, role: str, name: str) -> None:
        url = (self.prefills if role == "prefill" else self.decoders)[name]
        why = ""
        try:
            async with self.session.get(
                url + "/health", timeout=aiohttp.ClientTimeout(total=2.0)
            ) as resp:
                ok = resp.status == 200
                why = f"/health answered HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, why = False, f"/health: {exc or type(exc).__name__}"
        if (role, name) in self.refused:  # a connector it cannot drive: stays out
            ok, why = False, self.refused[(role, name)]
        if self.health.mark(role, name, ok, probe=True):
            self._say_health(role, name, ok, why)
        self.metrics.upstream_healthy.labels(role, name).set(1 if ok else 0)

    def _probe_soon(self, role: str, name: str) -> None:
        """After a 5xx: probe the instance now (vLLM's /health answers 503 once its
        engine died), not at the next round; one probe per instance at a time."""
        key = (role, name)
        if key in self._probes:
            return
        task = asyncio.create_task(self._probe(role, name), name=f"probe {role} {name}")
        self._probes[key] = task
        task.add_done_callback(lambda _: self._probes.pop(key, None))

    async def close(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        await asyncio.gather(*self._probes.values(), return_exceptions=True)

    def _say_health(self, role: str, name: str, ok: bool, why: str) -> None:
        self.metrics.upstream_healthy.labels(role, name).set(1 if ok else 0)
        if ok:
            log.info("%s instance %s is back in rotation", role, name)
            return
        others = self.health.names(role, healthy=True)
        log.error(
            "%s instance %s is down (%s): out of rotation until its /health answers; %s",
            role,
            name,
            why,
            f"serving on {', '.join(others)}" if others else f"no {role} instance is left",
        )

    async def probe_once(self) -> None:
        await asyncio.gather(
            *(self._probe("prefill", n) for n in self.prefills),
            *(self._probe("decode", n) for n in self.decoders),
        )

    def upstreams_ready(self) -> bool:
        return self.health.ready("prefill") and self.health.ready("decode")

    async def drain(self) -> None:
        await self.requests.drain(self.settings.gateway_drain_grace_s)


def build_app(gateway: Gateway) -> web.Application:
    middlewares = [vllm_shaped_errors]
    keys = gateway.settings.api_keys()
    if keys:
        middlewares.append(api_key_check(keys, gateway.metrics.unauthorized.inc))
    app = web.Application(
        client_max_size=gateway.settings.gateway_max_body_bytes, middlewares=middlewares
    )
    app.router.add_post("/v1/completions", gateway.completions)
    app.router.add_post("/v1/chat/completions", gateway.chat_completions)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/version", gateway.version)
    app.router.add_post("/tokenize", gateway.tokenize)
    app.router.add_post("/detokenize", gateway.detokenize)
    app.router.add_get("/health", gateway.health_endpoint)
    return app


async def setup(ctx: ServiceContext[GatewaySettings]) -> None:
    s = ctx.settings
    session = aiohttp.ClientSession()
    ctx.stack.push_async_callback(session.close)
    gateway = Gateway(ctx, session)
    ctx.stack.push_async_callback(gateway.close)
    if s.gateway_signature_source == "routed_experts":
        gateway.response_sources = _response_sources(s, list(gateway.prefills))
    await ctx.bus.subscribe(gateway.inbox, Decision, gateway.on_decision)
    if not gateway.response_sources:
        await ctx.bus.subscribe(
            ctx.bus.subjects.capture_all,
            CaptureStatus,
            gateway.on_capture_status,
            identity=IDENTITY[CaptureStatus],
        )
    await gateway.probe_once()
    interval_s = s.gateway_health_interval_s
    ctx.every(
        "upstream-probe", interval_s, gateway.probe_once, first_after_s=interval_s, until="close"
    )
    ctx.add_health_check("upstreams", gateway.upstreams_ready)
    # A client that disconnects cancels its handler: the upstream request (prefill or
    # decode, streamed or not) is closed with it, which makes vLLM abort it.
    runner = web.AppRunner(build_app(gateway), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, s.gateway_host, s.gateway_port)
    await site.start()
    ctx.stack.push_async_callback(runner.cleanup)
    ctx.on_stopping(gateway.drain)
    ctx.set_ready()
    if not s.metrics_port:
        log.warning(
            "gateway %s: ELDR_METRICS_PORT is 0, so no /healthz, /readyz or /metrics "
            "(vLLM's /health is on port %d)",
            s.instance_id,
            s.gateway_port,
        )
    log.info(
        "gateway %s on port %d: prefill %s, decode %s, signature source %s",
        s.instance_id,
        s.gateway_port,
        ", ".join(gateway.prefills),
        ", ".join(gateway.decoders),
        s.gateway_signature_source,
    )


def _response_sources(s: GatewaySettings, prefills: list[str]) -> dict[str, ResponseSource]:
    config: dict[str, Any] = {}
    if s.gateway_model_config is not None:
        try:
            loaded = json.loads(s.gateway_model_config.read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"ELDR_GATEWAY_MODEL_CONFIG {s.gateway_model_config}: {exc}") from exc
        if not isinstance(loaded, dict):
            raise ValueError(f"ELDR_GATEWAY_MODEL_CONFIG {s.gateway_model_config}: not an object")
        config = dict(text_config(loaded))
    layers = _layer_map(s, config)
    n_experts = s.gateway_num_experts or (num_routed_experts(config) if config else None)
    top_k = s.gateway_top_k or _first_int(config, "num_experts_per_tok", "moe_top_k")
    n_moe = s.gateway_num_moe_layers or (layers.num_moe_layers if layers else None)
    if not (n_moe and n_experts and top_k):
        raise ValueError(
            "the routed_experts source needs the geometry: ELDR_GATEWAY_NUM_MOE_LAYERS, "
            "ELDR_GATEWAY_NUM_EXPERTS and ELDR_GATEWAY_TOP_K, or ELDR_GATEWAY_MODEL_CONFIG"
        )
    if not s.gateway_model_key:
        raise ValueError("the routed_experts source needs ELDR_GATEWAY_MODEL_KEY")
    geometry = ModelGeometry.of_moe(n_moe, n_experts, top_k)
    return response_sources(
        prefills,
        model_key=s.gateway_model_key,
        block_size=s.gateway_block_size,
        geometry=geometry,
        layers=layers,
        hash_key=s.block_hash_key_bytes(),
    )


def _layer_map(s: GatewaySettings, config: dict[str, Any]) -> LayerMap | None:
    """Where the MoE layers sit among all hidden layers: the explicit list, else the
    model's config.json, else None (every layer an MoE layer)."""
    if s.gateway_moe_layer_ids:
        hidden = s.gateway_num_hidden_layers or _first_int(config, "num_hidden_layers")
        if not hidden:
            raise ValueError(
                "ELDR_GATEWAY_MOE_LAYER_IDS needs ELDR_GATEWAY_NUM_HIDDEN_LAYERS (or a config.json)"
            )
        return LayerMap.of(hidden, parse_layer_ids(s.gateway_moe_layer_ids))
    if config:
        ids = moe_layer_ids(config)
        if ids is None:
            raise ValueError(
                f"cannot tell the MoE layers of model type {config.get('model_type')!r} from "
                "its config.json: set ELDR_GATEWAY_MOE_LAYER_IDS"
            )
        return LayerMap.of(int(config["num_hidden_layers"]), ids)
    return None


def _first_int(config: dict[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def main() -> int:
    return service_main(NAME, GatewaySettings, setup)
