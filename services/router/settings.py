"""Settings of the routing service (`ELDR_*` environment variables)."""

from __future__ import annotations

import zlib
from typing import Literal, Self

import numpy as np
from pydantic import Field, model_validator

from eldr.core.limits import DEFAULT_MAX_WORKERS
from eldr.core.routing.activity import DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S
from eldr.core.routing.decide import RouterCore
from eldr.core.routing.loadtable import LoadTable
from eldr.settings import CommonSettings, GeometrySettings, RoutingSettings
from eldr.wire.base import MAX_SCORES, MAX_WORKERS
from eldr.wire.messages import decision_bytes_bound


class RouterSettings(CommonSettings, GeometrySettings, RoutingSettings):
    """The router's own settings; the routing profile (`routing_profile`, or the older
    `policy`, `tau`, `load_measure`) comes from `RoutingSettings`."""

    activity_ttl_s: float = Field(
        default=DEFAULT_TTL_S,
        gt=0,
        description="Cost-aware routing counts a request's experts against its worker until "
        "the gateway's finish event (or its decode summary) arrives, or for at most this "
        "long: the longest a request decodes (default: 4,096 tokens at 30 ms each, ~123 s) "
        "plus the time to be admitted.",
    )
    activity_slack: int = Field(
        default=4,
        ge=0,
        le=4096,
        description="Activity entries a worker may hold beyond the requests its load reports "
        "and pending assignments say are in flight there; beyond, the oldest are evicted "
        "(finishes never seen) and counted.",
    )
    activity_max_entries: int = Field(
        default=DEFAULT_MAX_ENTRIES,
        ge=1,
        description="Activity entries held at most, all workers together (the oldest go).",
    )
    max_workers: int = Field(
        default=DEFAULT_MAX_WORKERS,
        ge=1,
        le=MAX_WORKERS,
        description="Decode workers the load table holds at most; reports from further new "
        "workers are refused and counted (eldr_router_load_reports_total"
        '{outcome="fleet_full"}) until one leaves. Every decision lists the live workers, '
        "so with max_signature_cells this bounds a decision's size: together they must fit "
        "max_payload_bytes (checked at start).",
    )
    stale_after_s: float = Field(
        default=3.0, gt=0, description="A decode worker silent for this long leaves the load table."
    )
    pending_ttl_s: float = Field(
        default=10.0,
        gt=0,
        description="An assignment not confirmed by the worker's load reports within this "
        "stops counting against the worker.",
    )
    signature_timeout_s: float = Field(
        default=0.05,
        gt=0,
        description="How long to wait for the signature service; on timeout route load-only.",
    )
    signature_hedge_s: float = Field(
        default=0.025,
        gt=0,
        description="Ask the signature service again (another replica, as the queue group "
        "picks) when no answer came within this, within signature_timeout_s overall: a "
        "replica that does not answer (its NATS server hangs) costs the request this delay, "
        "not its signature. Above assemble_wait_ms, so a replica waiting for blocks in "
        "flight is not asked twice.",
    )
    assemble_wait_ms: int = Field(
        default=20,
        ge=0,
        le=60_000,
        description="How long the signature service may wait for block summaries in flight.",
    )
    fetch_signature: bool = Field(
        default=True,
        description="Fetch signatures even for load-only policies (the trainer learns from "
        "them; the decision record carries them for replay).",
    )
    max_scores: int = Field(
        default=8, ge=1, le=64, description="Top candidate scores recorded per decision."
    )
    consumer_batch: int = Field(default=64, ge=1, description="PrefillDone events per fetch.")
    max_concurrency: int = Field(
        default=64, ge=1, description="PrefillDone events handled concurrently per replica."
    )
    no_worker_wait_s: float = Field(
        default=300.0,
        ge=0,
        description="How long a request waits in the router for a live decode worker before "
        "it goes back to JetStream (meanwhile JetStream is told every third of the ack wait "
        "that it is in progress, so it is not redelivered). Each hand-back spends one of "
        "router_max_deliver deliveries: keep max_deliver x this above prefill_max_age_s, so "
        "a decode fleet outage never dead-letters a waiting request.",
    )
    no_worker_retry_s: float = Field(
        default=1.0, gt=0, description="Redelivery delay after that wait."
    )
    commit_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description="Deadline of one try to commit a decision (or read a committed one): "
        "a try that gets no answer in time (the stream's leader is dead or hangs) is "
        "retried, see commit_retry_s.",
    )
    commit_retry_s: float = Field(
        default=60.0,
        ge=0,
        description="How long a router keeps retrying a commit (or a read of one) that "
        "fails for an expected reason of a NATS cluster (a leader election, a node restart "
        "or hang, no quorum: a timeout, no responders, 503), with a jittered backoff (50 ms "
        "doubling to 0.5 s), holding the event and telling JetStream it is in progress, so "
        "the fault spends none of its router_max_deliver deliveries. After that the event "
        "goes back to JetStream (one delivery spent).",
    )
    rebuild_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="At start, before taking events, a replica rebuilds what is in flight "
        "(its activity table, the finished requests) by replaying DECISIONS and FINISHED "
        "over activity_ttl_s (eldr_router_rebuild_seconds); it gives up after this long "
        "and starts with what it read (eldr_router_rebuild_complete 0). 0: no rebuild.",
    )
    index_method: Literal["auto", "exact", "hnsw"] = Field(
        default="auto", description="Centroid search: hnswlib, exact, or auto by centroid count."
    )
    router_seed: int = Field(
        default=0,
        description="Seed of the policy's tie-break randomness (with the instance id; each "
        "decision records its own seed). Not the trainer's fit seed (trainer_seed).",
    )

    @model_validator(mode="after")
    def _decisions_fit(self) -> Self:
        # Impossible by construction: no decision this router can make is too large for
        # the readers (routers, trainer, requesters) to decode.
        bound = decision_bytes_bound(self.max_workers, self.max_signature_cells, MAX_SCORES)
        if bound > self.max_payload_bytes:
            raise ValueError(
                f"a decision for max_workers={self.max_workers} and max_signature_cells="
                f"{self.max_signature_cells} can take {bound} bytes, more than "
                f"max_payload_bytes={self.max_payload_bytes}: lower one of them (or raise "
                "max_payload_bytes, and NATS' max_payload, everywhere)"
            )
        return self

    def router_core(self) -> RouterCore:
        """A replica's routing state as these settings configure it; its tie-break seed is
        `router_seed` with the instance id (each replica draws its own)."""
        table = LoadTable(
            stale_after_s=self.stale_after_s,
            pending_ttl_s=self.pending_ttl_s,
            max_workers=self.max_workers,
        )
        return RouterCore(
            self.routing_profile,
            table,
            np.random.default_rng([self.router_seed, zlib.crc32(self.instance_id.encode())]),
            max_scores=self.max_scores,
            activity_ttl_s=self.activity_ttl_s,
            activity_slack=self.activity_slack,
            activity_max_entries=self.activity_max_entries,
            limits=self.geometry_limits(),
        )
