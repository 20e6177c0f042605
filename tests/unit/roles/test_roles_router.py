"""The router's roles: where a request's counts come from (`eldr.roles.signature`) and what
each input does to a replica's tables (`eldr.roles.router`)."""

from __future__ import annotations

import asyncio

import numpy as np

from eldr.core.routing.decide import RouterCore
from eldr.core.routing.loadtable import LoadTable, Report
from eldr.core.routing.profile import RoundRobinProfile
from eldr.roles.router import RouterEvents, decision_of
from eldr.roles.signature import Assembled, FetchFailure, assemble
from eldr.wire import AssembleReply, AssembleRequest, PrefillDone, SparseCounts
from eldr.wire.arrays import NdArray
from eldr.wire.messages import NO_WORKER
from eldr.wire.records import expired_outcome
from support.messages import prefill_done

L, E = 2, 4


event = prefill_done
"""A PrefillDone of L x E counts (`support.messages.prefill_done`)."""


def ones(n: int = 1) -> np.ndarray:
    return np.full((L, E), n, dtype=np.uint32)


class Service:
    """A signature service stand-in: answers every request with `counts`, or fails."""

    def __init__(self, counts: np.ndarray | None = None, fail: FetchFailure | None = None):
        self.counts, self.fail = counts, fail
        self.asked: list[AssembleRequest] = []

    async def __call__(self, request: AssembleRequest) -> AssembleReply | FetchFailure:
        self.asked.append(request)
        if self.fail is not None:
            return self.fail
        n = len(request.block_hashes)
        counts = None if self.counts is None else NdArray.from_numpy(self.counts)
        return AssembleReply(request.request_id, counts, n, n, [])


def run(msg: PrefillDone, service: Service, *, may_fetch: bool = True) -> Assembled:
    return asyncio.run(
        assemble(msg, fetch=service, may_fetch=may_fetch, wait_ms=5, refuse_geometry=lambda _: None)
    )


def test_the_events_own_signature_needs_no_service() -> None:
    service = Service(ones())
    got = run(event(signature=SparseCounts.from_dense(ones(2))), service)
    assert (got.source, got.error, service.asked) == ("event", None, [])
    assert (got.counts == 2).all()


def test_the_prefix_hits_come_from_the_service_and_add_to_what_the_prefill_computed() -> None:
    service = Service(ones(3))
    msg = event(computed=SparseCounts.from_dense(ones(1)), cached_prefix_blocks=1)
    got = run(msg, service)
    assert [r.block_hashes for r in service.asked] == [[11]]
    assert (got.source, got.fetched, got.fetch_outcome) == ("service", True, "complete")
    assert got.counts is not None
    assert (got.counts == 4).all()


def test_an_event_with_neither_asks_for_every_block_and_its_partial_one() -> None:
    service = Service(ones())
    partial = SparseCounts.from_dense(ones())
    run(event(partial=partial), service)
    assert [(r.block_hashes, r.partial) for r in service.asked] == [([11, 12], partial)]


def test_a_prompt_shorter_than_a_block_is_its_partial_block() -> None:
    got = run(
        event(block_hashes=[], n_prompt_tokens=1, partial=SparseCounts.from_dense(ones())),
        Service(),
    )
    assert (got.source, got.error) == ("partial_only", None)
    assert run(event(block_hashes=[], n_prompt_tokens=1), Service()).error == "empty_signature"


def test_a_failed_fetch_routes_load_only_and_says_why() -> None:
    got = run(event(), Service(fail="signature_timeout"))
    assert (got.counts, got.missing_blocks, got.error) == (None, 2, "signature_timeout")
    assert (got.source, got.fetch_outcome) == ("service", "timeout")


def test_without_leave_to_fetch_the_blocks_count_as_missing() -> None:
    service = Service(ones())
    got = run(event(), service, may_fetch=False)
    assert (got.source, got.error, got.missing_blocks, service.asked) == (
        "none",
        "no_signature",
        2,
        [],
    )


def test_a_refused_geometry_is_decided_load_only_before_anything_is_read() -> None:
    service = Service(ones())
    got = asyncio.run(
        assemble(
            event(signature=SparseCounts.from_dense(ones())),
            fetch=service,
            may_fetch=True,
            wait_ms=5,
            refuse_geometry=lambda _: "not ours",
        )
    )
    assert (got.counts, got.error, got.source) == (None, "geometry_mismatch", "none")


def test_an_expired_record_names_no_worker_and_records_no_counts() -> None:
    signature = Assembled(ones(), 0, None, "event")
    record = decision_of(
        event(),
        expired_outcome(RoundRobinProfile()),
        signature,
        router_id="a",
        ts_s=1.0,
        decide_s=0,
    )
    assert (record.outcome, record.worker_id, record.signature) == ("expired", NO_WORKER, None)
    assert not record.assigned


def core(max_workers: int = 8) -> RouterCore:
    table = LoadTable(stale_after_s=1.0, pending_ttl_s=10.0, max_workers=max_workers)
    return RouterCore(RoundRobinProfile(), table, np.random.default_rng(0))


def report(worker: str, seq: int = 1) -> Report:
    return Report(worker, "i0", seq, running=0, waiting=0, kv_tokens=0)


def test_a_report_of_a_worker_beyond_the_table_is_refused_and_counted() -> None:
    events = RouterEvents(core(max_workers=1))
    assert events.on_report(report("a"), 0.0) == ("ok", 0)
    assert events.on_report(report("a"), 0.1) == ("stale", 0)
    assert events.on_report(report("b"), 0.1) == ("fleet_full", 0)
    assert events.core.table.refused_workers == 1


def test_expiry_names_the_workers_that_went_stale() -> None:
    events = RouterEvents(core())
    events.on_report(report("a"), 0.0)
    events.on_report(report("b"), 0.9)
    gone = events.expire(1.5)
    assert gone.stale_workers == ["a"]
    assert gone.evictions() == {}
