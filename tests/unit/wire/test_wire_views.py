"""Views of a message (`eldr.wire.messages.VIEWS`): decoded from the full record's bytes,
only the fields they declare, with the same checks; never sent."""

from __future__ import annotations

import typing

import msgspec
import numpy as np
import pytest

from eldr.wire import Decision, DecisionAssignment, DecisionRoute, WireError, decode, encode
from eldr.wire.messages import NO_WORKER, VIEWS, RefitRequest
from support.messages import decision


def _hints(t: type) -> dict[str, object]:
    return typing.get_type_hints(t, include_extras=True)


@pytest.mark.parametrize("view", list(VIEWS), ids=lambda t: t.__name__)
def test_a_view_declares_fields_of_its_full_type_with_the_same_types(view: type) -> None:
    full = VIEWS[view]
    view_fields = {f.name for f in msgspec.structs.fields(view)}
    full_hints, view_hints = _hints(full), _hints(view)
    assert view_fields <= set(full_hints)
    for name in view_fields:
        assert view_hints[name] == full_hints[name], name
    assert view.__struct_config__.tag == full.__struct_config__.tag


def test_a_decision_reads_the_same_through_its_views() -> None:
    counts = np.zeros((2, 4), dtype=np.uint32)
    counts[1, 3] = 7
    full = decision("r1", "d2", counts=counts, prompt_tokens=33, fleet=[("d2", 1, 10)])
    data = encode(full)
    assignment = decode(data, DecisionAssignment)
    assert (assignment.request_id, assignment.worker_id, assignment.model) == ("r1", "d2", "m")
    assert assignment.router_id == full.router_id
    assert assignment.prompt_tokens == 33
    assert assignment.assigned
    assert assignment.signature == full.signature
    route = decode(data, DecisionRoute)
    assert (route.request_id, route.worker_id, route.assigned) == ("r1", "d2", True)


def test_an_expired_record_reads_as_not_assigned() -> None:
    record = decision("r1", NO_WORKER, outcome="expired")
    for view in VIEWS:
        assert not decode(encode(record), view).assigned  # type: ignore[attr-defined]


def test_a_view_refuses_what_the_full_type_refuses() -> None:
    raw = msgspec.msgpack.decode(encode(decision("r1", "d0")))
    newer = msgspec.msgpack.encode(raw | {"v": 99})
    bad_worker = msgspec.msgpack.encode(raw | {"worker_id": "a.b"})
    expired_with_worker = msgspec.msgpack.encode(raw | {"outcome": "expired"})
    for view in VIEWS:
        with pytest.raises(WireError, match="newer than the supported version"):
            decode(newer, view)
        with pytest.raises(WireError, match="worker_id"):
            decode(bad_worker, view)
        with pytest.raises(WireError, match="expired decision names no worker"):
            decode(expired_with_worker, view)
        with pytest.raises(WireError, match="kind"):
            decode(encode(RefitRequest(reason="x")), view)
        with pytest.raises(WireError, match="exceeds"):
            decode(encode(decision("r1", "d0")), view, max_bytes=10)


def test_a_view_is_never_encoded() -> None:
    view = decode(encode(decision("r1", "d0")), DecisionRoute)
    with pytest.raises(WireError, match="a view of Decision"):
        encode(view)


def test_the_full_type_still_decodes_whole() -> None:
    full = decision("r1", "d0", fleet=[("d0", 2, 5)])
    assert decode(encode(full), Decision) == full
