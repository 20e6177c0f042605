"""Subjects, stream names and the declared topology (no server needed)."""

from __future__ import annotations

import itertools

import pytest

from eldr.bus import ROUTER_CONSUMER, Subjects, build_topology, rid_token
from eldr.bus.topology import PREFILL
from eldr.settings import RetentionSettings


def test_rid_token_is_a_stable_128_bit_hex_digest() -> None:
    token = rid_token("cmpl-123/../*>")
    assert token == rid_token("cmpl-123/../*>")
    assert len(token) == 32
    assert int(token, 16) >= 0
    assert token != rid_token("cmpl-124/../*>")


def test_subjects_follow_the_architecture_table() -> None:
    s = Subjects("eldr")
    assert s.blocks("p0") == "eldr.blocks.p0"
    assert s.prefill_done("p0") == "eldr.prefill.done.p0"
    assert s.sig_assemble == "eldr.sig.assemble"
    assert s.decision("r") == f"eldr.decisions.{rid_token('r')}"
    assert s.load("d0") == "eldr.load.d0"
    assert s.profiles("d0") == "eldr.profiles.d0"
    assert s.partition_active == "eldr.partition.active"
    assert s.control_router == "eldr.control.router"
    assert s.trainer_refit == "eldr.trainer.refit"
    assert s.dlq("ELDR_PREFILL") == "eldr.dlq.ELDR_PREFILL"


@pytest.mark.parametrize("worker", ["a.b", "a*", ">", "", "a b"])
def test_subjects_refuse_unsafe_worker_ids(worker: str) -> None:
    with pytest.raises(ValueError, match="subject-safe"):
        Subjects("eldr").blocks(worker)


@pytest.mark.parametrize("namespace", ["Eldr", "a.b", "", "x" * 33])
def test_subjects_refuse_a_bad_namespace(namespace: str) -> None:
    with pytest.raises(ValueError, match="namespace"):
        Subjects(namespace)


@pytest.mark.parametrize(
    ("subject", "family"),
    [
        ("eldr.blocks.p0", "blocks"),
        ("eldr.prefill.done.p7", "prefill.done"),
        ("eldr.decisions.0123abcd", "decisions"),
        ("eldr.sig.assemble", "sig.assemble"),
        ("eldr.control.router", "control.router"),
        ("_INBOX.xyz", "other"),
        ("other.blocks.p0", "other"),
    ],
)
def test_subject_family_drops_ids(subject: str, family: str) -> None:
    assert Subjects("eldr").family(subject) == family


def test_stream_subjects_do_not_overlap() -> None:
    topology = build_topology("eldr", RetentionSettings())
    subjects = [s for spec in topology.streams for s in spec.subjects]
    assert len(set(subjects)) == len(subjects)
    for a, b in itertools.combinations(subjects, 2):
        assert not _overlap(a, b), (a, b)


def _overlap(a: str, b: str) -> bool:
    ta, tb = a.split("."), b.split(".")
    return len(ta) == len(tb) and all(x == y or "*" in (x, y) for x, y in zip(ta, tb, strict=True))


def test_topology_names_and_router_consumer() -> None:
    retention = RetentionSettings(router_ack_wait_s=7.0, router_max_deliver=4)
    topology = build_topology("eldr", retention)
    names = {spec.name for spec in topology.streams}
    assert names == {
        "ELDR_BLOCKS",
        "ELDR_PREFILL",
        "ELDR_DECISIONS",
        "ELDR_LOAD",
        "ELDR_PROFILES",
        "ELDR_FINISHED",
        "ELDR_PARTITIONS",
        "ELDR_DLQ",
    }
    (consumer,) = topology.consumers
    assert (consumer.stream, consumer.durable) == (topology.stream_name(PREFILL), ROUTER_CONSUMER)
    assert (consumer.ack_wait_s, consumer.max_deliver) == (7.0, 4)
    assert topology.partitions_bucket == "eldr-partitions"
