"""Fitting the synthetic workload to trace statistics (`eldr.core.workload.synthetic_fit`)."""

from __future__ import annotations

import numpy as np
import pytest

from eldr.core.workload.synthetic import SyntheticSpec, generate
from eldr.core.workload.synthetic_fit import (
    FITTED_SPEC,
    fit_synthetic_spec,
    uniform_range,
    workload_statistics,
)

TRUTH = SyntheticSpec(
    num_topics=3,
    num_moe_layers=4,
    num_experts=16,
    top_k=1,
    popularity_skew=1.3,
    rho=0.35,
    topic_specialisation=0.7,
    token_affinity=0.3,
    prompt_len_range=(4, 20),
    decode_len_range=(16, 24),
    shared_prefix_blocks=0,
)


def test_statistics_of_a_workload() -> None:
    stats = workload_statistics(generate(TRUTH, 60, np.random.default_rng(1)))
    assert stats.requests == 60
    assert stats.labels == 3
    assert 0 < stats.prefill_decode_pearson_median < 1
    assert stats.decode_zipf_exponent > 0
    assert 0 < stats.decode_distinct_share <= 1
    assert 0 < stats.label_total_variation < 1
    assert 4 <= stats.prompt_tokens_min <= stats.prompt_tokens_max <= 20
    assert 16 <= stats.decode_tokens_mean <= 24


def test_more_correlation_and_skew_measure_as_such() -> None:
    low = workload_statistics(generate(TRUTH, 60, np.random.default_rng(1)))
    more = SyntheticSpec(**{**TRUTH.__dict__, "rho": 0.9, "popularity_skew": 2.5})
    high = workload_statistics(generate(more, 60, np.random.default_rng(1)))
    assert high.prefill_decode_pearson_median > low.prefill_decode_pearson_median
    assert high.decode_zipf_exponent > low.decode_zipf_exponent


def test_uniform_range_keeps_mean_and_spread_inside_what_was_seen() -> None:
    assert uniform_range(50.0, 10.0, 1, 200) == (33, 67)
    # The real traces: prompts (mean 18.6, sd 13.0, 1-59), decodes (127.0, 8.2, 36-128).
    assert uniform_range(18.58, 13.03, 1, 59) == (1, 36)
    assert uniform_range(127.0, 8.2, 36, 128) == (126, 128)


def test_the_fit_matches_the_statistics_of_a_known_workload() -> None:
    truth = generate(TRUTH, 60, np.random.default_rng(5))
    fit = fit_synthetic_spec(truth, seed=0, max_evaluations=40)
    t, a = fit.target, fit.achieved
    assert fit.spec.num_topics == 3
    assert a.prefill_decode_pearson_median == pytest.approx(
        t.prefill_decode_pearson_median, abs=0.05
    )
    assert a.decode_zipf_exponent == pytest.approx(t.decode_zipf_exponent, rel=0.1)
    assert a.decode_distinct_share == pytest.approx(t.decode_distinct_share, rel=0.1)
    assert a.label_total_variation == pytest.approx(t.label_total_variation, rel=0.15)


def test_the_checked_in_fit_has_the_real_traces_geometry() -> None:
    # Llama-4-Maverick: 24 MoE layers x 128 experts, top-1; one topic per MMLU subject.
    assert (FITTED_SPEC.num_moe_layers, FITTED_SPEC.num_experts, FITTED_SPEC.top_k) == (24, 128, 1)
    assert FITTED_SPEC.num_topics == 3
