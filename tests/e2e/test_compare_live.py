"""`eldr compare-live` with tiny sizes: the live stack and the three simulations of each
pass, every request accounted for on both sides, and the report and JSON produced."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eldr.core.workload.synthetic import SyntheticSpec
from eldr.dev.compare import POLICIES, format_compare, run_compare
from eldr.dev.demo import DemoConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TINY = SyntheticSpec(
    num_topics=3,
    num_moe_layers=4,
    num_experts=16,
    top_k=1,
    decode_len_range=(8, 16),
    prompt_len_range=(4, 24),
    shared_prefix_blocks=0,
)


def test_compare_live_runs_every_policy_live_and_simulated(tmp_path: Path) -> None:
    config = DemoConfig(
        decoders=2,
        calibration_requests=60,
        evaluation_requests=60,
        synthetic_requests=60,
        synthetic_spec=TINY,
        rate_per_s=40.0,
        state_dir=tmp_path,
        policies=POLICIES,
    )
    result = run_compare(config)
    assert [c.policy for c in result.comparisons] == [p.name for p in POLICIES]
    for demo_row, c in zip(result.demo.results, result.comparisons, strict=True):
        assert demo_row.sent == demo_row.decided == demo_row.finished == 60
        for measured in (c.live, c.sim_live_information, c.sim_perfect, c.replay_live_assignments):
            assert measured.union > 0
            assert measured.tpot_p50_ms > 0
        assert c.sim_live_information.view_error is not None
        assert c.delays_ms["decision_hop_s"] > 0
        assert sum(c.split["shares"]) == pytest.approx(1.0, abs=0.01)
    text = format_compare(result)
    assert "sim live-info" in text
    out = tmp_path / "compare.json"
    out.write_text(json.dumps(result.as_dict()))
    loaded = json.loads(out.read_text())
    assert len(loaded["comparisons"]) == len(POLICIES)
