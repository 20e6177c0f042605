"""Synthetic workload generator: realism constraints and knobs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import scipy.stats
from hypothesis import given, settings
from hypothesis import strategies as st

from eldr.core.workload.synthetic import (
    SyntheticSpec,
    fit_zipf_exponent,
    generate,
    make_world,
    zipf_weights,
)
from eldr.core.workload.trace import TraceSet, counts_matrix
from support.prereq import SHARED_DATA, shared_data

SMALL = SyntheticSpec(
    num_topics=3,
    num_moe_layers=4,
    num_experts=16,
    top_k=2,
    prompt_len_range=(4, 30),
    decode_len_range=(5, 20),
    shared_prefix_blocks=1,
    block_size=8,
)

OLMOE_COUNTS = SHARED_DATA / "olmoe-routing-counts" / "expert_counts_by_domain.json"


@pytest.fixture(scope="module")
def small_set() -> TraceSet:
    return generate(SMALL, 60, np.random.default_rng(11))


def mean_prefill_decode_pearson(ts: TraceSet) -> float:
    pre = counts_matrix(ts.traces, ts.geometry, "prefill")
    dec = counts_matrix(ts.traces, ts.geometry, "decode")
    with warnings.catch_warnings():  # a constant row has no correlation (NaN, skipped)
        warnings.simplefilter("ignore", scipy.stats.ConstantInputWarning)
        return float(np.nanmean(scipy.stats.pearsonr(pre, dec, axis=1).statistic))


def test_generated_set_is_marked_synthetic(small_set: TraceSet) -> None:
    assert small_set.synthetic is True
    assert small_set.source.startswith("synthetic(")
    assert "rho=0.6" in small_set.source


def test_geometry_matches_spec(small_set: TraceSet) -> None:
    geo = small_set.geometry
    assert (geo.num_moe_layers, geo.num_experts, geo.top_k) == (4, 16, 2)


def test_labels_are_topic_names(small_set: TraceSet) -> None:
    assert set(small_set.labels) <= {"topic0", "topic1", "topic2"}
    assert len(small_set.labels) == 3


def test_shapes_lengths_and_token_ids(small_set: TraceSet) -> None:
    prefix = SMALL.prefix_tokens
    for t in small_set.traces:
        assert t.token_ids is not None
        assert t.token_ids.shape == (t.prompt_tokens,)
        assert prefix + 4 <= t.prompt_tokens <= prefix + 30
        assert 5 <= t.decode_tokens <= 20
        assert t.prefill.shape[1:] == (4, 2)
        assert t.decode.shape[1:] == (4, 2)
        assert t.prefill.dtype == np.int16
        assert int(t.prefill.min()) >= 0
        assert int(t.prefill.max()) < 16
        assert int(t.decode.min()) >= 0
        assert int(t.decode.max()) < 16


def test_request_ids_unique_with_prefix() -> None:
    ts = generate(SMALL, 5, np.random.default_rng(0), id_prefix="cal")
    assert [t.request_id for t in ts.traces] == [f"cal-{i:06d}" for i in range(5)]


def test_top_k_experts_are_distinct(small_set: TraceSet) -> None:
    for t in small_set.traces:
        for ids in (t.prefill, t.decode):
            ordered = np.sort(ids, axis=-1)
            assert np.all(np.diff(ordered, axis=-1) > 0)


def test_same_topic_requests_share_prefix_tokens_and_experts(small_set: TraceSet) -> None:
    prefix = SMALL.prefix_tokens
    by_topic: dict[str, list[int]] = {}
    for i, t in enumerate(small_set.traces):
        by_topic.setdefault(t.label, []).append(i)
    checked = 0
    for members in by_topic.values():
        first = small_set.traces[members[0]]
        for j in members[1:]:
            other = small_set.traces[j]
            assert first.token_ids is not None
            assert other.token_ids is not None
            assert np.array_equal(first.token_ids[:prefix], other.token_ids[:prefix])
            assert np.array_equal(first.prefill[:prefix], other.prefill[:prefix])
            checked += 1
    assert checked > 0


@given(
    st.lists(st.integers(0, 31_999), min_size=1, max_size=30),
    st.lists(st.integers(0, 31_999), max_size=20),
    st.lists(st.integers(0, 31_999), max_size=20),
)
@settings(max_examples=40, deadline=None)
def test_routing_is_causal(prefix: list[int], tail_a: list[int], tail_b: list[int]) -> None:
    world = make_world(SMALL, np.random.default_rng(5))
    a = world.route_prefill(np.array(prefix + tail_a, dtype=np.uint32))
    b = world.route_prefill(np.array(prefix + tail_b, dtype=np.uint32))
    assert np.array_equal(a[: len(prefix)], b[: len(prefix)])


def test_routing_depends_on_earlier_tokens() -> None:
    world = make_world(SMALL, np.random.default_rng(5))
    tail = list(range(100, 140))
    a = world.route_prefill(np.array([1, *tail], dtype=np.uint32))
    b = world.route_prefill(np.array([2, *tail], dtype=np.uint32))
    assert not np.array_equal(a[1:], b[1:])


def test_same_seed_same_workload() -> None:
    a = generate(SMALL, 10, np.random.default_rng(3))
    b = generate(SMALL, 10, np.random.default_rng(3))
    for x, y in zip(a.traces, b.traces, strict=True):
        assert np.array_equal(x.prefill, y.prefill)
        assert np.array_equal(x.decode, y.decode)
        assert x.token_ids is not None
        assert y.token_ids is not None
        assert np.array_equal(x.token_ids, y.token_ids)


def test_world_reuse_keeps_the_model() -> None:
    world = make_world(SMALL, np.random.default_rng(8))
    a = generate(SMALL, 20, np.random.default_rng(1), world=world)
    b = generate(SMALL, 20, np.random.default_rng(2), world=world)
    # Same world: the topic's shared prefix routes identically across the two sets.
    prefix = SMALL.prefix_tokens
    first_a = {t.label: t for t in reversed(a.traces)}
    for t in b.traces:
        if t.label in first_a:
            assert np.array_equal(t.prefill[:prefix], first_a[t.label].prefill[:prefix])


def test_world_for_other_spec_rejected() -> None:
    world = make_world(SMALL, np.random.default_rng(8))
    with pytest.raises(ValueError, match="different SyntheticSpec"):
        generate(SyntheticSpec(), 1, np.random.default_rng(0), world=world)


def test_higher_rho_raises_prefill_decode_correlation() -> None:
    def corr(rho: float) -> float:
        spec = SyntheticSpec(
            num_topics=4, num_moe_layers=4, num_experts=32, top_k=2, rho=rho,
            prompt_len_range=(16, 40), decode_len_range=(32, 64),
        )  # fmt: skip
        return mean_prefill_decode_pearson(generate(spec, 80, np.random.default_rng(4)))

    low, mid, high = corr(0.1), corr(0.5), corr(0.9)
    assert low < mid < high


def test_popularity_skew_shows_in_counts() -> None:
    def fitted(skew: float) -> float:
        spec = SyntheticSpec(
            num_topics=1, num_moe_layers=2, num_experts=32, top_k=1, popularity_skew=skew,
            topic_specialisation=0.0, token_affinity=0.0, prompt_len_range=(64, 64),
            decode_len_range=(0, 0), shared_prefix_blocks=0,
        )  # fmt: skip
        ts = generate(spec, 60, np.random.default_rng(0))
        counts = counts_matrix(ts.traces, ts.geometry).sum(axis=0).reshape(2, 32)
        return fit_zipf_exponent(counts)

    assert fitted(0.2) < fitted(1.2)


def test_zipf_weights_normalised_and_decreasing() -> None:
    w = zipf_weights(10, 1.3)
    assert w.sum() == pytest.approx(1.0)
    assert np.all(np.diff(w) < 0)


@given(st.floats(0.0, 3.0), st.integers(4, 200))
def test_fit_zipf_exponent_recovers_exponent(exponent: float, n: int) -> None:
    counts = zipf_weights(n, exponent) * 1e9
    assert fit_zipf_exponent(counts) == pytest.approx(exponent, abs=1e-6)


def test_fit_zipf_exponent_needs_two_positive_counts() -> None:
    with pytest.raises(ValueError, match="two positive counts"):
        fit_zipf_exponent(np.array([5.0, 0.0]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_k": 40, "num_experts": 32}, "top_k"),
        ({"rho": 1.5}, "rho"),
        ({"topic_specialisation": -0.1}, "topic_specialisation"),
        ({"prompt_len_range": (10, 5)}, "prompt_len_range"),
        ({"block_size": 0}, "block_size"),
        ({"vocab_size": 3}, "vocab_size"),
        ({"token_affinity": 1.0}, "token_affinity"),
    ],
)
def test_spec_validation(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SyntheticSpec(**kwargs)  # type: ignore[arg-type]


def test_zero_decode_length_allowed() -> None:
    spec = SyntheticSpec(num_moe_layers=2, num_experts=8, top_k=2, decode_len_range=(0, 0))
    ts = generate(spec, 3, np.random.default_rng(0))
    assert all(t.decode.shape == (0, 2, 2) for t in ts.traces)


@pytest.mark.realdata
def test_olmoe_popularity_skew_is_plausible() -> None:
    shared_data("olmoe-routing-counts", OLMOE_COUNTS.name)  # skips (or fails) when absent
    from eldr.data.olmoe import load_domain_expert_counts, popularity_skew

    per_domain = load_domain_expert_counts(OLMOE_COUNTS)
    assert set(per_domain) >= {"arxiv", "github", "wikipedia"}
    assert all(c.shape == (3, 64) for c in per_domain.values())
    olmoe = popularity_skew(OLMOE_COUNTS)
    mixtral = popularity_skew(OLMOE_COUNTS, "mistralai/Mixtral-8x7B-v0.1")
    # OLMoE's experts are far more unevenly used than Mixtral's 8 (see data README).
    assert 0.3 < olmoe < 2.0
    assert mixtral < olmoe
