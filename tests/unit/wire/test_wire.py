"""Wire schemas: golden bytes, validation, arrays, and property tests (round trips; no
input makes `decode` raise anything but WireError).

Golden files live in tests/unit/wire/golden/{kind}.v{version}.msgpack. After an intentional
schema change (a new field with a default and a bumped `v`), write the new version's
file with `.venv/bin/python tests/unit/wire/test_wire.py` and keep the old files: they must
still decode.
"""

from __future__ import annotations

import contextlib
import math
import re
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from eldr.core.routing.profile import (
    PROFILE_TYPES,
    Band,
    Cheapest,
    EldrBoundedProfile,
    EldrCostProfile,
    EldrProfile,
    JsqProfile,
    MarginalUnionCost,
    NearestCentroids,
    PipelineProfile,
    profile_from_params,
)
from eldr.wire import (
    ALL_MESSAGE_TYPES,
    KIND_OF,
    SUPPORTED_VERSIONS,
    AssembleReply,
    AssembleRequest,
    BlockSummaryBatch,
    BlockSummaryMsg,
    CaptureStatus,
    DeadLetter,
    Decision,
    DecodeJob,
    DecodeJobAck,
    DecodeJobDone,
    DecodeSummary,
    LoadReport,
    Message,
    NdArray,
    PartitionAnnouncement,
    PartitionBlob,
    PrefillDone,
    RefitReply,
    RefitRequest,
    RequestFinished,
    RouterControl,
    RouterControlReply,
    SimStats,
    SimStatsRequest,
    SparseCounts,
    WireError,
    decode,
    encode,
)

GOLDEN_DIR = Path(__file__).parent / "golden"


# --- canonical messages (every field set) -------------------------------------------


def _counts(n_layers: int = 2, n_experts: int = 3, scale: int = 1) -> SparseCounts:
    dense = np.arange(n_layers * n_experts, dtype=np.uint32).reshape(n_layers, n_experts)
    return SparseCounts.from_dense(dense * scale)


def canonical_messages() -> dict[type[Message], Message]:
    """One deterministic instance of every message type, optional fields filled."""
    counts = _counts()
    f32 = np.float32
    return {
        BlockSummaryBatch: BlockSummaryBatch(
            worker_id="prefill-0",
            seq=7,
            ts_s=1_700_000_000.25,
            model="llama4-maverick",
            num_moe_layers=2,
            num_experts=3,
            block_size=16,
            blocks=[
                BlockSummaryMsg(block_hash=2**64 - 1, parent_hash=None, n_tokens=16, counts=counts),
                BlockSummaryMsg(
                    block_hash=12345, parent_hash=2**64 - 1, n_tokens=16, counts=counts
                ),
            ],
        ),
        PrefillDone: PrefillDone(
            request_id="req-1",
            model="llama4-maverick",
            prefill_worker="prefill-0",
            ts_s=1_700_000_000.5,
            block_size=16,
            block_hashes=[2**64 - 1, 12345],
            n_prompt_tokens=40,
            partial=_counts(scale=2),
            num_moe_layers=2,
            num_experts=3,
            reply_to="_INBOX.abc",
            prefill_s=0.125,
            max_tokens=512,
            attrs={"label": "math"},
            cached_prefix_blocks=1,
            capture="inexact",
            deadline_s=1_700_000_000.75,
            signature=_counts(scale=4),  # v4; `computed` (v3's golden) is never set with it
            client_request_id="client chose this id",  # v5
        ),
        AssembleRequest: AssembleRequest(
            request_id="req-1",
            model="llama4-maverick",
            block_hashes=[2**64 - 1, 12345],
            partial=counts,
            wait_ms=20,
            prefill_worker="prefill-0",
        ),
        AssembleReply: AssembleReply(
            request_id="req-1",
            counts=NdArray.from_numpy(np.arange(6, dtype=np.uint32).reshape(2, 3)),
            blocks_total=2,
            blocks_found=1,
            missing=[12345],
            error="one block missing",
        ),
        Decision: Decision(
            request_id="req-1",
            ts_s=1_700_000_000.75,
            router_id="router-a",
            model="llama4-maverick",
            worker_id="decode-3",
            policy="eldr_bounded",
            profile=EldrBoundedProfile(load_measure="kv_tokens", tau=0.2, widen_to=3, slack=0.25),
            partition_version=4,
            fallback="signature_partial",
            scores=[("decode-3", 0.91), ("decode-1", 0.85)],
            band=["decode-3", "decode-1"],
            loads=[],
            signature=counts,
            missing_blocks=1,
            decide_s=0.0004,
            rng_seed=2**63 - 1,
            fleet=[],
            prompt_tokens=40,
            outcome="assigned",
            considered=[
                ("decode-1", 5, 1200, 0.85, 14.5, 3.25),
                ("decode-3", 2, 800, 0.91, 9.0, 1.5),
                ("decode-7", 0, 0, None, None, None),
            ],
            live_workers=12,
            fleet_totals=(40, 9000),
            client_request_id="client chose this id",  # v4
        ),
        LoadReport: LoadReport(
            worker_id="decode-3",
            incarnation="2b9f1c",
            seq=99,
            ts_s=1_700_000_001.0,
            running=12,
            waiting=3,
            kv_tokens=40_000,
            kv_capacity_tokens=500_000,
            admitted=["req-1", "req-2"],
            draining=True,
        ),
        DecodeSummary: DecodeSummary(
            request_id="req-1",
            worker_id="decode-3",
            ts_s=1_700_000_009.0,
            tokens=256,
            counts=_counts(scale=7),
            tpot_s=0.021,
        ),
        PartitionAnnouncement: PartitionAnnouncement(
            version=4,
            model="llama4-maverick",
            object_name="v4",
            sha256="ab" * 32,
            created_ts_s=1_700_000_000.0,
            k=2,
            dim=3,
            workers=["decode-1", "decode-3"],
        ),
        PartitionBlob: PartitionBlob(
            version=4,
            model="llama4-maverick",
            transform="counts_idf",
            num_moe_layers=2,
            num_experts=3,
            idf=NdArray.from_numpy(np.full((2, 3), 0.5, dtype=f32)),
            layer_mask=NdArray.from_numpy(np.array([1, 0], dtype=np.uint8)),
            centroids=NdArray.from_numpy(np.eye(3, 2, dtype=f32)),
            owners=[0, 1, 1],
            workers=["decode-1", "decode-3"],
            metrics={"inertia": 12.5, "max_over_min": 1.0},
            projection=NdArray.from_numpy(np.ones((3, 2), dtype=f32)),
            projection_mean=NdArray.from_numpy(np.zeros(3, dtype=f32)),
        ),
        RouterControl: RouterControl(profile=EldrCostProfile(locality_weight=60.0, top_k=2)),
        RouterControlReply: RouterControlReply(
            router_id="router-a",
            policy="eldr",
            params=EldrProfile(tau=0.2).params(),
            profile=EldrProfile(tau=0.2),
            partition_version=4,
            live_workers=16,
            announced_version=5,
            partition_error="version 5: object v5 not found",
        ),
        RefitRequest: RefitRequest(reason="manual", k=16),
        RefitReply: RefitReply(version=5, status="ok", message="fitted 1000 signatures"),
        DecodeJob: DecodeJob(
            request_id="req-1",
            worker_id="decode-3",
            model="llama4-maverick",
            prompt_tokens=40,
            decode_ids=NdArray.from_numpy(np.arange(12, dtype=np.int16).reshape(3, 2, 2)),
            label="anatomy",
            done_to="_INBOX.sim.done",
        ),
        DecodeJobDone: DecodeJobDone(
            request_id="req-1", worker_id="decode-3", reason="length", output_tokens=3
        ),
        RequestFinished: RequestFinished(
            request_id="req-1",
            gateway_id="gateway-0",
            ts_s=1_700_000_010.0,
            reason="moved",
            worker_id="decode-3",
            moved_to="decode-1",
            output_tokens=0,
            decode_s=0.002,
            client_request_id="client chose this id",  # v2
        ),
        CaptureStatus: CaptureStatus(
            worker_id="prefill-0",
            incarnation="9f00aa",
            seq=3,
            ts_s=1_700_000_011.0,
            interval_s=2.0,
            prefill_capture="ok",
            decode_profiles="failed",
            reason="speculative decoding: decode rows include rejected drafts",
            model="tiny-moe",
            num_moe_layers=4,
            num_experts=16,
            top_k=2,
            vllm_version="0.32.0",
            runner="CPUModelRunner",
            steps_rejected=1,
            kv_connector="NixlConnector",  # v2
        ),
        DecodeJobAck: DecodeJobAck(request_id="req-1", accepted=False, reason="draining"),
        SimStatsRequest: SimStatsRequest(reset=True),
        SimStats: SimStats(
            worker_id="decode-3",
            steps=10,
            union_per_layer_sum=35.5,
            batch_sum=40,
            finished=2,
            tpot_s=NdArray.from_numpy(np.array([0.011, 0.012], dtype=np.float32)),
            running=3,
            waiting=1,
        ),
        DeadLetter: DeadLetter(
            subject="eldr.prefill.done.prefill-0",
            stream="ELDR_PREFILL",
            error="expected PrefillDone: malformed MessagePack",
            received_ts_s=1_700_000_002.0,
            payload=b"\x93garbage",
            headers={"Nats-Msg-Id": "x"},
            payload_size_bytes=9,
            stream_seq=17,
            num_delivered=1,
        ),
    }


def golden_path(message_type: type[Message]) -> Path:
    return GOLDEN_DIR / f"{KIND_OF[message_type]}.v{SUPPORTED_VERSIONS[message_type]}.msgpack"


def write_golden() -> None:
    GOLDEN_DIR.mkdir(exist_ok=True)
    for message_type, message in canonical_messages().items():
        path = golden_path(message_type)
        if not path.exists():
            path.write_bytes(encode(message))
            print(f"wrote {path}")


# --- golden bytes ------------------------------------------------------------------------


def test_every_message_type_has_a_canonical_instance() -> None:
    assert set(canonical_messages()) == set(ALL_MESSAGE_TYPES)


@pytest.mark.parametrize("message_type", ALL_MESSAGE_TYPES, ids=lambda t: t.__name__)
def test_golden_bytes_are_stable(message_type: type[Message]) -> None:
    path = golden_path(message_type)
    assert path.exists(), f"missing {path}: run .venv/bin/python tests/unit/wire/test_wire.py"
    golden = path.read_bytes()
    message = canonical_messages()[message_type]
    assert decode(golden, message_type) == message
    assert encode(message) == golden


@pytest.mark.parametrize("path", sorted(GOLDEN_DIR.glob("*.msgpack")), ids=lambda p: p.name)
def test_every_golden_file_still_decodes(path: Path) -> None:
    kind = re.sub(r"\.v\d+\.msgpack$", "", path.name)
    (message_type,) = [t for t, k in KIND_OF.items() if k == kind]
    assert isinstance(decode(path.read_bytes(), message_type), message_type)


# --- decode errors -----------------------------------------------------------------------


def _raw(message: Message) -> dict:
    return msgspec.msgpack.decode(encode(message))


def _reencode(raw: dict) -> bytes:
    return msgspec.msgpack.encode(raw)


def test_decode_names_the_expected_and_received_types() -> None:
    data = encode(RefitRequest(reason="x"))
    with pytest.raises(WireError, match="expected PrefillDone, got RefitRequest"):
        decode(data, PrefillDone)


def test_decode_accepts_any_of_several_expected_types() -> None:
    message = RefitRequest(reason="x")
    assert decode(encode(message), (PrefillDone, RefitRequest)) == message


def test_decode_rejects_an_unknown_kind() -> None:
    raw = _raw(RefitRequest(reason="x")) | {"kind": "no_such_thing"}
    with pytest.raises(WireError, match="unknown message kind"):
        decode(_reencode(raw), RefitRequest)


def test_decode_rejects_a_missing_kind() -> None:
    raw = _raw(RefitRequest(reason="x"))
    del raw["kind"]
    with pytest.raises(WireError, match="kind"):
        decode(_reencode(raw), RefitRequest)


def test_decode_rejects_a_newer_schema_version() -> None:
    raw = _raw(RefitRequest(reason="x")) | {"v": 2}
    with pytest.raises(WireError, match="schema version 2 is newer than the supported version 1"):
        decode(_reencode(raw), RefitRequest)


def test_decode_ignores_unknown_fields_of_a_supported_version() -> None:
    raw = _raw(RefitRequest(reason="x")) | {"added_later": 1}
    assert decode(_reencode(raw), RefitRequest) == RefitRequest(reason="x")


def test_decode_refuses_oversized_input_before_parsing() -> None:
    data = encode(RefitRequest(reason="x" * 100))
    with pytest.raises(WireError, match="exceeds 50"):
        decode(data, RefitRequest, max_bytes=50)


def test_decode_rejects_malformed_msgpack() -> None:
    with pytest.raises(WireError, match="malformed"):
        decode(b"\xc1", RefitRequest)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("worker_id", "decode.3", "regex"),
        ("running", -1, ">= 0"),
        ("ts_s", math.inf, "<="),
        ("ts_s", math.nan, ">="),
        ("seq", -5, ">= 0"),
        ("admitted", ["r"] * 5000, "length"),
    ],
)
def test_decode_enforces_field_constraints(field: str, value: object, error: str) -> None:
    raw = _raw(canonical_messages()[LoadReport]) | {field: value}
    with pytest.raises(WireError, match=re.escape(error)):
        decode(_reencode(raw), LoadReport)


def test_decode_enforces_cross_field_invariants() -> None:
    raw = _raw(canonical_messages()[PrefillDone]) | {"n_prompt_tokens": 80}
    with pytest.raises(WireError, match="block hashes for 80 prompt tokens"):
        decode(_reencode(raw), PrefillDone)


def test_an_unavailable_capture_carries_no_hashes_or_counts() -> None:
    raw = _raw(canonical_messages()[PrefillDone]) | {"capture": "unavailable"}
    with pytest.raises(WireError, match="carries no block hashes or counts"):
        decode(_reencode(raw), PrefillDone)
    raw |= {"block_hashes": [], "partial": None, "signature": None, "cached_prefix_blocks": 0}
    event = decode(_reencode(raw), PrefillDone)
    assert event.capture == "unavailable"
    assert event.n_prompt_tokens == 40  # no block-count check without hashes


def test_a_prefill_done_carries_the_whole_signature_or_the_computed_counts_not_both() -> None:
    event = canonical_messages()[PrefillDone]
    assert (event.v, event.computed, event.signature_source) == (5, None, "event")
    assert decode(encode(event), PrefillDone) == event  # round trip
    raw = _raw(event)
    with pytest.raises(WireError, match="not both"):
        decode(_reencode(raw | {"computed": raw["signature"]}), PrefillDone)
    with pytest.raises(WireError, match="not both"):
        msgspec.structs.replace(event, computed=_counts(scale=3))
    with pytest.raises(WireError, match=r"signature has shape \[3, 3\], expected \[2, 3\]"):
        msgspec.structs.replace(event, signature=_counts(n_layers=3))
    with pytest.raises(WireError, match="carries no block hashes or counts"):
        msgspec.structs.replace(
            event, capture="unavailable", block_hashes=[], partial=None, cached_prefix_blocks=0
        )


def test_older_prefill_dones_decode_without_a_signature() -> None:
    v3 = decode((GOLDEN_DIR / "prefill_done.v3.msgpack").read_bytes(), PrefillDone)
    assert (v3.v, v3.signature, v3.cached_prefix_blocks) == (3, None, 1)
    assert v3.computed is not None
    assert v3.signature_source == "service"
    v1 = decode((GOLDEN_DIR / "prefill_done.v1.msgpack").read_bytes(), PrefillDone)
    assert v1.signature is None


@pytest.mark.parametrize(
    ("changes", "source"),
    [
        ({"cached_prefix_blocks": 0, "computed": _counts()}, "computed"),
        ({"cached_prefix_blocks": 1, "computed": _counts()}, "service"),
        ({"cached_prefix_blocks": 0}, "service"),
        ({"block_hashes": [], "n_prompt_tokens": 8}, "partial_only"),
        ({"block_hashes": [], "n_prompt_tokens": 8, "partial": None}, "none"),
    ],
)
def test_a_prefill_done_says_where_its_signature_is(changes: dict, source: str) -> None:
    base = msgspec.structs.replace(
        canonical_messages()[PrefillDone], signature=None, cached_prefix_blocks=0
    )
    assert msgspec.structs.replace(base, **changes).signature_source == source


def test_records_before_the_client_label_decode_without_one() -> None:
    for kind, message_type in (
        ("prefill_done.v4", PrefillDone),
        ("decision.v3", Decision),
        ("request_finished.v1", RequestFinished),
    ):
        old = decode((GOLDEN_DIR / f"{kind}.msgpack").read_bytes(), message_type)
        assert old.client_request_id is None, kind  # type: ignore[attr-defined]
    status = decode((GOLDEN_DIR / "capture_status.v1.msgpack").read_bytes(), CaptureStatus)
    assert status.kv_connector is None


def test_finish_events_name_both_workers_only_for_a_move() -> None:
    raw = _raw(canonical_messages()[RequestFinished])
    with pytest.raises(WireError, match="names worker_id and moved_to"):
        decode(_reencode(raw | {"moved_to": None}), RequestFinished)
    with pytest.raises(WireError, match="moved_to is set but the reason is 'stop'"):
        decode(_reencode(raw | {"reason": "stop"}), RequestFinished)
    with pytest.raises(WireError, match="Invalid enum value 'done'"):
        decode(_reencode(raw | {"reason": "done"}), RequestFinished)


def test_construction_checks_invariants_too() -> None:
    with pytest.raises(WireError, match="blocks_found"):
        AssembleReply(request_id="r", counts=None, blocks_total=1, blocks_found=2, missing=[])


def test_block_counts_must_match_the_batch_geometry() -> None:
    block = BlockSummaryMsg(block_hash=1, parent_hash=None, n_tokens=4, counts=_counts(3, 3))
    with pytest.raises(WireError, match=r"blocks\[0\] has shape \[3, 3\]"):
        BlockSummaryBatch(
            worker_id="p",
            seq=0,
            ts_s=0.0,
            model="m",
            num_moe_layers=2,
            num_experts=3,
            block_size=4,
            blocks=[block],
        )


def test_partition_blob_owners_must_index_workers() -> None:
    blob = canonical_messages()[PartitionBlob]
    with pytest.raises(WireError, match="owner index"):
        msgspec.structs.replace(blob, owners=[0, 1, 2])


def test_u64_hashes_round_trip_at_the_extremes() -> None:
    message = AssembleRequest(
        request_id="r", model="m", block_hashes=[0, 2**63, 2**64 - 1], partial=None, wait_ms=0
    )
    assert decode(encode(message), AssembleRequest).block_hashes == [0, 2**63, 2**64 - 1]


def test_encode_refuses_a_hash_beyond_u64() -> None:
    message = AssembleRequest(
        request_id="r", model="m", block_hashes=[2**64], partial=None, wait_ms=0
    )
    with pytest.raises(WireError, match="cannot encode AssembleRequest"):
        encode(message)


# --- arrays ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype", ["uint8", "uint16", "uint32", "int16", "int32", "int64", "float32", "float64"]
)
def test_ndarray_round_trips_every_allowed_dtype(dtype: str) -> None:
    array = np.arange(24).reshape(2, 3, 4).astype(dtype)
    packed = msgspec.msgpack.encode(NdArray.from_numpy(array))
    back = msgspec.msgpack.decode(packed, type=NdArray).to_numpy()
    assert back.dtype == np.dtype(dtype)
    assert np.array_equal(back, array)


def test_ndarray_converts_big_endian_input_to_little_endian() -> None:
    array = np.array([1.5, -2.0], dtype=">f4")
    wire = NdArray.from_numpy(array)
    assert wire.data == np.array([1.5, -2.0], dtype="<f4").tobytes()
    assert np.array_equal(wire.to_numpy(), array)


def test_ndarray_rejects_a_disallowed_dtype() -> None:
    with pytest.raises(WireError, match="cannot go on the wire"):
        NdArray.from_numpy(np.zeros(3, dtype=np.complex64))


def test_ndarray_rejects_a_size_mismatch() -> None:
    with pytest.raises(WireError, match="needs 12 bytes, got 8"):
        NdArray(dtype="float32", shape=[3], data=b"\0" * 8)


def test_ndarray_rejects_too_many_elements() -> None:
    with pytest.raises(WireError, match="elements"):
        NdArray(dtype="uint8", shape=[1 << 20, 1 << 20], data=b"")


def test_sparse_counts_reject_unsorted_indices() -> None:
    idx = np.array([3, 1], dtype="<u4").tobytes()
    val = np.array([1, 1], dtype="<u2").tobytes()
    with pytest.raises(WireError, match="strictly ascending"):
        SparseCounts(shape=[2, 2], idx=idx, val=val)


def test_sparse_counts_reject_an_index_out_of_range() -> None:
    idx = np.array([4], dtype="<u4").tobytes()
    val = np.array([1], dtype="<u2").tobytes()
    with pytest.raises(WireError, match="index 4 >= 4"):
        SparseCounts(shape=[2, 2], idx=idx, val=val)


def test_sparse_counts_reject_unequal_lengths() -> None:
    idx = np.array([0, 1], dtype="<u4").tobytes()
    val = np.array([1], dtype="<u2").tobytes()
    with pytest.raises(WireError, match="2 indices but 2 value bytes"):
        SparseCounts(shape=[2, 2], idx=idx, val=val)


def test_sparse_counts_widen_values_beyond_uint16() -> None:
    counts = SparseCounts.from_dense(np.array([[70_000, 0]], dtype=np.int64))
    assert counts.val_dtype == "uint32"
    assert counts.to_dense().tolist() == [[70_000, 0]]


def test_sparse_counts_add_into_an_accumulator() -> None:
    total = np.ones((2, 3), dtype=np.uint32)
    _counts().add_to(total)
    assert total.tolist() == [[1, 2, 3], [4, 5, 6]]


dense_counts = hnp.arrays(
    dtype=st.sampled_from([np.uint8, np.uint16, np.uint32, np.int64]),
    shape=hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
    elements=st.integers(0, 255),
)


@given(dense_counts)
def test_sparse_counts_round_trip_dense(dense: np.ndarray) -> None:
    sparse = SparseCounts.from_dense(dense)
    assert np.array_equal(sparse.to_dense(np.int64), dense.astype(np.int64))
    assert sparse.nnz == int(np.count_nonzero(dense))


# --- property tests: round trips and robustness ------------------------------------------

# "-" is the one token that is no worker id (NO_WORKER, an expired decision's).
token = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True).filter(lambda s: s != "-")
ident = st.text(min_size=1, max_size=16)
u64 = st.integers(0, 2**64 - 1)
count = st.integers(0, 2**40)
ts = st.floats(0, 1e10, allow_nan=False)
duration = st.floats(0, 1e5, allow_nan=False)
finite = st.floats(-1e20, 1e20, allow_nan=False, allow_infinity=False)


@st.composite
def geometry(draw: st.DrawFn) -> tuple[int, int]:
    return draw(st.integers(1, 4)), draw(st.integers(1, 6))


def sparse_of(n_layers: int, n_experts: int) -> st.SearchStrategy[SparseCounts]:
    return hnp.arrays(np.uint32, (n_layers, n_experts), elements=st.integers(0, 70_000)).map(
        SparseCounts.from_dense
    )


@st.composite
def block_summary_batches(draw: st.DrawFn) -> BlockSummaryBatch:
    n_layers, n_experts = draw(geometry())
    block_size = draw(st.integers(1, 32))
    blocks = draw(
        st.lists(
            st.builds(
                BlockSummaryMsg,
                block_hash=u64,
                parent_hash=st.none() | u64,
                n_tokens=st.integers(1, block_size),
                counts=sparse_of(n_layers, n_experts),
            ),
            max_size=4,
        )
    )
    return BlockSummaryBatch(
        worker_id=draw(token),
        seq=draw(u64),
        ts_s=draw(ts),
        model=draw(ident),
        num_moe_layers=n_layers,
        num_experts=n_experts,
        block_size=block_size,
        blocks=blocks,
    )


@st.composite
def prefill_dones(draw: st.DrawFn) -> PrefillDone:
    n_layers, n_experts = draw(geometry())
    block_size = draw(st.integers(1, 32))
    n_tokens = draw(st.integers(0, 200))
    has_partial = n_tokens % block_size != 0 and draw(st.booleans())
    carried = draw(st.sampled_from(["none", "computed", "signature"]))
    counts = None if carried == "none" else draw(sparse_of(n_layers, n_experts))
    return PrefillDone(
        request_id=draw(ident),
        model=draw(ident),
        prefill_worker=draw(token),
        ts_s=draw(ts),
        block_size=block_size,
        block_hashes=draw(
            st.lists(u64, min_size=n_tokens // block_size, max_size=n_tokens // block_size)
        ),
        n_prompt_tokens=n_tokens,
        partial=draw(sparse_of(n_layers, n_experts)) if has_partial else None,
        num_moe_layers=n_layers,
        num_experts=n_experts,
        reply_to=draw(st.none() | ident),
        prefill_s=draw(st.none() | duration),
        max_tokens=draw(st.none() | count),
        attrs=draw(
            st.dictionaries(st.text(min_size=1, max_size=8), st.text(max_size=8), max_size=3)
        ),
        cached_prefix_blocks=draw(st.integers(0, n_tokens // block_size)),
        computed=counts if carried == "computed" else None,
        signature=counts if carried == "signature" else None,
    )


@st.composite
def decisions(draw: st.DrawFn) -> Decision:
    n_layers, n_experts = draw(geometry())
    param = finite | st.integers(-(2**62), 2**62) | st.text(max_size=8)
    return Decision(
        request_id=draw(ident),
        ts_s=draw(ts),
        router_id=draw(ident),
        model=draw(ident),
        worker_id=draw(token),
        policy=draw(ident),
        params=draw(st.dictionaries(st.text(min_size=1, max_size=8), param, max_size=4)),
        partition_version=draw(st.none() | st.integers(1, 10**9)),
        fallback=draw(st.none() | st.text(max_size=20)),
        scores=draw(st.lists(st.tuples(token, finite), max_size=4)),
        band=draw(st.lists(token, max_size=4)),
        loads=draw(st.lists(st.tuples(token, finite), max_size=4)),
        signature=draw(st.none() | sparse_of(n_layers, n_experts)),
        missing_blocks=draw(count),
        decide_s=draw(duration),
    )


@st.composite
def assemble_replies(draw: st.DrawFn) -> AssembleReply:
    total = draw(st.integers(0, 100))
    counts = draw(
        st.none()
        | hnp.arrays(np.uint32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=5)).map(
            NdArray.from_numpy
        )
    )
    return AssembleReply(
        request_id=draw(ident),
        counts=counts,
        blocks_total=total,
        blocks_found=draw(st.integers(0, total)),
        missing=draw(st.lists(u64, max_size=5)),
        error=draw(st.none() | st.text(max_size=20)),
    )


@st.composite
def partition_blobs(draw: st.DrawFn) -> PartitionBlob:
    n_layers, n_experts = draw(geometry())
    workers = draw(st.lists(token, min_size=1, max_size=4))
    n_centroids = draw(st.integers(0, 5))
    dim = draw(st.integers(1, 6))
    f32 = hnp.arrays(np.float32, (n_centroids, dim), elements=st.floats(-1, 1, width=32))
    return PartitionBlob(
        version=draw(st.integers(1, 10**6)),
        model=draw(ident),
        transform=draw(ident),
        num_moe_layers=n_layers,
        num_experts=n_experts,
        idf=draw(
            st.none()
            | hnp.arrays(
                np.float32, (n_layers, n_experts), elements=st.floats(0, 10, width=32)
            ).map(NdArray.from_numpy)
        ),
        layer_mask=NdArray.from_numpy(
            draw(hnp.arrays(np.uint8, n_layers, elements=st.integers(0, 1)))
        ),
        centroids=NdArray.from_numpy(draw(f32)),
        owners=draw(
            st.lists(st.integers(0, len(workers) - 1), min_size=n_centroids, max_size=n_centroids)
        ),
        workers=workers,
        metrics=draw(st.dictionaries(ident, finite, max_size=3)),
    )


@st.composite
def decode_summaries(draw: st.DrawFn) -> DecodeSummary:
    n_layers, n_experts = draw(geometry())
    return DecodeSummary(
        request_id=draw(ident),
        worker_id=draw(token),
        ts_s=draw(ts),
        tokens=draw(count),
        counts=draw(sparse_of(n_layers, n_experts)),
        tpot_s=draw(st.none() | duration),
    )


messages = st.one_of(
    block_summary_batches(),
    prefill_dones(),
    decisions(),
    assemble_replies(),
    partition_blobs(),
    decode_summaries(),
    st.builds(
        AssembleRequest,
        request_id=ident,
        model=ident,
        block_hashes=st.lists(u64, max_size=5),
        partial=st.none() | geometry().flatmap(lambda g: sparse_of(*g)),
        wait_ms=st.integers(0, 60_000),
    ),
    st.builds(
        LoadReport,
        worker_id=token,
        incarnation=ident,
        seq=u64,
        ts_s=ts,
        running=count,
        waiting=count,
        kv_tokens=count,
        kv_capacity_tokens=count,
        admitted=st.lists(ident, max_size=4),
        draining=st.booleans(),
    ),
    st.builds(
        PartitionAnnouncement,
        version=st.integers(1, 10**6),
        model=ident,
        object_name=ident,
        sha256=st.from_regex(r"[0-9a-f]{64}", fullmatch=True),
        created_ts_s=ts,
        k=st.integers(1, 100),
        dim=st.integers(1, 5000),
        workers=st.lists(token, max_size=4),
    ),
    st.builds(
        RouterControl,
        policy=st.none() | ident,
        tau=st.none() | st.floats(0, 2),
        load_measure=st.none() | ident,
    ),
    st.builds(RouterControl, profile=st.sampled_from([t() for t in PROFILE_TYPES.values()])),
    st.builds(RefitRequest, reason=st.text(max_size=20), k=st.none() | st.integers(1, 100)),
    st.builds(
        RefitReply,
        version=st.none() | st.integers(1, 100),
        status=ident,
        message=st.text(max_size=20),
    ),
    st.builds(
        DeadLetter,
        subject=st.text(max_size=30),
        stream=st.none() | st.text(max_size=10),
        error=st.text(max_size=30),
        received_ts_s=ts,
        payload=st.binary(max_size=64),
        headers=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
        payload_size_bytes=count,
        stream_seq=st.none() | u64,
        num_delivered=count,
    ),
)


@given(messages)
@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
def test_valid_messages_round_trip(message: Message) -> None:
    assert decode(encode(message), type(message)) == message


@given(st.binary(max_size=512))
@settings(max_examples=500)
def test_random_bytes_raise_only_wire_errors(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode(data, ALL_MESSAGE_TYPES)


@given(messages, st.data())
@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=300)
def test_mutated_messages_raise_only_wire_errors(message: Message, data: st.DataObject) -> None:
    encoded = bytearray(encode(message))
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(encoded) - 1))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip":
            encoded[position] = data.draw(st.integers(0, 255))
        elif action == "cut":
            del encoded[position:]
            if not encoded:
                break
        else:
            encoded[position:position] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        decoded = decode(bytes(encoded), ALL_MESSAGE_TYPES)
    except WireError:
        return
    # Whatever decodes must be a valid message that survives another round trip.
    assert decode(encode(decoded), type(decoded)) == decoded


if __name__ == "__main__":
    write_golden()


# --- decisions every reader can decode (issue 15, finding 2) -----------------------------


def test_a_decision_naming_more_workers_than_readers_accept_cannot_be_built() -> None:
    fleet = [(f"w{i}", 0, 0) for i in range(4097)]
    with pytest.raises(WireError, match="at most 4096 workers"):
        msgspec.structs.replace(canonical_messages()[Decision], fleet=fleet)


def test_the_decision_size_bound_holds_for_the_largest_decision() -> None:
    from eldr.core.routing.decide import FALLBACK_REASONS
    from eldr.wire.messages import decision_bytes_bound

    workers, cells = 1024, 16_384
    tokens = [f"{i:04d}".ljust(256, "w") for i in range(workers)]
    # The profile that encodes longest, at values of the most digits.
    tiny = 1.2345678901234567e-300
    profile = max(
        (
            EldrCostProfile(locality_weight=tiny, prior_tokens=1e-300 / 3),
            EldrBoundedProfile(tau=0.1234567890123456, slack=tiny),
            PipelineProfile(
                candidates=NearestCentroids(k=4095),
                filters=(Band(tau=0.1234567890123456, widen_to=4095),) * 8,
                scorers=(MarginalUnionCost(weight=tiny),) * 8,
                picker=Cheapest(tolerance=tiny),
                prior_tokens=1e-300 / 3,
                top_k=4095,
            ),
        ),
        key=lambda p: len(msgspec.msgpack.encode(p)),
    )
    assert isinstance(profile, PipelineProfile)
    dense = np.full((16, cells // 16), 70_000, dtype=np.uint32)  # every cell, uint32
    big = Decision(
        request_id="\U0001f600" * 256,  # 4 bytes per character in UTF-8
        ts_s=1e9,
        router_id="\U0001f600" * 256,
        model="\U0001f600" * 256,
        worker_id=tokens[0],
        policy=profile.name,
        profile=profile,
        partition_version=2**62,
        fallback=max(FALLBACK_REASONS, key=len),
        scores=[(t, -1.234567e-29) for t in tokens[:64]],
        band=tokens,
        loads=[],  # routers write no loads where they write the fleet (v4)
        signature=SparseCounts.from_dense(dense),
        missing_blocks=2**63,
        decide_s=0.123456789,
        rng_seed=2**63 - 1,
        fleet=[(t, 2**63, 2**64 - 1) for t in tokens],
        prompt_tokens=2**64 - 1,
        considered=[(t, 2**63, 2**64 - 1, -1.234567e-29, 1.5e29, 1.5e29) for t in tokens],
    )
    size = len(encode(big))
    assert size <= decision_bytes_bound(workers, cells, 64)
    assert decision_bytes_bound(workers, cells, 64) <= 1 << 20  # the router's defaults fit
    assert decode(encode(big), Decision) == big


def test_a_decision_records_its_profile_typed_and_older_records_map_onto_one() -> None:
    typed = canonical_messages()[Decision]
    assert typed.routing_profile == typed.profile
    assert decode(encode(typed), Decision).profile == typed.profile
    old = decode((GOLDEN_DIR / "decision.v2.msgpack").read_bytes(), Decision)
    assert (old.v, old.profile, old.policy) == (2, None, "eldr")
    v2 = msgspec.structs.replace(old, params={"tau": 0.2, "load_measure": "kv_tokens"})
    assert v2.routing_profile == EldrProfile(tau=0.2, load_measure="kv_tokens", widen_to=2)
    assert v2.routing_profile == profile_from_params("eldr", v2.params)
    with pytest.raises(ValueError, match="takes no parameter k"):
        _ = old.routing_profile  # the golden's own params name no real parameter set


def test_a_decision_profile_is_validated_on_decode() -> None:
    raw = _raw(canonical_messages()[Decision])
    raw["profile"]["tau"] = -1.0
    with pytest.raises(WireError, match="tau"):
        decode(msgspec.msgpack.encode(raw), Decision)
    raw["profile"] = {"policy": "eldr_bounded", "tau": 0.1, "bogus": 1}
    with pytest.raises(WireError, match="bogus"):
        decode(msgspec.msgpack.encode(raw), Decision)
    raw = _raw(canonical_messages()[Decision])
    raw["policy"] = "jsq"
    with pytest.raises(WireError, match="names its policy"):
        decode(msgspec.msgpack.encode(raw), Decision)


def test_a_router_control_sets_a_profile_or_the_older_fields_not_both() -> None:
    with pytest.raises(WireError, match="not both"):
        RouterControl(policy="eldr", profile=JsqProfile())


def test_an_expired_decision_names_no_worker() -> None:
    from eldr.wire.messages import NO_WORKER

    expired = msgspec.structs.replace(
        canonical_messages()[Decision],
        outcome="expired",
        worker_id=NO_WORKER,
        fleet=[],
        loads=[],
        band=[],
        scores=[],
    )
    assert not expired.assigned
    assert decode(encode(expired), Decision) == expired
    with pytest.raises(WireError, match="names no worker"):
        msgspec.structs.replace(expired, worker_id="decode-3")
    with pytest.raises(WireError, match="an assigned decision names a worker"):
        msgspec.structs.replace(canonical_messages()[Decision], worker_id=NO_WORKER)
    old = decode((GOLDEN_DIR / "decision.v1.msgpack").read_bytes(), Decision)
    assert old.assigned  # records written before outcomes existed are assignments
