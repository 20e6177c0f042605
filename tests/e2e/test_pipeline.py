"""The whole pipeline as processes on real NATS and real PostgreSQL (the demo's flow).

2,000 requests from the trace replayer (400 calibration + 800 per policy x 2 policies)
through 2 router replicas and 2 signature replicas: every request gets exactly one
decision, and the simulated decode workers see a smaller expert union under ELDR than
under round-robin on the same requests.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from eldr.dev.demo import DemoConfig, run_demo

pytestmark = [pytest.mark.e2e, pytest.mark.integration, pytest.mark.slow]


def test_two_thousand_requests_exactly_once_and_eldr_shrinks_the_expert_union(
    pg_url: str, tmp_path: Path
) -> None:
    result = run_demo(
        DemoConfig(
            decoders=4,
            calibration_requests=400,
            evaluation_requests=800,
            synthetic_requests=400,
            database_url=pg_url,
            state_dir=tmp_path,
            signature_replicas=2,
            router_replicas=2,
        )
    )
    assert result.requests_sent == 2000
    assert result.decisions_recorded == 2000
    rr, eldr = result.results
    assert (rr.policy, eldr.policy) == ("round_robin", "eldr")
    for r in (rr, eldr):
        assert r.sent == r.decided == 800
        assert r.lost == 0
        assert r.conflicting == 0
        assert r.finished == 800  # every request decoded by its simulated worker
    assert result.partition_version is not None
    assert eldr.fallbacks == {}  # every ELDR decision used the partition
    assert eldr.expert_union_mean < rr.expert_union_mean
