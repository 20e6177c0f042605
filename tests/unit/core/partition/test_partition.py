"""Partitions: fitting (balanced, deterministic, minimal churn), scoring, and round trips
through the wire blob (which the database record stores)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.core.partition.partition import (
    FitReport,
    Partition,
    assign_clusters_to_workers,
    fit_partition,
    previous_choices,
)
from eldr.core.signature.signature import Calibration
from eldr.core.workload.synthetic import SyntheticSpec, generate, make_world
from eldr.core.workload.trace import ModelGeometry, counts_matrix
from eldr.partitions.codec import blob_sha256, partition_from_blob, partition_to_blob
from eldr.store.repo import PartitionRecord
from eldr.wire import PartitionBlob, decode, encode

SPEC = SyntheticSpec(
    num_topics=4,
    num_moe_layers=6,
    num_experts=16,
    top_k=2,
    prompt_len_range=(16, 48),
    decode_len_range=(8, 24),
)
WORKERS = ("dw0", "dw1", "dw2", "dw3")
N_TRAIN = 240


@dataclasses.dataclass(frozen=True)
class Data:
    geometry: ModelGeometry
    prefill: np.ndarray
    decode: np.ndarray
    fresh_prefill: np.ndarray
    fresh_decode: np.ndarray
    labels: tuple[str, ...]


@pytest.fixture(scope="module")
def data() -> Data:
    rng = np.random.default_rng(7)
    world = make_world(SPEC, rng)
    first = generate(SPEC, N_TRAIN, rng, world=world)
    second = generate(SPEC, N_TRAIN, rng, world=world)
    g = SPEC.geometry
    return Data(
        g,
        counts_matrix(first.traces, g, "prefill"),
        counts_matrix(first.traces, g, "decode"),
        counts_matrix(second.traces, g, "prefill"),
        counts_matrix(second.traces, g, "decode"),
        tuple(t.label for t in first.traces),
    )


@pytest.fixture(scope="module")
def fitted(data: Data) -> tuple[Partition, FitReport]:
    return fit_partition(
        data.prefill, data.decode, data.geometry, WORKERS, version=1, model="m", seed=3
    )


# --- fitting --------------------------------------------------------------------------------


def test_fit_gives_one_cluster_per_worker(fitted: tuple[Partition, FitReport]) -> None:
    partition, _ = fitted
    assert partition.centroids.shape[0] == len(WORKERS)
    assert sorted(partition.owners.tolist()) == list(range(len(WORKERS)))
    np.testing.assert_allclose(np.linalg.norm(partition.centroids, axis=1), 1.0, atol=1e-5)


def test_fit_clusters_are_balanced(fitted: tuple[Partition, FitReport]) -> None:
    _, report = fitted
    cap = -(-N_TRAIN // len(WORKERS))
    assert report.cluster_size_max <= cap
    assert report.cluster_size_min >= N_TRAIN - cap * (len(WORKERS) - 1)


def test_fit_is_deterministic_for_a_seed(data: Data, fitted: tuple[Partition, FitReport]) -> None:
    again, _ = fit_partition(
        data.prefill, data.decode, data.geometry, WORKERS, version=1, model="m", seed=3
    )
    np.testing.assert_array_equal(again.centroids, fitted[0].centroids)
    np.testing.assert_array_equal(again.owners, fitted[0].owners)
    np.testing.assert_array_equal(again.calibration.layer_mask, fitted[0].calibration.layer_mask)


def test_fit_reports_its_metrics(fitted: tuple[Partition, FitReport]) -> None:
    partition, report = fitted
    assert report.n_train == N_TRAIN
    assert report.moved_share is None
    assert partition.metrics["n_train"] == N_TRAIN
    assert "moved_share" not in partition.metrics


def test_workers_own_similar_requests(data: Data, fitted: tuple[Partition, FitReport]) -> None:
    # Requests of one topic mostly share a best worker: the partition follows the topics.
    best = previous_choices(fitted[0], data.prefill)
    by_topic: dict[str, list[str | None]] = {}
    for label, worker in zip(data.labels, best, strict=True):
        by_topic.setdefault(label, []).append(worker)
    purity = np.mean([max(ws.count(w) for w in set(ws)) / len(ws) for ws in by_topic.values()])
    assert purity > 0.8


def test_refit_on_the_same_data_moves_nothing(
    data: Data, fitted: tuple[Partition, FitReport]
) -> None:
    previous, _ = fitted
    refit, report = fit_partition(
        data.prefill,
        data.decode,
        data.geometry,
        WORKERS,
        version=2,
        model="m",
        seed=3,
        previous=previous,
    )
    assert report.moved_share == 0.0
    assert refit.metrics["moved_share"] == 0.0


def test_refit_with_previous_moves_less_than_an_unaligned_refit(
    data: Data, fitted: tuple[Partition, FitReport]
) -> None:
    previous, _ = fitted
    args = (data.fresh_prefill, data.fresh_decode, data.geometry, WORKERS)
    _, report = fit_partition(*args, version=2, model="m", seed=3, previous=previous)
    unaligned, _ = fit_partition(*args, version=2, model="m", seed=3)
    before = previous_choices(previous, data.fresh_prefill)
    moved_unaligned = np.mean(
        [
            a != b
            for a, b in zip(before, previous_choices(unaligned, data.fresh_prefill), strict=True)
        ]
    )
    assert report.moved_share is not None
    assert report.moved_share < 0.2
    assert report.moved_share <= moved_unaligned


def test_refit_onto_other_workers_keeps_the_surviving_ones(
    data: Data, fitted: tuple[Partition, FitReport]
) -> None:
    previous, _ = fitted
    workers = ("dw0", "dw1", "dw2", "dw9")  # dw3 left, dw9 joined
    refit, report = fit_partition(
        data.prefill,
        data.decode,
        data.geometry,
        workers,
        version=2,
        model="m",
        seed=3,
        previous=previous,
    )
    assert report.moved_share is not None
    # dw3's requests must move (about a quarter); the others' mostly stay.
    assert report.moved_share < 0.45
    assert refit.workers == workers


def test_a_previous_partition_of_another_geometry_is_ignored(
    data: Data, fitted: tuple[Partition, FitReport]
) -> None:
    previous, _ = fitted
    g = ModelGeometry(num_layers=3, moe_layers=(0, 1, 2), num_experts=16, top_k=2)
    cols = 3 * 16
    _, report = fit_partition(
        data.prefill[:, :cols], None, g, WORKERS, version=2, model="m", seed=3, previous=previous
    )
    assert report.moved_share is None
    assert any("another geometry" in note for note in report.notes)


def test_requests_with_a_zero_signature_are_ignored(data: Data) -> None:
    # Expert (0, 0) used by every request has IDF 0: a request using only it has no
    # signature and must not reach K-means (which refuses zero rows).
    prefill = data.prefill.copy()
    prefill[:, 0] += 1
    prefill[:5] = 0
    prefill[:5, 0] = 3
    _, report = fit_partition(prefill, None, data.geometry, WORKERS, version=1, model="m", seed=3)
    assert report.n_train == N_TRAIN - 5
    assert any("zero signature" in note for note in report.notes)


def test_layer_mask_uses_only_requests_with_decode_summaries(data: Data) -> None:
    decode = data.decode.copy()
    decode[::2] = 0  # half the requests have no profile
    partition, report = fit_partition(
        data.prefill,
        decode,
        data.geometry,
        WORKERS,
        version=1,
        model="m",
        seed=3,
        min_profiled=10,
    )
    assert any("decode summary" in note for note in report.notes)
    assert partition.calibration.idf is not None
    assert report.n_train == N_TRAIN


def test_too_few_profiles_keep_every_layer(data: Data) -> None:
    decode = np.zeros_like(data.decode)
    decode[:3] = data.decode[:3]
    partition, _ = fit_partition(
        data.prefill,
        decode,
        data.geometry,
        WORKERS,
        version=1,
        model="m",
        seed=3,
        min_profiled=10,
    )
    assert partition.calibration.layer_mask.all()


def test_fit_needs_a_request_per_worker(data: Data) -> None:
    with pytest.raises(ValueError, match="usable training requests"):
        fit_partition(data.prefill[:3], None, data.geometry, WORKERS, version=1, model="m", seed=3)


# --- cluster-to-worker matching --------------------------------------------------------------


def test_clusters_map_to_workers_by_overlap() -> None:
    # New cluster c holds exactly the requests old worker perm[c] had.
    perm = [2, 0, 3, 1]
    labels = np.repeat(np.arange(4), 5)
    previous = [WORKERS[perm[c]] for c in labels]
    mapping = assign_clusters_to_workers(labels, 4, WORKERS, previous)
    assert mapping.tolist() == perm


def test_without_previous_clusters_map_in_order() -> None:
    assert assign_clusters_to_workers(np.array([0, 1, 2]), 3, WORKERS[:3], None).tolist() == [
        0,
        1,
        2,
    ]


@settings(max_examples=50, deadline=None)
@given(
    labels=st.lists(st.integers(0, 3), min_size=1, max_size=40),
    previous=st.lists(st.sampled_from([None, *WORKERS, "gone"]), min_size=40, max_size=40),
)
def test_matching_is_a_permutation_that_no_swap_improves(
    labels: list[int], previous: list[str | None]
) -> None:
    prev = previous[: len(labels)]
    mapping = assign_clusters_to_workers(np.array(labels), 4, WORKERS, prev)
    assert sorted(mapping.tolist()) == [0, 1, 2, 3]

    def kept(m: np.ndarray) -> int:
        return sum(
            p is not None and p == WORKERS[m[lab]] for lab, p in zip(labels, prev, strict=True)
        )

    best = kept(mapping)
    for i in range(4):
        for j in range(i + 1, 4):
            swapped = mapping.copy()
            swapped[[i, j]] = swapped[[j, i]]
            assert kept(swapped) <= best


# --- scoring ---------------------------------------------------------------------------------


def _tiny_partition(version: int = 1, idf: bool = True) -> Partition:
    L, E = 2, 3
    calibration = Calibration(
        num_moe_layers=L,
        num_experts=E,
        transform="idf" if idf else "raw",
        idf=np.linspace(0.5, 1.5, L * E).astype(np.float32) if idf else None,
        layer_mask=np.array([True, True]),
    )
    centroids = np.eye(3, L * E, dtype=np.float32)
    return Partition(
        version=version,
        model="m",
        calibration=calibration,
        centroids=centroids,
        owners=np.array([0, 1, 1]),
        workers=("dw0", "dw1"),
        metrics={"inertia": 1.5},
    )


def test_scores_for_gives_minus_inf_to_workers_not_in_the_partition() -> None:
    p = _tiny_partition()
    counts = np.array([[2, 1, 0], [0, 0, 1]], dtype=np.uint32)
    scores = p.scores_for(counts, ["dw1", "dw7", "dw0"])
    assert np.isneginf(scores[1])
    assert np.isfinite(scores[[0, 2]]).all()


def test_a_worker_scores_its_best_centroid() -> None:
    p = _tiny_partition(idf=False)
    counts = np.array([[0, 1, 1], [0, 0, 0]], dtype=np.uint32)
    scores = p.worker_scores(counts)
    sig = p.signature(counts)
    assert scores[1] == pytest.approx(max(sig[1], sig[2]), abs=1e-6)
    assert scores[0] == pytest.approx(sig[0], abs=1e-6)


def test_zero_counts_score_minus_inf_everywhere() -> None:
    p = _tiny_partition()
    assert np.isneginf(p.scores_for(np.zeros((2, 3)), ["dw0", "dw1"])).all()


def test_a_partition_rejects_owners_outside_its_workers() -> None:
    p = _tiny_partition()
    with pytest.raises(ValueError, match="owner"):
        Partition(
            version=1,
            model="m",
            calibration=p.calibration,
            centroids=p.centroids,
            owners=np.array([0, 1, 2]),
            workers=("dw0", "dw1"),
        )


# --- round trips ------------------------------------------------------------------------------


def _probe_counts(p: Partition, n: int = 50) -> np.ndarray:
    rng = np.random.default_rng(1)
    L, E = p.calibration.num_moe_layers, p.calibration.num_experts
    return rng.poisson(0.7, size=(n, L, E)).astype(np.uint32)


def _assert_same_scores(a: Partition, b: Partition) -> None:
    workers = [*a.workers, "not-there"]
    for counts in _probe_counts(a):
        np.testing.assert_array_equal(a.scores_for(counts, workers), b.scores_for(counts, workers))


@pytest.mark.parametrize("idf", [True, False])
def test_blob_round_trip_keeps_scores(idf: bool) -> None:
    p = _tiny_partition(idf=idf)
    blob = decode(encode(partition_to_blob(p)), PartitionBlob)
    back = partition_from_blob(blob)
    assert (back.version, back.model, back.workers) == (p.version, p.model, p.workers)
    _assert_same_scores(p, back)


def test_blob_round_trip_of_a_fitted_partition(fitted: tuple[Partition, FitReport]) -> None:
    p = fitted[0]
    blob = partition_to_blob(p)
    back = partition_from_blob(decode(encode(blob), PartitionBlob))
    _assert_same_scores(p, back)
    assert blob_sha256(partition_to_blob(back)) == blob_sha256(blob)


@pytest.mark.parametrize("idf", [True, False])
def test_the_database_record_holds_the_blob_bytes(idf: bool) -> None:
    p = _tiny_partition(version=4, idf=idf)
    data = encode(partition_to_blob(p))
    record = PartitionRecord(blob_bytes=data, seed=3, n_train=10, parent_version=3)
    stored = dataclasses.replace(record, version=4)  # what the store hands back
    back = partition_from_blob(stored.blob)
    assert back.version == 4
    assert back.metrics == p.metrics
    assert stored.blob_sha256 == blob_sha256(partition_to_blob(p))
    assert encode(partition_to_blob(back)) == data
    _assert_same_scores(p, back)
