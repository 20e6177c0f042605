"""Every service's Prometheus registry as the shipped code builds it: the runtime's info
gauge, the bus's metrics, the service's own metrics module and its scrape-time
collectors, without a running process (tests/unit/deploy/test_deploy_metrics.py reads the
series they write; the e2e tests scrape the real processes)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry

from eldr.bus.metrics import BusMetrics
from eldr.core.routing.activity import ActivityTable
from eldr.core.routing.loadtable import LoadTable
from eldr.runtime import service_info
from eldr.signature.state import SignatureState
from eldr_services.decodeadapter.metrics import AdapterMetrics
from eldr_services.gateway.metrics import GatewayMetrics
from eldr_services.router.load_metrics import LoadTableCollector
from eldr_services.router.metrics import RouterMetrics
from eldr_services.signature.metrics import SignatureMetrics, StateCollector
from eldr_services.simdecode.metrics import SimDecodeMetrics
from eldr_services.simprefill.metrics import SimPrefillMetrics
from eldr_services.trainer.metrics import TrainerMetrics


def _router(registry: CollectorRegistry) -> None:
    RouterMetrics(registry, "eldr_cost")
    registry.register(LoadTableCollector(LoadTable(), ActivityTable()))


def _signature(registry: CollectorRegistry) -> None:
    SignatureMetrics(registry)
    registry.register(StateCollector(SignatureState(1 << 20), None))


SERVICES: dict[str, Callable[[CollectorRegistry], object]] = {
    "decodeadapter": AdapterMetrics,
    "gateway": GatewayMetrics,
    "router": _router,
    "signature": _signature,
    "simdecode": SimDecodeMetrics,
    "simprefill": SimPrefillMetrics,
    "trainer": TrainerMetrics,
}
"""Each service's own metrics, by `eldr serve` name."""


def service_registries() -> dict[str, CollectorRegistry]:
    """A fresh registry per service, as `eldr.runtime.run_service` fills it."""
    registries = {}
    for name, own_metrics in SERVICES.items():
        registry = CollectorRegistry()
        service_info(registry, name)
        BusMetrics(registry)
        own_metrics(registry)
        registries[name] = registry
    return registries
