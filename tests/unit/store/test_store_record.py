"""PartitionRecord validation and the array <-> bytes encoding of the store (no database)."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from eldr.store.models import PartitionStatus
from eldr.store.repo import (
    CorruptVersionError,
    PartitionRecord,
    _from_npy,
    _to_npy,
)

SHA = hashlib.sha256(b"blob").hexdigest()


def record(**overrides: Any) -> PartitionRecord:
    fields: dict[str, Any] = {
        "model": "m",
        "transform": "count_idf",
        "num_moe_layers": 2,
        "num_experts": 3,
        "seed": 0,
        "n_train": 10,
        "centroids": np.eye(4, 5, dtype=np.float32),
        "owners": (0, 1, 0, 1),
        "workers": ("w0", "w1"),
        "layer_mask": np.array([True, False]),
        "blob_sha256": SHA,
    }
    fields.update(overrides)
    return PartitionRecord(**fields)


def test_derived_sizes() -> None:
    rec = record()
    assert (rec.k, rec.num_centroids, rec.dim) == (2, 4, 5)


def test_float64_centroids_are_stored_as_float32() -> None:
    assert record(centroids=np.eye(4, 5)).centroids.dtype == np.float32


def test_arrays_are_read_only_private_copies() -> None:
    centroids = np.eye(4, 5, dtype=np.float32)
    rec = record(centroids=centroids)
    centroids[0, 0] = 9.0
    assert rec.centroids[0, 0] == 1.0
    with pytest.raises(ValueError, match="read-only"):
        rec.centroids[0, 0] = 2.0


def test_metrics_are_read_only() -> None:
    rec = record(metrics={"inertia": 1.0})
    with pytest.raises(TypeError):
        rec.metrics["inertia"] = 2.0  # type: ignore[index]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"owners": (0, 1, 0)}, "3 owners for 4 centroids"),
        ({"owners": (0, 1, 0, 2)}, "worker slots"),
        ({"owners": (0, 1, 0, -1)}, "worker slots"),
        ({"workers": ("w0", "w0")}, "unique"),
        ({"workers": ()}, "at least one worker"),
        ({"centroids": np.zeros((4,), np.float32)}, r"\[num_centroids, dim\]"),
        ({"centroids": np.eye(4, 5, dtype=np.int32)}, "float array"),
        ({"centroids": np.full((4, 5), np.nan, np.float32)}, "NaN"),
        ({"layer_mask": np.array([1, 0])}, "bool"),
        ({"layer_mask": np.array([True])}, "bool"),
        ({"idf": np.ones(5, np.float32)}, "idf has 5 entries"),
        ({"metrics": {"x": float("nan")}}, "JSON"),
        ({"metrics": {"x": object()}}, "JSON"),
        ({"blob_sha256": SHA.upper()}, "lowercase hex"),
        ({"blob_sha256": "abc"}, "lowercase hex"),
        ({"model": ""}, "model"),
        ({"model": "x" * 201}, "model"),
        ({"num_moe_layers": 0}, "num_moe_layers"),
        ({"seed": 2**64}, "64 bits"),
        ({"parent_version": 0}, "parent_version"),
    ],
)
def test_invalid_records_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        record(**overrides)


def test_status_strings_become_enum_members() -> None:
    rec = dataclasses.replace(record(), status="retired")  # type: ignore[arg-type]
    assert rec.status is PartitionStatus.RETIRED


@given(
    hnp.arrays(
        dtype=st.sampled_from([np.float32, np.bool_]),
        shape=hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=5),
    )
)
def test_npy_encoding_round_trips_dtype_shape_and_values(array: np.ndarray) -> None:
    decoded = _from_npy(_to_npy(array), version=1, name="a", dtype=array.dtype)
    assert decoded.dtype == array.dtype
    assert decoded.shape == array.shape
    np.testing.assert_array_equal(decoded, array)


def test_decoding_refuses_an_unexpected_dtype() -> None:
    with pytest.raises(CorruptVersionError, match="float64"):
        _from_npy(_to_npy(np.zeros(3)), version=1, name="a", dtype=np.dtype(np.float32))


def test_decoding_refuses_garbage() -> None:
    with pytest.raises(CorruptVersionError, match="not valid"):
        _from_npy(b"not npy", version=1, name="a", dtype=np.dtype(np.float32))
