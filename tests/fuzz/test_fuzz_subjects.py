"""Fuzzing every inbound subject's decoder and handler with hostile MessagePack.

Each case goes through the real bus path of its subject (size check, validated decode,
metrics, dead-lettering, ack/nak/term) into the service's real handler, over an in-memory
NATS stand-in (`fakebus.py`). Properties: nothing escapes the bus path; a payload the codec
refuses is counted (`eldr_bus_messages_rejected_total{reason=invalid|too_large}`) and
dead-lettered; a payload that decodes is handled without a handler error, or refused for
what it claims (`eldr.bus.Reject`: a sender id other than the subject's, a geometry or
counts no real model has) and then counted and dead-lettered too; afterwards the service
still handles valid messages. Oversized payloads are refused by size before any
decoding.

Two drivers share the mutations (`mutations.py`):

- seeded (`random.Random`): `ELDR_FUZZ_CASES` cases per subject, default 10,000 (CI);
- hypothesis (shrinks failures): `ELDR_FUZZ_EXAMPLES` per subject, default 100 in CI; the
  long campaign is `ELDR_FUZZ_EXAMPLES=10000 pytest tests/fuzz -k hypothesis` (see
  docs/RELIABILITY.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import zlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eldr.bus import REFUSAL_REASONS
from eldr.wire import KIND_OF, WireError, codec, decode, encode

from .mutations import RandomChooser, payload, payloads, plain
from .targets import Target, build_targets

CASES = int(os.environ.get("ELDR_FUZZ_CASES", "10000"))
EXAMPLES = int(os.environ.get("ELDR_FUZZ_EXAMPLES", "100"))
SEED = int(os.environ.get("ELDR_FUZZ_SEED", "0"))
TARGET_NAMES = [t.name for t in build_targets()]

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    """Every rejection logs a warning: at 10,000 cases that is most of the run time."""
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def _target(name: str) -> Target:
    return next(t for t in build_targets() if t.name == name)


def check_case(
    target: Target, data: bytes, loop: asyncio.AbstractEventLoop, outcomes: Counter[str]
) -> None:
    """Feed one payload and check the properties of the module docstring."""
    try:
        decode(data, target.message_type, target.bus.settings.max_payload_bytes)
        valid = True
    except WireError:
        valid = False
    letters = target.dead_letters()
    outcome = loop.run_until_complete(target.feed(data))
    outcomes[outcome] += 1
    if valid and target.refusals_ok and outcome == "handler_error":
        reply_to, answer = target.nc.published[-1]
        assert reply_to == "_INBOX.fuzz.reply", "refused without an answer"
        assert answer == b""  # the reason travels in the error header
    elif valid and outcome in REFUSAL_REASONS:
        # Well-formed but refused for what it claims (a worker id that is not the
        # subject's, a geometry or counts no real model has): dead-lettered, never lost.
        assert not target.reply_path
        assert target.dead_letters() == letters + 1, f"{target.name}: refused silently"
    elif valid or target.reply_path:
        assert outcome == "handled", f"{target.name}: the handler failed"
    else:
        assert outcome in ("invalid", "too_large"), f"{target.name}: {outcome} for bad bytes"
        assert target.dead_letters() == letters + 1, f"{target.name}: not dead-lettered"


def still_serving(target: Target, loop: asyncio.AbstractEventLoop) -> None:
    for seed in target.seeds:
        assert loop.run_until_complete(target.feed(encode(seed))) == "handled"


def reached_both_sides(target: Target, outcomes: Counter[str]) -> None:
    if not target.reply_path:
        assert outcomes["invalid"] > 0
    assert outcomes["handled"] > 0


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_seeded_hostile_payloads_are_rejected_or_handled(name: str) -> None:
    target = _target(name)
    chooser = RandomChooser(SEED ^ zlib.crc32(name.encode()))
    kind = KIND_OF[target.message_type]
    seeds = [plain(m) for m in target.seeds]
    outcomes: Counter[str] = Counter()
    loop = asyncio.new_event_loop()
    try:
        for case in range(CASES):
            data = payload(chooser, kind, seeds)
            try:
                check_case(target, data, loop, outcomes)
            except AssertionError as exc:
                raise AssertionError(
                    f"case {case} (ELDR_FUZZ_SEED={SEED}), payload {data[:200]!r}: {exc}"
                ) from exc
        still_serving(target, loop)
    finally:
        loop.close()
    print(f"\n{name}: {CASES} seeded cases {dict(outcomes)}")
    reached_both_sides(target, outcomes)


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_hypothesis_hostile_payloads_are_rejected_or_handled(name: str) -> None:
    target = _target(name)
    loop = asyncio.new_event_loop()
    outcomes: Counter[str] = Counter()

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(payloads(target.message_type, target.seeds))
    def check(data: bytes) -> None:
        check_case(target, data, loop, outcomes)

    try:
        check()
        still_serving(target, loop)
    finally:
        loop.close()
    print(f"\n{name}: {sum(outcomes.values())} hypothesis cases {dict(outcomes)}")
    assert sum(outcomes.values()) >= EXAMPLES
    reached_both_sides(target, outcomes)


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_oversized_payloads_are_refused_before_decoding(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = _target(name)
    decoded: list[int] = []
    real = codec._DECODER

    class Spy:
        def decode(self, data: Any) -> Any:
            decoded.append(len(data))
            return real.decode(data)

    monkeypatch.setattr(codec, "_DECODER", Spy())
    limit = target.bus.settings.max_payload_bytes
    seed = encode(target.seeds[0])
    oversized = [
        b"\x00" * (limit + 1),
        seed + b"\x00" * (limit + 1 - len(seed)),  # a valid message with trailing bytes
    ]
    loop = asyncio.new_event_loop()
    try:
        for data in oversized:
            letters = target.dead_letters()
            outcome = loop.run_until_complete(target.feed(data))
            if target.reply_path:  # refused by `Bus.request`: the decision falls back
                assert outcome == "handled"
            else:
                assert outcome == "too_large"
                assert target.dead_letters() == letters + 1
        assert not [n for n in decoded if n > limit], "an oversized payload reached the decoder"
    finally:
        loop.close()


def test_dead_letters_keep_a_bounded_copy_of_the_payload() -> None:
    target = _target("load/router")
    loop = asyncio.new_event_loop()
    try:
        limit = target.bus.settings.max_payload_bytes
        loop.run_until_complete(target.feed(b"\x01" * (limit + 10)))
    finally:
        loop.close()
    letter = decode(target.nc.js.stored[target.dlq_subject][-1], codec.ALL_MESSAGE_TYPES)
    assert letter.payload_size_bytes == limit + 10  # type: ignore[attr-defined]
    assert len(letter.payload) <= 64 * 1024  # type: ignore[attr-defined]


@given(st.binary(max_size=64))
def test_the_codec_never_raises_anything_but_wire_error(data: bytes) -> None:
    for message_type in codec.ALL_MESSAGE_TYPES:
        with contextlib.suppress(WireError):
            decode(data, message_type)
