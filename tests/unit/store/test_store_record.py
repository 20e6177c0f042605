"""PartitionRecord: a version's blob bytes and the fit facts the blob does not hold; what
the record reads from the blob and what it refuses (no database)."""

from __future__ import annotations

import dataclasses
import hashlib
from datetime import datetime
from typing import Any

import numpy as np
import pytest

from eldr.store.models import PartitionStatus
from eldr.store.repo import PartitionRecord
from eldr.wire import NdArray, PartitionBlob, RefitRequest, encode


def blob_bytes(**overrides: Any) -> bytes:
    fields: dict[str, Any] = {
        "version": 3,
        "model": "m",
        "transform": "idf",
        "num_moe_layers": 2,
        "num_experts": 3,
        "idf": NdArray.from_numpy(np.ones((2, 3), np.float32)),
        "layer_mask": NdArray.from_numpy(np.array([1, 0], np.uint8)),
        "centroids": NdArray.from_numpy(np.eye(4, 5, dtype=np.float32)),
        "owners": [0, 1, 0, 1],
        "workers": ["w0", "w1"],
        "metrics": {"inertia": 1.0},
    }
    fields.update(overrides)
    return encode(PartitionBlob(**fields))


def record(data: bytes | None = None, **overrides: Any) -> PartitionRecord:
    fields: dict[str, Any] = {"blob_bytes": blob_bytes() if data is None else data}
    fields.update({"seed": 0, "n_train": 10} | overrides)
    return PartitionRecord(**fields)


def test_what_the_record_reads_from_its_blob() -> None:
    data = blob_bytes()
    rec = record(data)
    assert rec.blob_bytes == data
    assert rec.blob_sha256 == hashlib.sha256(data).hexdigest()
    assert rec.blob.version == 3
    assert (rec.model, rec.k, rec.num_centroids, rec.dim) == ("m", 2, 4, 5)
    assert (rec.num_moe_layers, rec.num_experts) == (2, 3)


def test_a_copy_reads_its_own_blob() -> None:
    other = blob_bytes(model="other", workers=["a", "b", "c"])
    copy = dataclasses.replace(record(), blob_bytes=other)
    assert (copy.model, copy.k) == ("other", 3)
    assert copy.blob_sha256 == hashlib.sha256(other).hexdigest()


def test_records_compare_by_value() -> None:
    assert record() == record()
    assert record() != record(note="other")


def test_a_buffer_is_kept_as_bytes() -> None:
    data = blob_bytes()
    assert record(bytearray(data)).blob_bytes == data
    assert type(record(bytearray(data)).blob_bytes) is bytes


@pytest.mark.parametrize(
    ("data", "overrides", "message"),
    [
        (b"not msgpack", {}, "not a valid partition blob"),
        (encode(RefitRequest(reason="x")), {}, "not a valid partition blob"),
        (blob_bytes(workers=["w0", "w0"]), {}, "unique"),
        (
            blob_bytes(
                owners=[], workers=[], centroids=NdArray.from_numpy(np.zeros((0, 5), np.float32))
            ),
            {},
            "at least one worker",
        ),
        (blob_bytes(model="x" * 201), {}, "model"),
        (
            blob_bytes(centroids=NdArray.from_numpy(np.full((4, 5), np.nan, np.float32))),
            {},
            "NaN",
        ),
        (blob_bytes(), {"version": 4}, "holds a blob of version 3"),
        (blob_bytes(), {"seed": 2**64}, "64 bits"),
        (blob_bytes(), {"n_train": -1}, "n_train"),
        (blob_bytes(), {"parent_version": 0}, "parent_version"),
        (blob_bytes(), {"created_at": datetime(2026, 1, 1)}, "timezone-aware"),
    ],
)
def test_invalid_records_are_refused(data: bytes, overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        record(data, **overrides)


def test_status_strings_become_enum_members() -> None:
    rec = dataclasses.replace(record(), status="retired")  # type: ignore[arg-type]
    assert rec.status is PartitionStatus.RETIRED


def test_the_blob_fields_cannot_be_set_directly() -> None:
    with pytest.raises(TypeError):
        PartitionRecord(blob_bytes=blob_bytes(), seed=0, n_train=1, model="x")  # type: ignore[call-arg]
