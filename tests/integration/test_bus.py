"""The bus library against a real nats-server: topology, conditional publish, pull
consumers (ack, retry, dead letters, drain), request/reply, read-back, object store."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER
from prometheus_client import CollectorRegistry

from eldr.bus import (
    ROUTER_CONSUMER,
    AlreadyExists,
    Bus,
    Delivery,
    NotFoundError,
    Reject,
    RemoteError,
    Retry,
    Topology,
    apply_topology,
    build_topology,
)
from eldr.bus.topology import BLOCKS, DECISIONS, DLQ, PREFILL
from eldr.dev.natsserver import EmbeddedNats
from eldr.settings import BusSettings, RetentionSettings
from eldr.wire import (
    AssembleReply,
    AssembleRequest,
    BlockSummaryBatch,
    DeadLetter,
    Decision,
    NdArray,
    PartitionBlob,
    PrefillDone,
    RefitRequest,
    SparseCounts,
    WireError,
    encode,
)
from support import messages

pytestmark = pytest.mark.integration

WAIT_S = 10.0
"""Generous bound on awaiting an event (the machine is shared)."""


def prefill_done(request_id: str) -> PrefillDone:
    return PrefillDone(
        request_id=request_id,
        model="m",
        prefill_worker="p0",
        ts_s=1.0,
        block_size=4,
        block_hashes=[11, 22],
        n_prompt_tokens=9,
        partial=SparseCounts.from_dense(np.array([[1, 0], [0, 1]], dtype=np.uint32)),
        num_moe_layers=2,
        num_experts=2,
    )


def decision(request_id: str, worker_id: str) -> Decision:
    return messages.decision(request_id, worker_id, ts_s=2.0, policy="rr")


def block_batch(seq: int) -> BlockSummaryBatch:
    return BlockSummaryBatch(
        worker_id="p0",
        seq=seq,
        ts_s=1.0,
        model="m",
        num_moe_layers=2,
        num_experts=2,
        block_size=4,
        blocks=[],
    )


async def applied(bus: Bus, topology: Topology) -> Topology:
    await apply_topology(bus, topology)
    return topology


async def test_apply_topology_twice_is_a_no_op(bus: Bus, topology: Topology) -> None:
    first = await apply_topology(bus, topology)
    second = await apply_topology(bus, topology)
    assert {c.action for c in first} == {"created"}
    assert len(first) == len(topology.streams) + len(topology.consumers) + 1
    assert {c.action for c in second} == {"unchanged"}


async def test_apply_topology_updates_changed_limits(
    bus: Bus, topology: Topology, retention: RetentionSettings
) -> None:
    await apply_topology(bus, topology)
    longer = retention.model_copy(update={"blocks_max_age_s": 7200.0, "router_max_deliver": 9})
    changes = await apply_topology(bus, build_topology(topology.namespace, longer))
    updated = {c.name: c.detail for c in changes if c.action == "updated"}
    blocks = topology.stream_name(BLOCKS)
    router = f"{topology.stream_name(PREFILL)}/{ROUTER_CONSUMER}"
    assert updated == {blocks: "max_age", router: "max_deliver"}


async def test_a_service_changes_only_what_its_role_owns(
    bus: Bus, topology: Topology, retention: RetentionSettings
) -> None:
    """`apply_topology(role=...)`: another role's missing streams and bucket are created
    (services start in any order), its consumer is left alone, and a stream that differs
    is reported, not updated; the owner updates it."""
    first = {c.name: c.action for c in await apply_topology(bus, topology, role="signature")}
    router = f"{topology.stream_name(PREFILL)}/{ROUTER_CONSUMER}"
    assert set(first.values()) == {"created"}
    assert router not in first  # the router's own consumer: the router makes it
    longer = build_topology(
        topology.namespace, retention.model_copy(update={"blocks_max_age_s": 7200.0})
    )
    as_router = await apply_topology(bus, longer, role="router")
    blocks = topology.stream_name(BLOCKS)
    assert {(c.name, c.action, c.detail) for c in as_router if c.action != "unchanged"} == {
        (blocks, "differs", "max_age"),
        (router, "created", ""),
    }
    info = await bus._js.stream_info(blocks)
    assert info.config.max_age == retention.blocks_max_age_s
    as_owner = await apply_topology(bus, longer, role="signature")
    assert [(c.name, c.action) for c in as_owner if c.action != "unchanged"] == [
        (blocks, "updated")
    ]


async def test_conditional_publish_first_write_wins(bus: Bus, topology: Topology) -> None:
    await applied(bus, topology)
    subject = bus.subjects.decision("req-1")
    first = await bus.js_publish(subject, decision("req-1", "d0"), expected_last_subject_seq=0)
    with pytest.raises(AlreadyExists):
        await bus.js_publish(subject, decision("req-1", "d1"), expected_last_subject_seq=0)
    stored = await bus.get_last(topology.stream_name(DECISIONS), subject, Decision)
    assert first.seq == 1
    assert stored is not None
    assert stored.worker_id == "d0"


async def test_commit_once_keeps_the_first_record(bus: Bus, topology: Topology) -> None:
    await applied(bus, topology)
    stream, subject = topology.stream_name(DECISIONS), bus.subjects.decision("req-once")
    first = await bus.commit_once(stream, subject, decision("req-once", "d0"))
    second = await bus.commit_once(stream, subject, decision("req-once", "d1"))
    assert first.first
    assert first.record.worker_id == "d0"
    assert not second.first
    assert second.record.worker_id == "d0"
    assert (await bus.stream_state(stream)).messages == 1


async def test_a_retried_commit_whose_first_try_was_stored_is_its_own(
    bus: Bus, topology: Topology
) -> None:
    # A commit whose answer was lost (a leader election) was stored after all: the retry
    # finds the same bytes and knows the record as its own, not as another writer's.
    await applied(bus, topology)
    stream, subject = topology.stream_name(DECISIONS), bus.subjects.decision("req-lost-ack")
    record = decision("req-lost-ack", "d0")
    await bus.js_publish(subject, record, expected_last_subject_seq=0)  # the lost try
    again = await bus.commit_once(stream, subject, record)
    other = await bus.commit_once(stream, subject, decision("req-lost-ack", "d1"))
    assert again.first
    assert again.record == record
    assert not other.first  # another writer's record: the stored one stands
    assert other.record == record
    assert (await bus.stream_state(stream)).messages == 1


async def test_get_last_of_an_empty_subject_is_none(bus: Bus, topology: Topology) -> None:
    await applied(bus, topology)
    subject = bus.subjects.decision("nobody")
    assert await bus.get_last(topology.stream_name(DECISIONS), subject, Decision) is None


async def test_consume_acks_on_success(bus: Bus, bus_factory, topology: Topology) -> None:
    await applied(bus, topology)
    stream = topology.stream_name(PREFILL)
    seen: list[str] = []
    done = asyncio.Event()

    async def handle(message: PrefillDone, delivery: Delivery) -> None:
        seen.append(message.request_id)
        done.set()

    await bus.consume(stream, ROUTER_CONSUMER, PrefillDone, handle)
    await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("a"))
    await asyncio.wait_for(done.wait(), WAIT_S)
    await bus.drain()

    state = await (await bus_factory("check")).consumer_state(stream, ROUTER_CONSUMER)
    assert seen == ["a"]
    assert (state.ack_floor_stream_seq, state.num_ack_pending, state.num_pending) == (1, 0, 0)


async def test_consume_redelivers_on_retry(bus: Bus, topology: Topology) -> None:
    await applied(bus, topology)
    deliveries: list[int] = []
    done = asyncio.Event()

    async def handle(message: PrefillDone, delivery: Delivery) -> None:
        deliveries.append(delivery.num_delivered)
        if delivery.num_delivered == 1:
            raise Retry("signature not ready", delay_s=0.05)
        done.set()

    await bus.consume(topology.stream_name(PREFILL), ROUTER_CONSUMER, PrefillDone, handle)
    await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("a"))
    await asyncio.wait_for(done.wait(), WAIT_S)
    assert deliveries == [1, 2]


async def test_consume_dead_letters_failures_after_max_deliver(
    bus: Bus, topology: Topology
) -> None:
    await applied(bus, topology)
    stream = topology.stream_name(PREFILL)
    letters: list[DeadLetter] = []
    dead = asyncio.Event()

    async def failing(message: PrefillDone, delivery: Delivery) -> None:
        raise RuntimeError(f"boom {delivery.num_delivered}")

    async def on_letter(letter: DeadLetter, delivery: Delivery) -> None:
        letters.append(letter)
        dead.set()

    await bus.read_back(topology.stream_name(DLQ), bus.subjects.dlq(stream), DeadLetter, on_letter)
    await bus.consume(stream, ROUTER_CONSUMER, PrefillDone, failing, error_backoff_s=0.01)
    await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("a"))
    await asyncio.wait_for(dead.wait(), WAIT_S)
    assert letters[0].num_delivered == 3  # the retention fixture's router_max_deliver
    assert "boom 3" in letters[0].error


async def test_consume_dead_letters_undecodable_and_continues(bus: Bus, topology: Topology) -> None:
    await applied(bus, topology)
    stream = topology.stream_name(PREFILL)
    good = asyncio.Event()
    dead = asyncio.Event()
    letters: list[DeadLetter] = []

    async def handle(message: PrefillDone, delivery: Delivery) -> None:
        good.set()

    async def on_letter(letter: DeadLetter, delivery: Delivery) -> None:
        letters.append(letter)
        dead.set()

    await bus.read_back(topology.stream_name(DLQ), bus.subjects.dlq(stream), DeadLetter, on_letter)
    await bus.consume(stream, ROUTER_CONSUMER, PrefillDone, handle)
    await bus.publish_raw(bus.subjects.prefill_done("p0"), b"\x93not a message")
    await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("b"))
    await asyncio.wait_for(asyncio.gather(good.wait(), dead.wait()), WAIT_S)

    (letter,) = letters
    assert (letter.stream, letter.stream_seq, letter.payload) == (stream, 1, b"\x93not a message")
    assert "PrefillDone" in letter.error


async def test_consume_refusals_are_dead_lettered_and_never_redelivered(
    bus: Bus, topology: Topology
) -> None:
    # One refused by the handler (Reject), one by the identity check (prefill_worker p0
    # published on prefill.done.p1), one taken: the two refused ones reach the DLQ once
    # each and are terminated (the consumer has nothing pending or unacked).
    await applied(bus, topology)
    stream = topology.stream_name(PREFILL)
    letters: list[DeadLetter] = []
    taken: list[str] = []
    deliveries: list[str] = []

    async def handle(message: PrefillDone, delivery: Delivery) -> None:
        deliveries.append(message.request_id)
        if message.request_id == "refused":
            raise Reject("over_limit", "too big for this test")
        taken.append(message.request_id)

    async def on_letter(letter: DeadLetter, delivery: Delivery) -> None:
        letters.append(letter)

    await bus.read_back(topology.stream_name(DLQ), bus.subjects.dlq(stream), DeadLetter, on_letter)
    await bus.consume(
        stream, ROUTER_CONSUMER, PrefillDone, handle, identity="prefill_worker", batch=1
    )
    await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("refused"))
    await bus.js_publish(bus.subjects.prefill_done("p1"), prefill_done("forged"))
    await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("fine"))

    async def settled() -> bool:
        state = await bus.consumer_state(stream, ROUTER_CONSUMER)
        return len(letters) == 2 and bool(taken) and state.num_ack_pending == 0

    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not await settled():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.3)  # a redelivery, if any, would come now
    state = await bus.consumer_state(stream, ROUTER_CONSUMER)
    assert (state.num_pending, state.num_ack_pending, state.num_redelivered) == (0, 0, 0)
    assert taken == ["fine"]
    assert deliveries == ["refused", "fine"]  # the forged one never reached the handler
    by_error = sorted(letter.error for letter in letters)
    assert len(by_error) == 2
    assert "over_limit: too big" in by_error[1]
    assert "identity_mismatch" in by_error[0]
    assert "prefill_worker is 'p0' but it came on" in by_error[0]
    rejected = bus.metrics.rejected
    assert rejected.labels("prefill.done", "over_limit")._value.get() == 1
    assert rejected.labels("prefill.done", "identity_mismatch")._value.get() == 1


async def test_a_refused_request_gets_error_code_403(bus: Bus) -> None:
    async def refuse(request: RefitRequest) -> RefitRequest:
        raise Reject("inconsistent", "no")

    await bus.serve(bus.subjects.trainer_refit, None, RefitRequest, refuse)
    with pytest.raises(RemoteError) as err:
        await bus.request(bus.subjects.trainer_refit, RefitRequest(reason="x"), RefitRequest)
    assert err.value.code == 403
    assert "inconsistent: no" in err.value.message


async def test_an_error_answer_uses_the_nats_service_protocols_headers(bus: Bus) -> None:
    """Any NATS service client (`nats.micro`, the `nats` CLI) reads the bus's error answers."""

    async def refuse(request: RefitRequest) -> RefitRequest:
        raise Reject("inconsistent", "no")

    await bus.serve(bus.subjects.trainer_refit, None, RefitRequest, refuse)
    answer = await bus._nc.request(bus.subjects.trainer_refit, encode(RefitRequest(reason="x")))
    assert answer.data == b""
    assert answer.headers is not None
    assert answer.headers[ERROR_CODE_HEADER] == "403"
    assert "inconsistent: no" in answer.headers[ERROR_HEADER]


async def test_request_reply_round_trip(bus: Bus) -> None:
    async def assemble(request: AssembleRequest) -> AssembleReply:
        return AssembleReply(
            request_id=request.request_id,
            counts=None,
            blocks_total=len(request.block_hashes),
            blocks_found=0,
            missing=request.block_hashes,
        )

    await bus.serve(bus.subjects.sig_assemble, "signature", AssembleRequest, assemble)
    reply = await bus.request(
        bus.subjects.sig_assemble,
        AssembleRequest(request_id="r", model="m", block_hashes=[5, 6], partial=None, wait_ms=0),
        AssembleReply,
    )
    assert (reply.request_id, reply.blocks_total, reply.missing) == ("r", 2, [5, 6])


async def test_a_hedged_request_is_answered_when_a_queue_member_never_answers(
    bus_factory,
) -> None:
    """One member of the queue group hangs (as one on a frozen NATS node): a hedged request
    sends its copies on, and another member answers each one within the timeout."""
    registry = CollectorRegistry()
    client = await bus_factory("client", registry=registry)
    silent = await bus_factory("silent")
    hung = asyncio.Event()

    async def never(request: AssembleRequest) -> AssembleReply:
        await hung.wait()  # answers only after the test (too late for any request)
        return await assemble(request)

    async def assemble(request: AssembleRequest) -> AssembleReply:
        return AssembleReply(
            request_id=request.request_id,
            counts=None,
            blocks_total=0,
            blocks_found=0,
            missing=[],
        )

    await silent.serve(client.subjects.sig_assemble, "signature", AssembleRequest, never)
    for i in range(3):
        member = await bus_factory(f"member{i}")
        await member.serve(client.subjects.sig_assemble, "signature", AssembleRequest, assemble)
    answered = []
    for n in range(20):
        reply = await client.request(
            client.subjects.sig_assemble,
            AssembleRequest(
                request_id=f"r{n}", model="m", block_hashes=[], partial=None, wait_ms=0
            ),
            AssembleReply,
            timeout_s=1.0,
            hedge_after_s=0.05,
        )
        answered.append(reply.request_id)
    hung.set()
    assert answered == [f"r{n}" for n in range(20)]
    hedged = registry.get_sample_value("eldr_bus_requests_hedged_total", {"family": "sig.assemble"})
    assert (hedged or 0) >= 1  # some first copies went to the silent member


async def test_bad_request_gets_error_reply_and_is_counted(bus_factory, topology: Topology) -> None:
    registry = CollectorRegistry()
    server = await bus_factory("server", registry=registry)
    client = await bus_factory("client")
    await applied(server, topology)

    async def assemble(request: AssembleRequest) -> AssembleReply:  # pragma: no cover
        raise AssertionError("must not be called with an invalid request")

    await server.serve(server.subjects.sig_assemble, "signature", AssembleRequest, assemble)
    with pytest.raises(RemoteError) as info:
        await client.request(
            client.subjects.sig_assemble, RefitRequest(reason="wrong type"), AssembleReply
        )
    assert info.value.code == 400
    assert "expected AssembleRequest" in info.value.message
    rejected = registry.get_sample_value(
        "eldr_bus_messages_rejected_total", {"family": "sig.assemble", "reason": "invalid"}
    )
    assert rejected == 1.0


async def test_failing_request_handler_gets_error_reply(bus: Bus) -> None:
    async def refit(request: RefitRequest) -> AssembleReply:
        raise ValueError("no calibration data")

    await bus.serve(bus.subjects.trainer_refit, None, RefitRequest, refit)
    with pytest.raises(RemoteError, match="no calibration data") as info:
        await bus.request(bus.subjects.trainer_refit, RefitRequest(reason="x"), AssembleReply)
    assert info.value.code == 500


async def test_drain_finishes_in_flight_handler_and_acks(
    bus: Bus, bus_factory, topology: Topology
) -> None:
    await applied(bus, topology)
    stream = topology.stream_name(PREFILL)
    started = asyncio.Event()
    release = asyncio.Event()
    finished: list[str] = []

    async def slow(message: PrefillDone, delivery: Delivery) -> None:
        started.set()
        await release.wait()
        finished.append(message.request_id)

    await bus.consume(stream, ROUTER_CONSUMER, PrefillDone, slow)
    await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("slow"))
    await asyncio.wait_for(started.wait(), WAIT_S)
    drain = asyncio.create_task(bus.drain())
    for _ in range(10):  # let the drain reach its wait on the handler
        await asyncio.sleep(0)
    assert not drain.done()
    release.set()
    await asyncio.wait_for(drain, WAIT_S)

    state = await (await bus_factory("after")).consumer_state(stream, ROUTER_CONSUMER)
    assert finished == ["slow"]
    assert (state.ack_floor_stream_seq, state.num_ack_pending, state.num_redelivered) == (1, 0, 0)


async def test_replay_from_sequence(bus: Bus, topology: Topology) -> None:
    await applied(bus, topology)
    for seq in range(5):
        await bus.js_publish(bus.subjects.blocks("p0"), block_batch(seq))
    seen: list[tuple[int, int | None]] = []

    async def handle(batch: BlockSummaryBatch, delivery: Delivery) -> None:
        seen.append((batch.seq, delivery.stream_seq))

    reader = await bus.read_back(
        topology.stream_name(BLOCKS),
        bus.subjects.blocks_all,
        BlockSummaryBatch,
        handle,
        start_seq=3,
        stop_at_end=True,
    )
    await asyncio.wait_for(reader.finished.wait(), WAIT_S)
    assert seen == [(2, 3), (3, 4), (4, 5)]


async def test_replay_of_an_empty_stream_is_caught_up_at_once(bus: Bus, topology: Topology) -> None:
    await applied(bus, topology)

    async def handle(batch: BlockSummaryBatch, delivery: Delivery) -> None:  # pragma: no cover
        raise AssertionError("nothing to replay")

    reader = await bus.read_back(
        topology.stream_name(BLOCKS), bus.subjects.blocks_all, BlockSummaryBatch, handle
    )
    assert reader.caught_up.is_set()


async def test_core_subscribe_delivers_typed_messages(bus: Bus) -> None:
    got: list[tuple[str, str]] = []
    done = asyncio.Event()

    async def handle(message: Decision, delivery: Delivery) -> None:
        got.append((message.request_id, delivery.subject))
        done.set()

    inbox = f"{bus.subjects.namespace}.inbox.x"
    await bus.subscribe(inbox, Decision, handle)
    await bus.publish(inbox, decision("q", "d0"))
    await asyncio.wait_for(done.wait(), WAIT_S)
    assert got == [("q", inbox)]


async def test_request_many_collects_every_replica(bus_factory) -> None:
    replicas = [await bus_factory(f"router{i}") for i in range(2)]
    client = await bus_factory("cli")
    for i, replica in enumerate(replicas):

        async def answer(request: RefitRequest, i: int = i) -> AssembleReply:
            return AssembleReply(
                request_id=f"r{i}", counts=None, blocks_total=0, blocks_found=0, missing=[]
            )

        await replica.serve(replica.subjects.control_router, None, RefitRequest, answer)
    replies = await client.request_many(
        client.subjects.control_router,
        RefitRequest(reason="status"),
        AssembleReply,
        timeout_s=WAIT_S,
        max_replies=2,
    )
    assert sorted(r.request_id for r in replies if isinstance(r, AssembleReply)) == ["r0", "r1"]


def partition_blob() -> PartitionBlob:
    centroids = np.eye(2, 4, dtype=np.float32)
    return PartitionBlob(
        version=3,
        model="m",
        transform="raw",
        num_moe_layers=2,
        num_experts=2,
        idf=None,
        layer_mask=NdArray.from_numpy(np.ones(2, dtype=np.uint8)),
        centroids=NdArray.from_numpy(centroids),
        owners=[0, 1],
        workers=["d0", "d1"],
        metrics={"inertia": 1.5},
    )


async def test_object_store_round_trip(bus: Bus, topology: Topology) -> None:
    await applied(bus, topology)
    blob = partition_blob()
    ref = await bus.object_put(topology.partitions_bucket, "v3", blob)
    got = await bus.object_get(
        topology.partitions_bucket, "v3", PartitionBlob, expected_sha256=ref.sha256
    )
    assert got == blob


async def test_object_store_rejects_a_wrong_digest(bus: Bus, topology: Topology) -> None:
    await applied(bus, topology)
    await bus.object_put(topology.partitions_bucket, "v3", partition_blob())
    with pytest.raises(WireError, match="sha256"):
        await bus.object_get(
            topology.partitions_bucket, "v3", PartitionBlob, expected_sha256="0" * 64
        )


async def test_object_store_keeps_bytes_put_as_they_are(
    bus: Bus, bus_factory, bus_settings: BusSettings, topology: Topology
) -> None:
    """Bytes put raw (a recorded blob) come back as they are, checked against their
    digest; a reader's size limit still refuses them before the download."""
    await applied(bus, topology)
    data = encode(partition_blob())
    ref = await bus.object_put_bytes(topology.partitions_bucket, "v3", data)
    assert (ref.size_bytes, ref.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    got = await bus.object_get_bytes(topology.partitions_bucket, "v3", expected_sha256=ref.sha256)
    assert got == data
    small = bus_settings.model_copy(update={"max_object_bytes": len(data) - 1})
    reader = await bus_factory("small", settings=small)
    with pytest.raises(WireError, match="limit"):
        await reader.object_get_bytes(topology.partitions_bucket, "v3")


async def test_object_store_missing_object(bus: Bus, topology: Topology) -> None:
    await applied(bus, topology)
    with pytest.raises(NotFoundError):
        await bus.object_get(topology.partitions_bucket, "nope", PartitionBlob)


@pytest.mark.slow
async def test_consumer_resumes_after_server_restart(
    namespace: str, retention: RetentionSettings
) -> None:
    """A server restart (same port and store) loses neither the stream nor the consumer's
    position; the consume loop picks up new messages after reconnecting."""
    with EmbeddedNats() as server:
        settings = BusSettings(
            nats_url=server.url, namespace=namespace, fetch_timeout_s=0.2, reconnect_wait_s=0.1
        )
        topology = build_topology(namespace, retention)
        bus = await Bus.connect(settings, "restart")
        try:
            await apply_topology(bus, topology)
            seen: list[str] = []
            arrived = asyncio.Event()

            async def handle(message: PrefillDone, delivery: Delivery) -> None:
                seen.append(message.request_id)
                arrived.set()

            await bus.consume(topology.stream_name(PREFILL), ROUTER_CONSUMER, PrefillDone, handle)
            await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("before"))
            await asyncio.wait_for(arrived.wait(), WAIT_S)
            arrived.clear()
            await asyncio.to_thread(server.restart)
            for _ in range(200):  # reconnect is asynchronous; publish when it is back
                if bus.is_connected:
                    break
                await asyncio.sleep(0.05)
            await bus.js_publish(bus.subjects.prefill_done("p0"), prefill_done("after"))
            await asyncio.wait_for(arrived.wait(), WAIT_S)
            assert seen == ["before", "after"]
        finally:
            await bus.drain()
