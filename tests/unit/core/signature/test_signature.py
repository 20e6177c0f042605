"""Signature transforms, IDF, greedy layer mask, Calibration."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from eldr.core.signature.signature import (
    Calibration,
    compute_idf,
    fit_calibration,
    greedy_layer_mask,
    sample_pairs,
)
from eldr.core.workload.trace import ModelGeometry

L, E = 3, 4


def geometry(layers: int = L, experts: int = E) -> ModelGeometry:
    return ModelGeometry(
        num_layers=layers, moe_layers=tuple(range(layers)), num_experts=experts, top_k=1
    )


def raw_calibration(mask: tuple[bool, ...] = (True, True, True)) -> Calibration:
    return Calibration(L, E, "raw", None, np.array(mask))


def signal_case(
    seed: int,
    n: int = 160,
    layers: int = 6,
    experts: int = 8,
    signal_layers: tuple[int, ...] = (0, 3),
) -> tuple[np.ndarray, np.ndarray]:
    """Prefill/decode counts where only `signal_layers` of the prefill predict decode.

    Each request has a latent group; its decode counts concentrate on the group's experts
    at every layer. Prefill counts at the signal layers do too, weakly, so that two signal
    layers together predict better than one; at the other
    layers they concentrate on the experts of an unrelated random group, so adding such a
    layer blurs the grouping.
    """
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, 4, size=n)
    prefill = rng.poisson(1.0, size=(n, layers, experts)).astype(np.float32)
    decode = rng.poisson(1.0, size=(n, layers, experts)).astype(np.float32)
    for i, g in enumerate(groups):
        hot = [2 * g, 2 * g + 1]
        decode[i][:, hot] += rng.poisson(8.0, size=(layers, 2))
        for layer in range(layers):
            h = g if layer in signal_layers else int(rng.integers(0, 4))
            prefill[i, layer, [2 * h, 2 * h + 1]] += rng.poisson(2.0, size=2)
    return prefill.reshape(n, -1), decode.reshape(n, -1)


def test_a_geometry_known_by_its_moe_layers_only() -> None:
    g = ModelGeometry.of_moe(3, 16, top_k=2)
    assert (g.num_layers, g.moe_layers, g.num_experts, g.top_k) == (3, (0, 1, 2), 16, 2)
    assert g.signature_dim == 48
    with pytest.raises(ValueError, match="top_k"):
        ModelGeometry.of_moe(3, 16, top_k=17)


def test_idf_hand_computed() -> None:
    counts = np.array(
        [[1, 0, 2, 0], [0, 0, 3, 0], [1, 0, 0, 0]],
        dtype=np.float32,
    )
    # N = 3, df = [2, 0, 2, 0]: idf = log(4 / 3), log(4 / 1), log(4 / 3), log(4 / 1).
    expected = [math.log(4 / 3), math.log(4), math.log(4 / 3), math.log(4)]
    assert compute_idf(counts).tolist() == pytest.approx(expected)
    assert compute_idf(counts).dtype == np.float32


def test_idf_of_expert_used_by_all_requests_is_zero() -> None:
    counts = np.array([[5, 1], [2, 0]], dtype=np.float32)
    assert compute_idf(counts)[0] == 0.0


@given(hnp.arrays(np.float32, (5, L * E), elements=st.integers(0, 20).map(float)))
def test_apply_gives_unit_or_zero_vectors(counts: np.ndarray) -> None:
    sigs = raw_calibration().apply(counts)
    norms = np.linalg.norm(sigs, axis=1)
    for row, norm in zip(counts, norms, strict=True):
        if row.any():
            assert norm == pytest.approx(1.0, abs=1e-5)
        else:
            assert norm == 0.0
    assert not np.isnan(sigs).any()


def test_apply_zero_vector_stays_zero() -> None:
    sig = raw_calibration().apply(np.zeros(L * E))
    assert sig.tolist() == [0.0] * (L * E)


def test_apply_masked_dimension() -> None:
    cal = raw_calibration((True, False, True))
    assert cal.dim == 2 * E
    assert cal.kept_layers == (0, 2)
    assert cal.apply(np.ones(L * E)).shape == (2 * E,)


def test_apply_ignores_masked_layers() -> None:
    cal = raw_calibration((True, False, True))
    a = np.arange(L * E, dtype=np.float32).reshape(L, E)
    b = a.copy()
    b[1] = 100.0
    assert np.array_equal(cal.apply(a), cal.apply(b))


def test_apply_single_and_batch_shapes_agree() -> None:
    cal = raw_calibration()
    counts = np.arange(2 * L * E, dtype=np.float32).reshape(2, L * E)
    batch = cal.apply(counts)
    assert batch.shape == (2, L * E)
    assert batch.dtype == np.float32
    assert np.array_equal(cal.apply(counts[0]), batch[0])
    assert np.array_equal(cal.apply(counts[1].reshape(L, E)), batch[1])
    assert np.array_equal(cal.apply(counts.reshape(2, L, E)), batch)


def test_apply_rejects_wrong_shape_with_expected_shapes_in_message() -> None:
    with pytest.raises(ValueError, match=r"\[12\], \[3, 4\], \[N, 12\] or \[N, 3, 4\]; got \(5,\)"):
        raw_calibration().apply(np.zeros(5))


def test_raw_vs_idf_weights() -> None:
    # Expert 0 of layer 0 is active in every request: idf drops it, raw keeps it.
    counts = np.zeros((4, L * E), dtype=np.float32)
    counts[:, 0] = 3.0
    counts[0, 5] = 1.0
    raw, _ = fit_calibration(
        counts, None, geometry(), transform="raw", rng=np.random.default_rng(0)
    )
    idf, _ = fit_calibration(
        counts, None, geometry(), transform="idf", rng=np.random.default_rng(0)
    )
    assert raw.apply(counts[0])[0] > 0.9
    assert idf.apply(counts[0])[0] == 0.0
    assert idf.apply(counts[0])[5] == pytest.approx(1.0)


def test_idf_apply_equals_manual_formula() -> None:
    rng = np.random.default_rng(3)
    counts = rng.poisson(0.7, size=(20, L * E)).astype(np.float32)
    cal, _ = fit_calibration(counts, None, geometry(), transform="idf", rng=rng)
    weighted = counts[7] * compute_idf(counts)
    expected = weighted / np.linalg.norm(weighted)
    assert cal.apply(counts[7]) == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_mask_picks_the_decode_relevant_layers(seed: int) -> None:
    prefill, decode = signal_case(seed)
    mask, trace, n_pairs = greedy_layer_mask(prefill, decode, 6, 8, np.random.default_rng(seed))
    assert np.flatnonzero(mask).tolist() == [0, 3]
    assert {trace[0].layer, trace[1].layer} == {0, 3}
    assert len(trace) == 6
    assert n_pairs == 160 * 159 // 2


def test_greedy_weights_equal_pre_weighted_counts() -> None:
    prefill, decode = signal_case(9, n=40)
    weights = np.random.default_rng(9).random(6 * 8).astype(np.float32)
    a = greedy_layer_mask(prefill, decode, 6, 8, np.random.default_rng(1), weights=weights)
    b = greedy_layer_mask(prefill * weights, decode, 6, 8, np.random.default_rng(1))
    assert np.array_equal(a[0], b[0])
    assert [s.layer for s in a[1]] == [s.layer for s in b[1]]
    assert [s.correlation for s in a[1]] == pytest.approx([s.correlation for s in b[1]])


def test_greedy_trace_peaks_at_the_mask() -> None:
    prefill, decode = signal_case(5)
    mask, trace, _ = greedy_layer_mask(prefill, decode, 6, 8, np.random.default_rng(5))
    corrs = [s.correlation for s in trace]
    assert int(mask.sum()) == int(np.argmax(corrs)) + 1


def test_fit_calibration_greedy_report() -> None:
    prefill, decode = signal_case(7)
    geo = geometry(6, 8)
    cal, report = fit_calibration(prefill, decode, geo, rng=np.random.default_rng(7), max_pairs=500)
    assert cal.kept_layers == (0, 3)
    assert report.layer_selection_used == "greedy"
    assert report.n_pairs == 500
    assert report.kept_layers == (0, 3)
    assert report.peak_correlation >= report.all_layers_correlation
    assert report.peak_correlation == max(s.correlation for s in report.greedy_trace)


def test_fit_calibration_without_decode_keeps_all_layers_and_says_so() -> None:
    prefill, _ = signal_case(0, n=20)
    cal, report = fit_calibration(prefill, None, geometry(6, 8), rng=np.random.default_rng(0))
    assert cal.layer_mask.all()
    assert report.layer_selection_used == "all"
    assert report.greedy_trace == ()
    assert any("no decode counts" in note for note in report.notes)


def test_fit_calibration_all_layers_on_request() -> None:
    prefill, decode = signal_case(0, n=20)
    cal, report = fit_calibration(
        prefill, decode, geometry(6, 8), layer_selection="all", rng=np.random.default_rng(0)
    )
    assert cal.layer_mask.all()
    assert report.layer_selection_used == "all"
    assert report.notes == ()


def test_fit_calibration_rejects_wrong_width() -> None:
    with pytest.raises(ValueError, match=r"prefill_counts must be shaped \[requests, 12\]"):
        fit_calibration(np.zeros((3, 11)), None, geometry(), rng=np.random.default_rng(0))


def test_fit_calibration_rejects_request_count_mismatch() -> None:
    with pytest.raises(ValueError, match="3 requests but decode_counts has 2"):
        fit_calibration(
            np.zeros((3, 12)), np.zeros((2, 12)), geometry(), rng=np.random.default_rng(0)
        )


def test_fit_calibration_rejects_unknown_transform() -> None:
    with pytest.raises(ValueError, match="transform must be one of"):
        fit_calibration(
            np.zeros((3, 12)), None, geometry(), transform="gate", rng=np.random.default_rng(0)
        )


def test_fit_calibration_rejects_negative_counts() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        fit_calibration(-np.ones((3, 12)), None, geometry(), rng=np.random.default_rng(0))


@given(st.integers(2, 60), st.integers(1, 400), st.integers(0, 1000))
@settings(max_examples=50)
def test_sample_pairs_distinct_and_ordered(n: int, max_pairs: int, seed: int) -> None:
    i, j = sample_pairs(n, max_pairs, np.random.default_rng(seed))
    assert i.shape == j.shape
    assert i.shape[0] == min(max_pairs, n * (n - 1) // 2)
    assert np.all(i < j)
    assert np.all((i >= 0) & (j < n))
    assert len(set(zip(i.tolist(), j.tolist(), strict=True))) == i.shape[0]


def test_sample_pairs_is_deterministic_for_a_seed() -> None:
    a = sample_pairs(1000, 300, np.random.default_rng(1))
    b = sample_pairs(1000, 300, np.random.default_rng(1))
    assert np.array_equal(a[0], b[0])
    assert np.array_equal(a[1], b[1])


def test_round_trip_through_arrays() -> None:
    rng = np.random.default_rng(0)
    counts = rng.poisson(1.0, size=(10, L * E)).astype(np.float32)
    cal = Calibration(L, E, "idf", compute_idf(counts), np.array([True, False, True]))
    data = cal.to_arrays()
    back = Calibration.from_arrays(data)
    assert back.transform == "idf"
    assert back.idf is not None
    assert cal.idf is not None
    assert np.array_equal(back.idf, cal.idf)
    assert np.array_equal(back.layer_mask, cal.layer_mask)
    assert np.array_equal(back.apply(counts), cal.apply(counts))


def test_round_trip_through_npz_bytes() -> None:
    counts = np.random.default_rng(1).poisson(1.0, size=(10, L * E)).astype(np.float32)
    cal = Calibration(L, E, "idf", compute_idf(counts), np.array([False, True, True]))
    buf = io.BytesIO()
    np.savez(buf, **cal.to_arrays())  # type: ignore[arg-type]
    buf.seek(0)
    with np.load(buf) as loaded:
        back = Calibration.from_arrays(dict(loaded))
    assert back.kept_layers == (1, 2)
    assert np.array_equal(back.apply(counts), cal.apply(counts))


def test_round_trip_raw_has_no_idf_key() -> None:
    data = raw_calibration().to_arrays()
    assert "idf" not in data
    assert Calibration.from_arrays(data).idf is None


def test_from_arrays_rejects_unknown_version() -> None:
    data = dict(raw_calibration().to_arrays())
    data["version"] = 99
    with pytest.raises(ValueError, match="version 99 unsupported"):
        Calibration.from_arrays(data)


def test_from_arrays_rejects_missing_key() -> None:
    data = dict(raw_calibration().to_arrays())
    del data["layer_mask"]
    with pytest.raises(ValueError, match="lacks 'layer_mask'"):
        Calibration.from_arrays(data)


def test_calibration_rejects_bad_mask_shape() -> None:
    with pytest.raises(ValueError, match=r"layer_mask must be bool \[3\]"):
        Calibration(L, E, "raw", None, np.array([True, False]))


def test_calibration_rejects_empty_mask() -> None:
    with pytest.raises(ValueError, match="at least one layer"):
        Calibration(L, E, "raw", None, np.zeros(L, dtype=bool))


def test_calibration_rejects_idf_of_wrong_length() -> None:
    with pytest.raises(ValueError, match=r"idf must be shaped \[12\]"):
        Calibration(L, E, "idf", np.ones(5, dtype=np.float32), np.ones(L, dtype=bool))


def test_calibration_arrays_are_read_only() -> None:
    cal = raw_calibration()
    with pytest.raises(ValueError, match="read-only"):
        cal.layer_mask[0] = False
