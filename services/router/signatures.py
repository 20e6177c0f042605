"""The router's signature assembly: the role (`eldr.roles.signature`) with the signature
service as its fetch and this replica's geometry check, and the metrics of where each
request's counts came from."""

from __future__ import annotations

import logging
import time

from eldr.bus import Bus, BusError, BusTimeoutError, NoRespondersError
from eldr.core.routing.decide import RouterCore
from eldr.roles.signature import Assembled, FetchFailure, assemble
from eldr.wire import AssembleReply, AssembleRequest, PrefillDone, WireError

from .metrics import RouterMetrics
from .settings import RouterSettings

log = logging.getLogger(__name__)


class Signatures:
    """Assembles each PrefillDone's counts for one router replica."""

    def __init__(
        self,
        bus: Bus,
        settings: RouterSettings,
        core: RouterCore,
        metrics: RouterMetrics,
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.core = core
        self.metrics = metrics
        self._geometry_logged_s = -1e9

    async def of(self, msg: PrefillDone) -> Assembled:
        """The request's prefill counts (`assemble`; the service is asked only where the
        settings say so or the policy needs them), counted by where they came from
        (`eldr_router_signature_source_total`) and, where the service was asked, by what it
        gave (`eldr_router_signature_fetches_total`)."""
        assembled = await assemble(
            msg,
            fetch=self._fetch,
            may_fetch=self.settings.fetch_signature or self.core.policy.needs_signature,
            wait_ms=self.settings.assemble_wait_ms,
            refuse_geometry=self._geometry_problem,
        )
        self.metrics.signature_source[assembled.source].inc()
        if assembled.fetched:
            self.metrics.signature_outcomes.labels(assembled.fetch_outcome).inc()
        return assembled

    def _geometry_problem(self, msg: PrefillDone) -> str | None:
        """Why the event's counts are not this router's to use (counted and logged)."""
        problem = self.core.geometry_problem(msg.model, msg.num_moe_layers, msg.num_experts)
        if problem is not None:
            self.metrics.rejected_inputs.labels("prefill_geometry").inc()
            self._log_geometry(msg, problem)
        return problem

    def _log_geometry(self, msg: PrefillDone, problem: str) -> None:
        now = time.monotonic()
        if now - self._geometry_logged_s >= 10.0:
            self._geometry_logged_s = now
            log.warning(
                "request %s from %s: counts refused (%s); routed load-only",
                msg.request_id,
                msg.prefill_worker,
                problem,
            )

    async def _fetch(self, request: AssembleRequest) -> AssembleReply | FetchFailure:
        """The signature service's sum of the request's blocks, or why there is none."""
        started = time.perf_counter()
        try:
            return await self.bus.request(
                self.bus.subjects.sig_assemble,
                request,
                AssembleReply,
                timeout_s=self.settings.signature_timeout_s,
                hedge_after_s=self.settings.signature_hedge_s,
            )
        except BusTimeoutError:
            return "signature_timeout"
        except NoRespondersError:
            return "signature_unavailable"
        except (BusError, WireError) as exc:  # RemoteError included; WireError: a reply
            # this router cannot read (a newer schema mid-upgrade, a broken replica) must
            # cost the request its signature, not its decision.
            log.warning("signature for %s failed: %s", request.request_id, exc)
            return "signature_error"
        finally:
            self.metrics.signature_seconds.observe(time.perf_counter() - started)
